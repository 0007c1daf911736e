// Command quickstart is a complete training loop around offload.Optimizer: it
// fits a linear layer y = W x + b to a fixed random teacher, reading the bf16
// working copy for the forward pass, writing fp32 gradients into the
// optimizer's buffers, clipping, and checkpointing every --every steps
// lazily (SaveAsync: the state is captured and flushed in the background
// while training goes on; each checkpoint is reported when durable). Then
// it resumes a fresh optimizer from the checkpoint nearest the middle of the
// run and shows that the resumed run ends bit for bit where the straight one
// did. With --dir the checkpoints stay for `dos ckpt ls DIR`.
//
//	go run ./examples/quickstart [--steps 200] [--every 50] [--dir DIR]
package main

import (
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
)

const (
	in, out = 64, 32 // layer width
	batch   = 16
)

var params = []offload.Param{
	{Name: "layer.weight", Shape: []int{out, in}},
	{Name: "layer.bias", Shape: []int{out}},
}

func options() offload.Options {
	return offload.Options{
		Hyper:        adam.Hyper{Mode: adam.AdamW, LR: 3e-2, Betas: [2]float64{0.9, 0.99}, Eps: 1e-8, WeightDecay: 1e-4},
		SubgroupSize: 500, // elements: 5 subgroups, some cutting the weight
		GradDType:    adam.F32,
		WorkingDType: adam.BF16,
		MaxGradNorm:  1.0,
	}
}

// teacher returns the fixed target weights.
func teacher() (w, b []float32) {
	r := rand.New(rand.NewPCG(42, 0))
	w, b = make([]float32, out*in), make([]float32, out)
	for i := range w {
		w[i] = float32(r.NormFloat64() / math.Sqrt(in))
	}
	for i := range b {
		b[i] = float32(r.NormFloat64() * 0.1)
	}
	return w, b
}

// step computes the mean squared error of one batch (drawn from the step
// number, so a resumed run sees the same data) and writes its gradient into
// the optimizer's buffers.
func step(o *offload.Optimizer, t int64, tw, tb []float32) float64 {
	r := rand.New(rand.NewPCG(uint64(t), 1))
	w, b := o.Working(0).Uint16(), o.Working(1).Uint16()
	gw, gb := o.Grad(0).Float32(), o.Grad(1).Float32()
	clear(gw)
	clear(gb)
	x := make([]float32, in)
	var loss float64
	for range batch {
		for i := range x {
			x[i] = float32(r.NormFloat64())
		}
		for j := 0; j < out; j++ {
			y := adam.BF16ToF32(b[j])
			want := tb[j]
			for i := 0; i < in; i++ {
				y += adam.BF16ToF32(w[j*in+i]) * x[i]
				want += tw[j*in+i] * x[i]
			}
			d := y - want
			loss += float64(d * d)
			g := 2 * d / (batch * out)
			gb[j] += g
			for i := 0; i < in; i++ {
				gw[j*in+i] += g * x[i]
			}
		}
	}
	return loss / (batch * out)
}

func newOptimizer() *offload.Optimizer {
	o, err := offload.New(params, options())
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
	return o
}

