package main

import (
	"fmt"
	"io"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/trainer"
)

// planMemoryFlags are dos plan's flags for the device memory of a GPT-2
// on one GPU (--gpu-memory and the model's shape, as dos train takes it).
type planMemoryFlags struct {
	gpuMemory                float64
	model                    string
	layers, heads, embd, ctx int
	vocab, batch, sample     int
	recompute, bf16Params    bool
}

// memoryFlags defines them on c.
func memoryFlags(c *cli) *planMemoryFlags {
	f := &planMemoryFlags{}
	c.Float64Var(&f.gpuMemory, "gpu-memory", 0, "plan the device memory of a GPT-2 on one GPU of `GiB` (dos train --device cuda --gpu-memory), for the model the flags below give")
	c.StringVar(&f.model, "model", "", "with --gpu-memory: a GPT-2 preset `NAME` (gpt2, gpt2-medium, gpt2-large, gpt2-xl); --layers, --heads, --embd and --ctx override its")
	c.IntVar(&f.layers, "layers", 0, "with --gpu-memory: transformer blocks (0: --model's)")
	c.IntVar(&f.heads, "heads", 0, "with --gpu-memory: attention heads (0: --model's)")
	c.IntVar(&f.embd, "embd", 0, "with --gpu-memory: embedding width (0: --model's)")
	c.IntVar(&f.ctx, "ctx", 0, "with --gpu-memory: context length in tokens (0: --model's, or 1024)")
	c.IntVar(&f.vocab, "vocab", 0, "with --gpu-memory: vocabulary size (0: GPT-2's, 50304)")
	c.IntVar(&f.batch, "batch", 8, "with --gpu-memory: sequences per iteration")
	c.IntVar(&f.sample, "sample", 200, "with --gpu-memory: bytes of text the run samples at the end (dos train --sample; 0: no sampler)")
	c.BoolVar(&f.recompute, "recompute", false, "with --gpu-memory: activation checkpointing (dos train --recompute)")
	c.BoolVar(&f.bf16Params, "bf16-params", false, "with --gpu-memory: no fp32 masters on the device (dos train --bf16-params)")
	return f
}

// given reports whether a model flag was set.
func (f *planMemoryFlags) given(c *cli) bool {
	for _, n := range []string{"model", "layers", "heads", "embd", "ctx", "vocab", "batch", "sample", "recompute", "bf16-params"} {
		if c.set(n) {
			return true
		}
	}
	return false
}

// config returns the dos train configuration the flags describe (Device
// "cuda", bf16 working copy and gradients, GPUMemory), or what is wrong
// with them, naming the flag.
func (f *planMemoryFlags) config(c *cli) (trainer.TrainConfig, string) {
	cfg := trainer.DefaultTrainConfig()
	switch {
	case !(f.gpuMemory > 0) || f.gpuMemory > 1<<20:
		return cfg, fmt.Sprintf("--gpu-memory %v: want the GPU's GiB, > 0 (the model's flags plan its device memory under it)", f.gpuMemory)
	case f.model == "" && (f.layers == 0 || f.heads == 0 || f.embd == 0):
		return cfg, "--gpu-memory needs the model: --model NAME, or --layers, --heads and --embd"
	}
	m := gpt.Config{NCtx: 1024, VocabSize: 50304}
	if f.model != "" {
		p, err := gpt.Preset(f.model)
		if err != nil {
			return cfg, fmt.Sprintf("--model: %v", err)
		}
		m = p
	}
	for _, o := range []struct {
		v   int
		dst *int
	}{{f.layers, &m.NLayer}, {f.heads, &m.NHead}, {f.embd, &m.NEmbd}, {f.ctx, &m.NCtx}, {f.vocab, &m.VocabSize}} {
		if o.v != 0 {
			*o.dst = o.v
		}
	}
	cfg.Model, cfg.Batch, cfg.SampleBytes, cfg.Recompute, cfg.BF16Params = m, f.batch, f.sample, f.recompute, f.bf16Params
	cfg.Device, cfg.GPUMemory, cfg.GradDType, cfg.WorkingDType = "cuda", f.gpuMemory, adam.BF16, adam.BF16
	tok := "byte"
	if m.VocabSize > 256 {
		tok = "gpt2"
	}
	cfg.Tokenizer, cfg.MaxMemory = tok, float64(trainer.MaxMemoryBytes>>30) // the host's memory is not this plan's
	v := cfg
	v.GPUMemory = 0 // over the cap is what the plan shows, not an error
	if err := v.Validate(); err != nil {
		return cfg, fmt.Sprintf("%v", err)
	}
	return cfg, ""
}

// memoryPlan prints cfg's device memory under its GPUMemory
// (trainer.DeviceMemory) on out and returns what is left for the update
// phase, in bytes (<= 0: nothing).
func memoryPlan(cfg trainer.TrainConfig, out io.Writer) int64 {
	capBytes := int64(cfg.GPUMemory * (1 << 30))
	m := cfg.DeviceMemory(cfg.Batch)
	row := func(what string, b int64, more string) {
		fmt.Fprintf(out, "  %-30s %7.2f GiB%s\n", what, float64(b)/(1<<30), more)
	}
	rc := ""
	if cfg.Recompute {
		rc = " --recompute"
	}
	fmt.Fprintf(out, "dos plan: device memory on one GPU under --gpu-memory %g GiB: --layers %d --heads %d --embd %d --ctx %d --vocab %d --batch %d%s, %s parameters\n",
		cfg.GPUMemory, cfg.Model.NLayer, cfg.Model.NHead, cfg.Model.NEmbd, cfg.Model.NCtx, cfg.Model.VocabSize, cfg.Batch, rc, count(float64(cfg.Model.NumParams())))
	row("weights and gradients (bf16)", m.WeightsGrads, "")
	row("fp32 masters", m.Masters, "")
	row(fmt.Sprintf("activations (batch %d)", cfg.Batch), m.Activations, "")
	row(fmt.Sprintf("sampler (--sample %d)", cfg.SampleBytes), m.Sampler, "")
	row("before the update phase", m.Total(), fmt.Sprintf(" of %g GiB", cfg.GPUMemory))
	left := m.BudgetLeft(capBytes)
	if left > 0 {
		row("left for the update phase", left, " (its default --gpu-budget: resident state and staging; 256 MiB kept aside)")
	} else {
		fmt.Fprintf(out, "  does not fit: over the cap by %.2f GiB with the 256 MiB kept aside (dos train refuses it before allocating)\n", float64(-left)/(1<<30))
	}
	upTo := max(cfg.Batch, 1024)
	for _, r := range []bool{false, true} {
		c := cfg
		c.Recompute = r
		what := "without --recompute"
		if r {
			what = "with --recompute"
		}
		if b := c.LargestBatch(capBytes-trainer.CapMargin, upTo); b == 0 {
			fmt.Fprintf(out, "  largest batch %s (256 MiB kept aside): none fits\n", what)
		} else {
			fmt.Fprintf(out, "  largest batch %s (256 MiB kept aside): %d%s\n", what, b, map[bool]string{true: " (or more)", false: ""}[b == upTo])
		}
	}
	return left
}
