package main

import (
	"fmt"
	"io"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/gpt"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/trainer"
)

// planMemoryFlags are dos plan's flags for the device memory of a GPT-2
// on one GPU: --gpu-memory and the model's flags as dos train takes them
// (the same names and defaults), so that a plan describes the run the
// same flags start.
type planMemoryFlags struct {
	gpuMemory        float64
	model, tokenizer string
	cfg              trainer.TrainConfig // --layers, --heads, --embd, --ctx, --batch, --sample, --recompute, --bf16-params
}

// planModelFlags are the flags planMemoryFlags defines besides
// --gpu-memory.
var planModelFlags = []string{"model", "tokenizer", "layers", "heads", "embd", "ctx", "batch", "sample", "recompute", "bf16-params", "stream-blocks"}

// memoryFlags defines them on c.
func memoryFlags(c *cli) *planMemoryFlags {
	f := &planMemoryFlags{cfg: trainer.DefaultTrainConfig()}
	c.Float64Var(&f.gpuMemory, "gpu-memory", 0, "plan the device memory of a GPT-2 on one GPU of `GiB` (dos train --device cuda --gpu-memory), for the model the flags below give as dos train takes them")
	c.StringVar(&f.model, "model", "", "with --gpu-memory: a GPT-2 preset `NAME` (gpt2, gpt2-medium, gpt2-large, gpt2-xl: context 1024, the gpt2 tokenizer); --layers, --heads, --embd and --ctx override its")
	c.StringVar(&f.tokenizer, "tokenizer", "", "with --gpu-memory: `NAME` byte or gpt2, which sets the vocabulary: 256 or 50304 (default byte, gpt2 with --model)")
	c.IntVar(&f.cfg.Model.NLayer, "layers", f.cfg.Model.NLayer, "with --gpu-memory: transformer blocks (overrides --model's)")
	c.IntVar(&f.cfg.Model.NHead, "heads", f.cfg.Model.NHead, "with --gpu-memory: attention heads (overrides --model's)")
	c.IntVar(&f.cfg.Model.NEmbd, "embd", f.cfg.Model.NEmbd, "with --gpu-memory: embedding width (overrides --model's)")
	c.IntVar(&f.cfg.Model.NCtx, "ctx", f.cfg.Model.NCtx, "with --gpu-memory: context length in tokens (overrides --model's)")
	c.IntVar(&f.cfg.Batch, "batch", f.cfg.Batch, "with --gpu-memory: sequences per iteration")
	sizeVar(c, &f.cfg.SampleBytes, "sample", "with --gpu-memory: bytes `N` of text the run samples at the end (0: no sampler)")
	c.BoolVar(&f.cfg.Recompute, "recompute", false, "with --gpu-memory: activation checkpointing (dos train --recompute)")
	c.BoolVar(&f.cfg.BF16Params, "bf16-params", false, "with --gpu-memory: no fp32 masters on the device (dos train --bf16-params)")
	c.Var(streamFlag{&f.cfg.StreamBlocks}, "stream-blocks", "with --gpu-memory: blocks `N` whose weights and gradients stream from host memory (dos train --stream-blocks; auto: none when the run fits the cap, else with --profile the count dos train takes, the fewest within 2 % of the performance model's fastest, and without a profile the fewest that leave the update phase 2 GiB, else the fewest that fit)")
	return f
}

// given reports whether --gpu-memory or a model flag was set.
func (f *planMemoryFlags) given(c *cli) bool {
	for _, n := range append([]string{"gpu-memory"}, planModelFlags...) {
		if c.set(n) {
			return true
		}
	}
	return false
}