func main() {
	steps := flag.Int64("steps", 200, "training steps")
	every := flag.Int64("every", 50, "checkpoint interval in steps")
	dir := flag.String("dir", "", "checkpoint root directory (default: a new temporary directory, removed at exit)")
	flag.Parse()
	if *steps < 2 || *every < 1 || *every >= *steps {
		fmt.Fprintln(os.Stderr, "quickstart: want --steps >= 2 and 1 <= --every < --steps")
		os.Exit(2)
	}
	root := *dir
	if root == "" {
		tmp, err := os.MkdirTemp("", "dos-quickstart-")
		if err != nil {
			fmt.Fprintln(os.Stderr, "quickstart:", err)
			os.Exit(1)
		}
		defer os.RemoveAll(tmp)
		root = tmp
	}
	// One writer per root, checked before training: a root that already
	// holds checkpoints is not written over (checkpoint.Save would refuse
	// to replace a committed step only when it reaches it).
	lock, err := checkpoint.Lock(checkpoint.OS, root)
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
	defer lock.Unlock()
	info, err := checkpoint.Inspect(checkpoint.OS, root)
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
	if !info.Fresh() {
		fmt.Fprintf(os.Stderr, "quickstart: --dir %s already holds checkpoints; choose another\n", root)
		os.Exit(1)
	}
	tw, tb := teacher()

	o := newOptimizer()
	defer o.Close()
	fmt.Printf("quickstart: %d params in %d subgroups, %v\n", o.NumParams(), len(o.Subgroups()), o.Options())
	r := rand.New(rand.NewPCG(7, 7))
	for _, p := range o.Params() { // initial master weights
		v := make([]float32, p.Len)
		for i := range v {
			v[i] = float32(r.NormFloat64() * 0.02)
		}
		if err := o.SetParam(p.Name, v); err != nil {
			fmt.Fprintln(os.Stderr, "quickstart:", err)
			os.Exit(1)
		}
	}
	resumeAt := (*steps / 2 / *every) * *every // the checkpoint the second run resumes from
	if resumeAt == 0 {
		resumeAt = *every
	}
	// Checkpoints are lazy (DataStates-LLM): SaveAsync returns at once,
	// the next Step waits only for each subgroup's capture, and the
	// engine reports each one when it is durable.
	engine, err := checkpoint.NewEngine(checkpoint.OS, root, checkpoint.EngineOptions{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
	var pending *checkpoint.Handle
	report := func() {
		if pending == nil {
			return
		}
		ck, err := pending.Wait()
		if err != nil {
			fmt.Fprintln(os.Stderr, "quickstart:", err)
			os.Exit(1)
		}
		fmt.Printf("checkpoint %s (%v)\n", ck, pending.Stats())
		pending = nil
	}
	var first float64
	for t := int64(1); t <= *steps; t++ {
		loss := step(o, t, tw, tb)
		if t == 1 {
			first = loss
		}
		res, err := o.Step(offload.StepArgs{})
		if err != nil {
			fmt.Fprintln(os.Stderr, "quickstart:", err)
			os.Exit(1)
		}
		if t%*every == 0 || t == 1 {
			fmt.Printf("step %4d  loss %.6f  grad_norm %.4f  clip %.3f\n", t, loss, res.GradNorm, res.ClipCoef)
		}
		if t%*every == 0 {
			report() // the previous one, durable by now
			pending, err = o.SaveAsync(engine, t, map[string]any{"trainer": map[string]int64{"iteration": t}})
			if err != nil {
				fmt.Fprintln(os.Stderr, "quickstart:", err)
				os.Exit(1)
			}
		}
	}
	report()
	if err := engine.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
	final := step(o, *steps+1, tw, tb)
	fmt.Printf("loss %.6f -> %.6f\n", first, final)

	// Resume in a fresh optimizer from the checkpoint of step resumeAt and
	// run the rest again.
	o2 := newOptimizer()
	defer o2.Close()
	if _, _, err := o2.LoadCheckpoint(checkpoint.OS, checkpoint.StepDir(root, resumeAt)); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart: resume:", err)
		os.Exit(1)
	}
	for t := o2.StepCount() + 1; t <= *steps; t++ {
		step(o2, t, tw, tb)
		if _, err := o2.Step(offload.StepArgs{}); err != nil {
			fmt.Fprintln(os.Stderr, "quickstart:", err)
			os.Exit(1)
		}
	}
	same := true
	for i := range o.Params() {
		a, b := mustMaster(o, i), mustMaster(o2, i)
		for j := range a {
			if math.Float32bits(a[j]) != math.Float32bits(b[j]) {
				same = false
			}
		}
	}
	fmt.Printf("resumed from step %d and ran to step %d: master weights bitwise equal to the straight run: %t\n", resumeAt, o2.StepCount(), same)
	if !same || !(final < first/10) {
		fmt.Fprintln(os.Stderr, "quickstart: FAILED (no bitwise resume or the loss did not fall tenfold)")
		os.Exit(1)
	}
}

// mustMaster returns parameter i's master weights, or exits.
func mustMaster(o *offload.Optimizer, i int) []float32 {
	m, err := o.Master(i)
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
	return m
}
