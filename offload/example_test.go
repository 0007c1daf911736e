package offload_test

import (
	"encoding/json"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
)

// The trainer's loop: build the optimizer, set the initial weights, then per
// iteration read the working copy, write gradients into the optimizer's
// buffers and Step; checkpoint, and resume in a new optimizer.
func Example() {
	params := []offload.Param{
		{Name: "wte.weight", Shape: []int{8, 4}},
		{Name: "ln_f.bias", Shape: []int{4}},
	}
	hyper := adam.DefaultHyper() // torch.optim.AdamW's defaults
	hyper.LR = 1e-2
	opts := offload.Options{
		Hyper:        hyper,
		SubgroupSize: 16,        // elements per subgroup (DeepSpeed's sub_group_size)
		GradDType:    adam.BF16, // what backward writes
		WorkingDType: adam.BF16, // the copy forward reads; 0 reads the fp32 master weights
		MaxGradNorm:  1.0,       // clip_grad_norm_; 0 disables
	}
	opt, err := offload.New(params, opts)
	if err != nil {
		log.Fatal(err)
	}
	defer opt.Close()
	for _, p := range opt.Params() {
		init := make([]float32, p.Len)
		for i := range init {
			init[i] = 0.5
		}
		if err := opt.SetParam(p.Name, init); err != nil {
			log.Fatal(err)
		}
	}
	root, _ := os.MkdirTemp("", "dos-example-")
	defer os.RemoveAll(root)

	for iter := 1; iter <= 3; iter++ {
		for i := range opt.Params() {
			w := opt.Working(i).Uint16() // forward/backward read this (bf16 bit patterns)
			g := opt.Grad(i).Uint16()    // and overwrite the gradient here
			for j := range g {
				g[j] = adam.F32ToBF16(adam.BF16ToF32(w[j]) - 0.25) // d/dw of (w-0.25)^2 / 2
			}
		}
		res, err := opt.Step(offload.StepArgs{LossScale: 1})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("iter %d: step %d skipped %t grad_norm %.3f\n", iter, res.Step, res.Skipped, res.GradNorm)
	}
	if _, err := opt.SaveCheckpoint(checkpoint.OS, root, map[string]any{"trainer": map[string]int{"iteration": 3}}); err != nil {
		log.Fatal(err)
	}

	resumed, err := offload.New(params, opts)
	if err != nil {
		log.Fatal(err)
	}
	defer resumed.Close()
	dir, objects, err := resumed.LoadCheckpoint(checkpoint.OS, root) // a root loads its latest checkpoint
	if err != nil {
		log.Fatal(err)
	}
	var trainer struct{ Iteration int }
	if err := json.Unmarshal(objects["trainer"], &trainer); err != nil {
		log.Fatal(err)
	}
	w, err := resumed.Master(0)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("resumed %s at step %d, iteration %d, wte.weight[0] %.4f\n",
		filepath.Base(dir), resumed.StepCount(), trainer.Iteration, w[0])
	// Output:
	// iter 1: step 1 skipped false grad_norm 1.500
	// iter 2: step 2 skipped false grad_norm 1.441
	// iter 3: step 3 skipped false grad_norm 1.383
	// resumed step-000000003 at step 3, iteration 3, wte.weight[0] 0.4699
}

// Checkpointing lazily (DataStates-LLM): SaveAsync hands the state to the
// engine and returns; the next Step waits only for the capture of each
// subgroup it updates; the handle says when the checkpoint is durable.
func ExampleOptimizer_SaveAsync() {
	opt, err := offload.New([]offload.Param{{Name: "w", Shape: []int{64}}}, offload.Options{SubgroupSize: 16})
	if err != nil {
		log.Fatal(err)
	}
	defer opt.Close()
	root, _ := os.MkdirTemp("", "dos-example-")
	defer os.RemoveAll(root)
	engine, err := checkpoint.NewEngine(checkpoint.OS, root, checkpoint.EngineOptions{Keep: 2})
	if err != nil {
		log.Fatal(err)
	}
	g, err := opt.GradOf("w")
	if err != nil {
		log.Fatal(err)
	}
	var last *checkpoint.Handle
	for iter := int64(1); iter <= 4; iter++ {
		for i, grad := 0, g.Float32(); i < len(grad); i++ {
			grad[i] = float32(i%7) - 3 // backward writes here
		}
		res, err := opt.Step(offload.StepArgs{})
		if err != nil { // also a background save's failure, once
			log.Fatal(err)
		}
		fmt.Printf("iter %d: step %d\n", iter, res.Step)
		if iter%2 == 0 {
			if last, err = opt.SaveAsync(engine, iter, map[string]any{"trainer": map[string]int64{"iteration": iter}}); err != nil {
				log.Fatal(err)
			}
		}
	}
	dir, err := last.Wait() // durable and committed: latest names it
	if err != nil {
		log.Fatal(err)
	}
	if err := engine.Close(); err != nil {
		log.Fatal(err)
	}
	dirs, _ := checkpoint.List(checkpoint.OS, root)
	fmt.Printf("latest %s, %d kept\n", filepath.Base(dir), len(dirs))
	// Output:
	// iter 1: step 1
	// iter 2: step 2
	// iter 3: step 3
	// iter 4: step 4
	// latest step-000000004, 2 kept
}