// config returns the dos train --device cuda configuration the flags
// describe (as dos train builds it: --model's fields where not given, the
// tokenizer's vocabulary, bf16 working copy and gradients, GPUMemory), or
// what is wrong with them, naming the flag.
func (f *planMemoryFlags) config(c *cli) (trainer.TrainConfig, string) {
	cfg := f.cfg
	if !c.set("gpu-memory") {
		return cfg, "the model's flags need --gpu-memory GiB, the GPU's memory to plan the model's device memory under (e.g. --gpu-memory 24)"
	}
	if !(f.gpuMemory > 0) || f.gpuMemory > 1<<20 {
		return cfg, fmt.Sprintf("--gpu-memory %v: want the GPU's GiB, > 0 (the model's flags plan its device memory under it)", f.gpuMemory)
	}
	if f.model != "" {
		if err := applyPreset(c, &cfg, f.model); err != nil {
			return cfg, err.Error()
		}
	}
	if c.set("tokenizer") {
		cfg.Tokenizer = f.tokenizer
	}
	tok, err := trainer.NewTokenizer(cfg.Tokenizer)
	if err != nil {
		return cfg, fmt.Sprintf("--tokenizer: %v", err)
	}
	cfg.Model.VocabSize = gpt.PadVocab(tok.VocabSize())
	cfg.Device, cfg.GPUMemory, cfg.GradDType, cfg.WorkingDType = "cuda", f.gpuMemory, adam.BF16, adam.BF16
	// Over the cap is what the plan shows, not an error; the host's
	// memory is not this plan's.
	v := cfg
	v.GPUMemory, v.MaxMemory = 0, float64(trainer.MaxMemoryBytes>>30)
	if err := v.Validate(); err != nil {
		return cfg, fmt.Sprintf("the model dos train would build: %v", err)
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
	where := "one GPU"
	if cfg.GPUs > 1 {
		where = fmt.Sprintf("each of %d GPUs (ZeRO-3, a rank per GPU: batch %d rows each)", cfg.GPUs, cfg.Batch/cfg.GPUs)
	}
	fmt.Fprintf(out, "dos plan: device memory on %s under --gpu-memory %g GiB: --layers %d --heads %d --embd %d --ctx %d --tokenizer %s --batch %d%s, %s parameters\n",
		where, cfg.GPUMemory, cfg.Model.NLayer, cfg.Model.NHead, cfg.Model.NEmbd, cfg.Model.NCtx, cfg.Tokenizer, cfg.Batch, rc, count(float64(cfg.Model.NumParams())))
	if m.TooLarge() {
		fmt.Fprintf(out, "  the activations at batch %d are too large to count (over %d PiB): does not fit; dos train refuses it before allocating\n", cfg.Batch, trainer.MaxDeviceBytes>>50)
	} else {
		pieces := ""
		if cfg.GPUs > 1 {
			pieces = fmt.Sprintf(" (the rank's 1/%d; the masters' too)", cfg.GPUs)
		}
		row("weights and gradients (bf16)", m.WeightsGrads, pieces)
		if m.Streamed > 0 {
			row(fmt.Sprintf("block slots (%d/%d from host)", m.Streamed, cfg.Model.NLayer), m.Slots, fmt.Sprintf(" (%.2f GiB of weights and gradients in host memory)", float64(int64(m.Streamed)*trainer.StreamedBlockBytes(cfg.Model))/(1<<30)))
		}
		row("fp32 masters", m.Masters, "")
		if m.Replicas > 0 {
			row("the rank's replicas", m.Replicas, " (the tensors outside the blocks' matrices and two blocks', working copy, gradients and masters)")
		}
		rows := fmt.Sprintf("batch %d", cfg.Batch)
		if cfg.GPUs > 1 {
			rows += fmt.Sprintf(": %d rows", cfg.Batch/cfg.GPUs)
		}
		row(fmt.Sprintf("activations (%s)", rows), m.Activations, "")
		row(fmt.Sprintf("sampler (--sample %d)", cfg.SampleBytes), m.Sampler, "")
		if m.Calibration > m.Sampler+m.WeightsGrads+m.Masters {
			row("start-up calibration", m.Calibration, " (before the weights, gradients and masters, more than they: counted instead)")
		}
		row("before the update phase", m.Total(), fmt.Sprintf(" of %g GiB", cfg.GPUMemory))
	}
	left := m.BudgetLeft(capBytes)
	switch {
	case m.TooLarge():
	case left > 0:
		row("left for the update phase", left, " (its default --gpu-budget: resident state and staging; 256 MiB kept aside)")
	case m.Total() <= capBytes:
		fmt.Fprintf(out, "  fits under the cap, but not outside the 256 MiB the run keeps aside for the kernels' modules and cuBLASLt (%.0f MiB of it used): dos train refuses it before allocating\n", float64(m.Total()-(capBytes-trainer.CapMargin))/(1<<20))
	default:
		fmt.Fprintf(out, "  does not fit: over the cap by %.2f GiB (dos train refuses it before allocating)\n", float64(m.Total()-capBytes)/(1<<30))
	}
	if m.Total() > capBytes && cfg.StreamBlocks != 0 && m.Streamed == 0 && !m.TooLarge() && cfg.GPUs <= 1 {
		all := cfg
		all.StreamBlocks = cfg.Model.NLayer
		fmt.Fprintf(out, "  with all %d blocks' weights from host memory (--stream-blocks %d) it would need %.2f GiB: it does not fit either\n",
			cfg.Model.NLayer, cfg.Model.NLayer, float64(all.DeviceMemory(cfg.Batch).Total())/(1<<30))
	}
	const upTo = 1 << 20
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
			at := c
			at.Batch = b
			streamed := ""
			if n := at.Streamed(); n > 0 { // the blocks --stream-blocks picks at that batch
				streamed = fmt.Sprintf(", %d blocks from host memory", n)
			}
			fmt.Fprintf(out, "  largest batch %s (256 MiB kept aside%s): %d%s\n", what, streamed, b, map[bool]string{true: " (or more)", false: ""}[b == upTo])
		}
	}
	return left
}

