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
	"errors"
	"flag"
	"fmt"
	"io"
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

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// errUsage is a usage error (exit 2); the flag package has printed it.
var errUsage = errors.New("usage")

// run is the quickstart on the command line args, printing to stdout; it
// returns the exit status: 0, 1 on a failure (printed to stderr), 2 on a
// usage error.
func run(args []string, stdout, stderr io.Writer) int {
	err := quickstart(args, stdout, stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		return 2
	case err != nil:
		fmt.Fprintln(stderr, "quickstart:", err)
		return 1
	}
	return 0
}

func quickstart(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("quickstart", flag.ContinueOnError)
	fs.SetOutput(stderr)
	steps := fs.Int64("steps", 200, "training steps")
	every := fs.Int64("every", 50, "checkpoint interval in steps")
	dir := fs.String("dir", "", "checkpoint root directory (default: a new temporary directory, removed at exit)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	if *steps < 2 || *every < 1 || *every >= *steps {
		fmt.Fprintln(stderr, "quickstart: want --steps >= 2 and 1 <= --every < --steps")
		return errUsage
	}
	root := *dir
	if root == "" {
		tmp, err := os.MkdirTemp("", "dos-quickstart-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		root = tmp
	}
	// One writer per root, checked before training: a root that already
	// holds checkpoints is not written over (checkpoint.Save would refuse
	// to replace a committed step only when it reaches it).
	lock, err := checkpoint.Lock(checkpoint.OS, root)
	if err != nil {
		return err
	}
	defer lock.Unlock()
	info, err := checkpoint.Inspect(checkpoint.OS, root)
	if err != nil {
		return err
	}
	if !info.Fresh() {
		return fmt.Errorf("--dir %s already holds checkpoints; choose another", root)
	}
	tw, tb := teacher()

	o, err := offload.New(params, options())
	if err != nil {
		return err
	}
	defer o.Close()
	fmt.Fprintf(stdout, "quickstart: %d params in %d subgroups, %v\n", o.NumParams(), len(o.Subgroups()), o.Options())
	r := rand.New(rand.NewPCG(7, 7))
	for _, p := range o.Params() { // initial master weights
		v := make([]float32, p.Len)
		for i := range v {
			v[i] = float32(r.NormFloat64() * 0.02)
		}
		if err := o.SetParam(p.Name, v); err != nil {
			return err
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
		return err
	}
	defer engine.Close()
	var pending *checkpoint.Handle
	report := func() error {
		if pending == nil {
			return nil
		}
		ck, err := pending.Wait()
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "checkpoint %s (%v)\n", ck, pending.Stats())
		pending = nil
		return nil
	}
	// Each step's loss is its batch's before its update, as the step
	// lines print it.
	var first, last float64
	for t := int64(1); t <= *steps; t++ {
		loss := step(o, t, tw, tb)
		if t == 1 {
			first = loss
		}
		last = loss
		res, err := o.Step(offload.StepArgs{})
		if err != nil {
			return err
		}
		if t%*every == 0 || t == 1 {
			fmt.Fprintf(stdout, "step %4d  loss %.6f  grad_norm %.4f  clip %.3f\n", t, loss, res.GradNorm, res.ClipCoef)
		}
		if t%*every == 0 {
			if err := report(); err != nil { // the previous one, durable by now
				return err
			}
			pending, err = o.SaveAsync(engine, t, map[string]any{"trainer": map[string]int64{"iteration": t}})
			if err != nil {
				return err
			}
		}
	}
	if err := report(); err != nil {
		return err
	}
	if err := engine.Close(); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "loss %.6f at step 1 -> %.6f at step %d\n", first, last, *steps)

	// Resume in a fresh optimizer from the checkpoint of step resumeAt and
	// run the rest again.
	o2, err := offload.New(params, options())
	if err != nil {
		return err
	}
	defer o2.Close()
	if _, _, err := o2.LoadCheckpoint(checkpoint.OS, checkpoint.StepDir(root, resumeAt)); err != nil {
		return fmt.Errorf("resume: %w", err)
	}
	for t := o2.StepCount() + 1; t <= *steps; t++ {
		step(o2, t, tw, tb)
		if _, err := o2.Step(offload.StepArgs{}); err != nil {
			return err
		}
	}
	same := true
	for i := range o.Params() {
		a, err := o.Master(i)
		if err != nil {
			return err
		}
		b, err := o2.Master(i)
		if err != nil {
			return err
		}
		for j := range a {
			if math.Float32bits(a[j]) != math.Float32bits(b[j]) {
				same = false
			}
		}
	}
	fmt.Fprintf(stdout, "resumed from step %d and ran to step %d: master weights bitwise equal to the straight run: %t\n", resumeAt, o2.StepCount(), same)
	if !same || !(last < first/10) {
		return errors.New("FAILED (no bitwise resume or the loss did not fall tenfold)")
	}
	return nil
}