// streamSweep prints, for cfg under its GPUMemory and the machine p with
// threads CPU workers, the update phase the performance model predicts
// for each count of blocks whose weights come from host memory that
// fits (trainer.TrainConfig.StreamSweep: offload.PredictUpdate over the
// subgroups dos train cuts, the streamed blocks' parameters the CPU's
// first): what each block moved off the GPU costs in CPU work and gives
// the update phase in budget (its resident state and staging). It marks
// the count the model predicts fastest and the count dos train's
// --stream-blocks auto takes once it has the profile (the fewest within
// 2 % of the fastest), and returns the latter (-1 when the run needs no
// streaming or none fits).
//
// Errors: the model's.
func streamSweep(cfg trainer.TrainConfig, p *perfmodel.Profile, threads int, out io.Writer) (int, error) {
	auto := cfg
	auto.StreamBlocks = trainer.StreamAuto
	rows, pick, err := auto.StreamSweep(p, threads)
	if err != nil {
		return -1, err
	}
	if len(rows) == 0 {
		fmt.Fprintf(out, "streamed blocks: no count fits under --gpu-memory %g GiB\n", cfg.GPUMemory)
		return -1, nil
	}
	best := 0
	for i, r := range rows {
		if r.Update.Makespan < rows[best].Update.Makespan {
			best = i
		}
	}
	fmt.Fprintf(out, "the update phase by blocks from host memory (the performance model's choice for each; the fwd+bwd is not modelled; cpu/gpu/res count the subgroups dos train's optimizer would cut for that count, at --subgroup-size %s, cut again where host-held and other tensors meet, not the schedule table's even cut):\n", subgroupSizeOf(cfg))
	fmt.Fprintf(out, "  %6s %10s %12s %10s %14s  %s\n", "blocks", "budget GiB", "host-held", "update s", "cpu/gpu/res", "")
	// Every count would be a long table for deep models: the first and
	// last that fit, auto's, the best, and about ten between.
	step := max(1, len(rows)/10)
	for i, r := range rows {
		mark := ""
		switch {
		case i == pick:
			mark += " <- --stream-blocks auto (dos train's, with this profile)"
		case pick < 0 && r.Blocks == 0:
			mark += " <- --stream-blocks auto (none: the run fits on the GPU)"
		}
		if i == best {
			mark += " <- the model's fastest"
		}
		if mark == "" && i%step != 0 && i != len(rows)-1 {
			continue
		}
		fmt.Fprintf(out, "  %6d %10.2f %12s %10.3f %14s %s\n", r.Blocks, float64(r.Budget)/(1<<30), count(float64(r.HostHeld)), r.Update.Makespan,
			fmt.Sprintf("%d/%d/%d", r.Update.CPU, r.Update.GPU, r.Update.Resident), mark)
	}
	if pick < 0 {
		return -1, nil
	}
	return rows[pick].Blocks, nil
}

// subgroupSizeOf says the subgroup size cfg's optimizer cuts at: its
// --subgroup-size, or the default where that is 0.
func subgroupSizeOf(cfg trainer.TrainConfig) string {
	if cfg.SubgroupSize == 0 {
		return "0 (the default, 1e9)"
	}
	return formatSize(int64(cfg.SubgroupSize))
}
