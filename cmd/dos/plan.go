package main

import (
	"fmt"
	"io"
	"math"
	"slices"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
	"github.com/deepstates/dos/trainer"
)

// planResult is one schedule of dos plan, as --json writes it: the
// performance model's prediction and the simulated device's replay, in
// seconds per update phase of one rank.
type planResult struct {
	Name       string                         `json:"name"`
	CPU        int                            `json:"cpu_subgroups"`
	GPU        int                            `json:"gpu_subgroups"`
	Resident   int                            `json:"resident_subgroups"`
	K          string                         `json:"k"`
	Upcast     bool                           `json:"upcast_on_gpu"`
	Predicted  float64                        `json:"predicted_s,omitempty"`
	Replayed   float64                        `json:"replay_s,omitempty"`
	Bottleneck perfmodel.Resource             `json:"bottleneck,omitempty"` // the model's
	Busy       map[perfmodel.Resource]float64 `json:"busy_fraction,omitempty"`
	NotFit     string                         `json:"does_not_fit,omitempty"` // why the budget does not hold it
}

func runPlan(args []string, stdout, stderr io.Writer) int {
	c := newCLI("dos plan", "dos plan --profile PATH [--params N] [--ranks R] [--subgroup-size N] [flags]\n       dos plan --gpu-memory GiB --model NAME|--layers L --heads H --embd C [--ctx T] [--tokenizer byte|gpt2] [--batch B] [--recompute] [--sample N] [--bf16-params] [--stream-blocks N|auto] [--ranks N] [--profile PATH [--forward-ms F --backward-ms B [--speculate GiB]]]",
		"With --gpu-memory: the device memory of a GPT-2 trained on one GPU of that size (dos train --device cuda\n"+
			"--gpu-memory), before anything is allocated: the weights and gradients, the block slots of the blocks\n"+
			"whose weights stream from host memory (--stream-blocks), the fp32 masters, the\n"+
			"activations at --batch and the sampler's, what is left for the update phase, and the largest batch\n"+
			"that fits with and without --recompute; with --profile too, the update phase's plan within what is\n"+
			"left (--params then follows from the model, and --gpu-budget, unless given, from what the cap leaves),\n"+
			"and the update phase the model predicts for each count of blocks from host memory that fits (the\n"+
			"held blocks' CPU work against the budget they free; forward and backward not modelled); with\n"+
			"--forward-ms and --backward-ms too, the whole iteration (serial, the next forward beside the phase,\n"+
			"with --speculate, under the schedule chosen for the iteration) and its lower bound. With\n"+
			"--ranks N, each GPU of a ZeRO-3 job of N ranks (dos train --gpus N, a rank per GPU): its rows, pieces\n"+
			"and replicas.\n\n"+
			"Answers \"what k and what update time would I get\" for a model size and a machine, from a profile:\n"+
			"the update phase of each strategy (all on the CPU, a static split, all resident when it fits, the\n"+
			"performance model's interleaved schedule) and of a k sweep, per rank, as the performance model\n"+
			"predicts it and as the simulated device replays the engine's schedule operation by operation\n"+
			"(scheduler.Simulate). Flags describe another machine\n"+
			"by scaling the profile's rates; the contention slow-downs stay the profile's, and ranks on one\n"+
			"host are modelled as sharing only its cores.")
	profPath := c.String("profile", "", "a dos calibrate --json profile `PATH` (of any machine; required without --gpu-memory)")
	params := int64(20e9)
	sgSize := int64(100_000_000)
	sizeVar(c, &params, "params", "parameters `N` of the model")
	ranks := c.Int("ranks", 1, "GPUs (ranks) per host: each updates params/ranks with threads/ranks CPU workers over its own PCIe link")
	sizeVar(c, &sgSize, "subgroup-size", "parameters per subgroup `N` (with a model's flags and a profile, unset: dos train's cut, the performance model's choice of 100M, 50M or 25M)")
	budget := c.Float64("gpu-budget", 16, "GPU memory in `GiB` per rank for the update phase (resident state and staging)")
	threads := c.Int("threads", 0, "CPU workers `N` on the host (0: the profile's largest measured count)")
	cpuScale := c.Float64("cpu-scale", 1, "multiply the profile's CPU update rate by `F` (a host with more cores or memory bandwidth)")
	pcie := c.Float64("pcie", 0, "PCIe bandwidth in `GB/s` each way (0: the profile's; both-directions rates scale with it)")
	ug := c.Float64("gpu-rate", 0, "the GPU's fused AdamW rate in `Gparam/s` (0: the profile's)")
	gradDType := adam.BF16
	c.Var(dtypeFlag{&gradDType}, "grad-dtype", "gradient dtype on the GPU: float32, bfloat16 or float16")
	sweep := c.Int("sweep", 7, "schedules `N` of the k sweep (GPU subgroups from 0 to all, the chosen residents)")
	out := outputFlags(c, "each schedule's prediction and replay, the machine's limit (limit_s) and the lower bound (bound_s)", "the replay of the model's schedule", "the replay of the model's schedule as a timeline")
	mf := memoryFlags(c)
	fwdMS := c.Float64("forward-ms", 0, "with --gpu-memory: one forward's `ms` on the GPU, measured alone (dos train's \"iteration:\" line prints it): with --backward-ms, the whole iteration predicted")
	bwdMS := c.Float64("backward-ms", 0, "with --gpu-memory: one backward's `ms` on the GPU, measured alone, recomputation included (with --forward-ms)")
	specGiB := new(float64)
	*specGiB = trainer.SpeculateAutoGiB
	c.Var(speculateFlag{specGiB}, "speculate", "with --forward-ms: host memory in `GiB` for speculative updates (dos train --speculate) in the iteration's prediction, or auto, dos train's default (24 here, as where the host memory allows); 0: no rows with speculation, nor the schedule chosen for the iteration")
	if rc, ok := c.parseNoArgs(args, stdout, stderr); !ok {
		return rc
	}
	fail := func(format string, a ...any) int { return c.usageError(stderr, format, a...) }
	if *specGiB == trainer.SpeculateAuto {
		*specGiB = trainer.SpeculateAutoGiB // dos train's auto where the host memory allows
	}
	switch iter := c.set("forward-ms") || c.set("backward-ms") || c.set("speculate"); {
	case iter && !mf.given(c):
		return fail("--forward-ms, --backward-ms and --speculate need --gpu-memory and the model's flags (the iteration's blocks and copies are the model's)")
	case iter && (*profPath == "" || *ranks > 1):
		return fail("--forward-ms, --backward-ms and --speculate need --profile and one GPU (the iteration's prediction is one GPU's run, not a ZeRO-3 job's)")
	case iter && !c.set("forward-ms") && !c.set("backward-ms"):
		return fail("--speculate needs --forward-ms and --backward-ms: it is the iteration's prediction's")
	case iter && !(c.set("forward-ms") && c.set("backward-ms")):
		return fail("--forward-ms and --backward-ms go together: the iteration's prediction needs both")
	case iter && (!(*fwdMS > 0 && *fwdMS < 1e9) || !(*bwdMS > 0 && *bwdMS < 1e9)):
		return fail("--forward-ms %v, --backward-ms %v: want milliseconds over 0 and under 1e9", *fwdMS, *bwdMS)
	case !(*specGiB >= 0 && *specGiB <= float64(trainer.MaxMemoryBytes>>30)):
		return fail("--speculate %v: want GiB from 0 to %d", *specGiB, trainer.MaxMemoryBytes>>30)
	}
	var held int64                  // the streamed blocks' parameters (--stream-blocks): the CPU's, in place
	var memCfg *trainer.TrainConfig // with --gpu-memory: the run planned
	if mf.given(c) {
		cfg, msg := mf.config(c)
		if msg != "" {
			return fail("%s", msg)
		}
		memCfg = &cfg
		if *ranks > 1 { // ZeRO-3: each GPU's memory, one rank per GPU (NCCL's)
			switch {
			case *ranks > 1024:
				return fail("--ranks %d: want 1 to 1024", *ranks)
			case cfg.Batch%*ranks != 0:
				return fail("--batch %d: with --ranks %d it must be a multiple of the ranks (each trains batch/ranks rows)", cfg.Batch, *ranks)
			case cfg.StreamBlocks > 0:
				return fail("--stream-blocks %d with --ranks %d: streaming blocks' weights is built for one GPU only, not yet for ZeRO-3's ranks", cfg.StreamBlocks, *ranks)
			}
			cfg.GPUs = *ranks
		}
		// dos train's cut and, for the profile's machine, its host memory.
		cfg.SubgroupSize = int(sgSize)
		if !c.set("subgroup-size") {
			cfg.SubgroupSizes = cudaSubgroupSizes()
		}
		cfg.MaxMemory = trainer.MaxMemoryBytes >> 30
		if *profPath != "" {
			cfg.Profile = *profPath // dos train --profile does not calibrate
		}
		if c.set("gpu-budget") {
			cfg.GPUBudget = *budget // auto's count must leave it (trainer.TrainConfig.StreamSweep)
		}
		if prof, err := perfmodel.Read(*profPath); *profPath != "" && err == nil && prof.GPU != nil && cfg.GPUs <= 1 {
			// With a profile, auto's count is the one dos train takes
			// with it: the tables below are that run's. A profile that
			// does not read is refused further down.
			n := *threads
			for _, f := range prof.CPU {
				if *threads == 0 {
					n = max(n, f.Threads)
				}
			}
			if _, _, err := cfg.ChooseStreamed(prof, max(n, 1)); err != nil {
				return c.fail(stderr, "%v", err)
			}
		}
		m := cfg.DeviceMemory(cfg.Batch)
		left := m.BudgetLeft(int64(cfg.GPUMemory * (1 << 30)))
		switch {
		case c.set("params"):
			return fail("--params: with --gpu-memory the model's flags give the parameters (%s)", count(float64(cfg.Model.NumParams())))
		case gradDType != adam.BF16:
			return fail("--grad-dtype %v: with --gpu-memory the gradients are bfloat16, as dos train --device cuda has them", gradDType)
		case c.set("gpu-budget") && left > 0 && *budget*(1<<30) > float64(left):
			return fail("--gpu-budget %g GiB is over what --gpu-memory %g GiB leaves the update phase (%.2f GiB)", *budget, cfg.GPUMemory, float64(left)/(1<<30))
		}
		if *profPath != "" && left > 0 {
			w := perfmodel.Workload{Params: int64(cfg.Model.NumParams()), SubgroupSize: sgSize, GradDType: gradDType, CopyBytes: 2, Threads: max(*threads, 1), GPUBudget: left}
			if err := w.Validate(); err != nil {
				return fail("%v", err)
			}
		}
		if *profPath == "" {
			for _, f := range []string{"json", "trace", "plot"} {
				if c.set(f) {
					return fail("--%s needs --profile: it writes the update phase's prediction and replay, which --gpu-memory's memory plan alone does not make", f)
				}
			}
		}
		memoryPlan(cfg, stdout)
		if *profPath == "" {
			return 0
		}
		if left <= 0 {
			fmt.Fprintf(stdout, "no update-phase plan: nothing is left for it under --gpu-memory %g GiB\n", cfg.GPUMemory)
			return 0
		}
		held = int64(m.Streamed) * trainer.StreamedBlockBytes(cfg.Model) / 4
		params = int64(cfg.Model.NumParams()) - held
		if !c.set("gpu-budget") {
			*budget = math.Floor(float64(left)/(1<<30)*100) / 100 // GiB, to 0.01 below what is left
		}
		fmt.Fprintln(stdout)
	}
	switch {
	case *profPath == "":
		if memCfg == nil {
			return fail("say what to plan: --profile PATH for the update phase of --params N parameters (dos calibrate --json PATH writes one; testdata/profiles/h200.json is the H200 machine's), or --gpu-memory GiB with --model NAME (or --layers, --heads, --embd) for a model's device memory, or both")
		}
		return fail("--profile is required (dos calibrate --json PATH writes one; testdata/profiles/h200.json is the H200 machine's)")
	case params < 1 || params > perfmodel.MaxParams:
		return fail("--params %d: want 1 to %d", params, int64(perfmodel.MaxParams))
	case *ranks < 1 || *ranks > 1024:
		return fail("--ranks %d: want 1 to 1024", *ranks)
	case sgSize <= 0:
		return fail("--subgroup-size %d: want > 0", sgSize)
	case !(*budget >= 0) || *budget > 1<<20:
		return fail("--gpu-budget %v: want a number of GiB >= 0", *budget)
	case *threads < 0:
		return fail("--threads %d: want >= 0", *threads)
	case !(*cpuScale >= 1e-6) || *cpuScale > 1e6:
		return fail("--cpu-scale %v: want 1e-6 to 1e6", *cpuScale)
	case *pcie != 0 && (!(*pcie >= 1e-3) || *pcie > 1e6):
		return fail("--pcie %v: want GB/s from 0.001 to 1e6 (0: the profile's)", *pcie)
	case *ug != 0 && (!(*ug >= 1e-3) || *ug > 1e6):
		return fail("--gpu-rate %v: want Gparam/s from 0.001 to 1e6 (0: the profile's)", *ug)
	case *sweep < 0 || *sweep > 1000:
		return fail("--sweep %d: want 0 to 1000", *sweep)
	}
	if gradDType == 0 {
		return fail("--grad-dtype none: want bfloat16, float16 or float32")
	}
	prof, err := perfmodel.Read(*profPath)
	if err != nil {
		return c.fail(stderr, "--profile: %v", err)
	}
	if prof.GPU == nil {
		return fail("--profile %s has no GPU rates (measured with --cpu-only)", *profPath)
	}
	measured := 0
	for _, c := range prof.CPU {
		measured = max(measured, c.Threads)
	}
	if *threads == 0 {
		*threads = measured
	}
	perRank := max(1, *threads / *ranks)
	p := scaledProfile(prof, *cpuScale, *pcie, *ug) // the machine
	g := *p.GPU
	rankParams := (params + int64(*ranks) - 1) / int64(*ranks)
	w := perfmodel.Workload{Params: rankParams, SubgroupSize: sgSize, GradDType: gradDType, CopyBytes: 2, Threads: perRank, GPUBudget: int64(*budget * (1 << 30)), HostHeld: held}
	if err := w.Validate(); err != nil {
		return fail("%v", err)
	}
	if err := p.Validate(); err != nil {
		return fail("--cpu-scale, --pcie or --gpu-rate leave no usable rate: %v", err)
	}
	if rc, ok := out.check(c, stderr); !ok {
		return rc
	}
	cut := "--subgroup-size"
	if memCfg != nil && !c.set("subgroup-size") {
		// dos train's cut on the GPU: the performance model's choice
		// among its sizes (offload.Options.SubgroupSizes: the fastest,
		// or the largest within 2 % of it), so that every table below
		// is the run's.
		if sgSize, err = trainCut(&p, w); err != nil {
			return c.fail(stderr, "%v", err)
		}
		w.SubgroupSize, cut = sgSize, "dos train's cut"
	}
	choice, err := p.Choose(w)
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	uc, err := p.CPURate(perRank, gradDType)
	if err != nil {
		return c.fail(stderr, "--profile %s: %v", *profPath, err)
	}
	n := w.Subgroups()
	fmt.Fprintf(stdout, "dos plan: %s parameters over %d rank(s): %s per rank in %d subgroups of up to %s, %d CPU workers per rank, GPU budget %g GiB per rank\n",
		count(float64(params)), *ranks, count(float64(rankParams)), n, count(float64(sgSize)), perRank, *budget)
	if held > 0 {
		fmt.Fprintf(stdout, "and %s parameters of the streamed blocks (--stream-blocks) in %d more subgroups, updated by the CPU workers first, in place (the schedules below place the others)\n",
			count(float64(held)), perfmodel.SubgroupCount(held, sgSize))
	}
	if *threads < *ranks {
		fmt.Fprintf(stdout, "note: %d CPU workers over %d ranks: 1 worker per rank, %d in all (more than --threads)\n", *threads, *ranks, *ranks)
	}
	if perRank > measured {
		fmt.Fprintf(stdout, "note: the profile measured at most %d workers; its rate there stands for %d (scale it with --cpu-scale)\n", measured, perRank)
	}
	fmt.Fprintf(stdout, "machine: Uc %.2f Gparam/s at %d workers, Ug %.1f Gparam/s, H2D/D2H %.1f/%.1f GB/s (both at once %.1f/%.1f), contention CPU %.2fx, PCIe %.2fx (from %s, measured on %s, %s)\n",
		uc.Rate/1e9, perRank, g.Update.Rate/1e9, g.H2D.Rate/1e9, g.D2H.Rate/1e9, g.H2DBoth.Rate/1e9, g.D2HBoth.Rate/1e9, g.Contention.CPU, g.Contention.PCIe, *profPath, prof.Machine.CPU, prof.Machine.GPU)
	// The streamed blocks' subgroups first (they are the CPU's first
	// anyway), then the others.
	heldSizes := perfmodel.SubgroupSizes(held, sgSize)
	sizes := append(heldSizes, perfmodel.SubgroupSizes(rankParams, sgSize)...)
	heldSG := make([]bool, len(sizes))
	for i := range heldSizes {
		heldSG[i] = true
	}
	fmt.Fprintf(stdout, "%-12s %5s %5s %5s %7s %7s %9s %9s %12s %-6s %5s %5s %5s\n", "schedule", "cpu", "gpu", "res", "k", "upcast", "model s", "replay s", "Gparam/s", "bneck", "cpu", "h2d", "d2h")
	pl := &planner{p: &p, w: w, sizes: sizes, held: heldSG, threads: perRank, out: stdout}
	for _, x := range strategies(w, choice, *sweep) {
		if err := pl.row(x.name, x.s); err != nil {
			return c.fail(stderr, "%v", err)
		}
	}
	modelOps, results := pl.modelOps, pl.results
	fmt.Fprintf(stdout, "the model's choice: k = %s (%d CPU, %d GPU, %d resident subgroups per rank), %.3f s per update phase, bottleneck %s\n",
		kString(choice.K), choice.CPU, choice.GPU, choice.Resident, choice.Makespan, choice.Bottleneck)
	lim, limErr := p.Limit(w)
	if limErr == nil {
		fmt.Fprintf(stdout, "%s\n", limitLine(lim, nil))
	}
	bound, boundErr := p.Bound(w)
	if boundErr == nil {
		fmt.Fprintf(stdout, "%s\n", boundLine(&p, bound, nil))
	}
	meta := map[string]any{"params": params, "ranks": *ranks, "rank_params": rankParams, "subgroups": n,
		"subgroup_size": sgSize, "threads_per_rank": perRank, "gpu_budget_gib": *budget, "grad_dtype": gradDType, "profile": *profPath}
	if boundErr == nil {
		meta["bound_s"] = bound.Seconds
	}
	if limErr == nil {
		meta["limit_s"] = lim.Makespan
	}
	if memCfg != nil && memCfg.GPUs <= 1 && c.set("forward-ms") {
		if err := iterationPlan(*memCfg, &p, w, cut, *fwdMS/1e3, *bwdMS/1e3, *specGiB, stdout, meta); err != nil {
			return c.fail(stderr, "%v", err)
		}
	}
	if memCfg != nil && memCfg.GPUs <= 1 { // streaming is one GPU's
		fmt.Fprintln(stdout)
		if _, err := streamSweep(*memCfg, &p, perRank, stdout); err != nil {
			return c.fail(stderr, "%v", err)
		}
	}
	if err := writePlanOutputs(out, stdout, meta, results, modelOps, rankParams); err != nil {
		return c.fail(stderr, "%v", err)
	}
	return 0
}

// count formats a parameter count: 3.91B, 50M, 834K.
func count(n float64) string {
	switch {
	case n >= 1e9:
		return fmt.Sprintf("%.3gB", n/1e9)
	case n >= 1e6:
		return fmt.Sprintf("%.3gM", n/1e6)
	case n >= 1e3:
		return fmt.Sprintf("%.3gK", n/1e3)
	}
	return fmt.Sprintf("%.0f", n)
}

// scaledProfile returns prof with its rates scaled to describe another
// machine: the CPU's by cpuScale, the PCIe links' to pcie GB/s each way
// (0: unchanged; both-directions rates in proportion), the GPU's fused
// AdamW to ug Gparam/s (0: unchanged). The contention slow-downs stay the
// profile's. prof must have GPU rates; it is not modified.
func scaledProfile(prof *perfmodel.Profile, cpuScale, pcie, ug float64) perfmodel.Profile {
	p := *prof
	g := *prof.GPU
	p.GPU = &g
	p.CPU = slices.Clone(prof.CPU)
	for i := range p.CPU {
		p.CPU[i].Rate *= cpuScale
		p.CPU[i].Stats.Rate *= cpuScale
	}
	if pcie > 0 {
		f := pcie * 1e9 / ((g.H2D.Rate + g.D2H.Rate) / 2)
		g.H2D.Rate, g.D2H.Rate, g.H2DBoth.Rate, g.D2HBoth.Rate = g.H2D.Rate*f, g.D2H.Rate*f, g.H2DBoth.Rate*f, g.D2HBoth.Rate*f
	}
	if ug > 0 {
		g.Update.Rate = ug * 1e9
	}
	return p
}

// planner predicts and replays schedules of one workload on one machine,
// printing a row each and keeping the results (and the model's schedule's
// replay, for the trace and the timeline).
type planner struct {
	p        *perfmodel.Profile
	w        perfmodel.Workload
	sizes    []int64 // the subgroups, perfmodel.SubgroupSizes: the held ones first
	held     []bool  // per subgroup: the streamed blocks' (host-held)
	threads  int     // CPU workers per rank
	out      io.Writer
	results  []planResult
	modelOps []scheduler.Op
}

// row predicts schedule s (named name), replays it with scheduler.Simulate
// and prints the row; a schedule that does not fit is a row saying why.
//
// Errors: those of scheduler.NewPlan and Simulate.
func (pl *planner) row(name string, s perfmodel.Schedule) error {
	res := planResult{Name: name, CPU: s.CPU, GPU: s.GPU, Resident: s.Resident, K: kString(s.K()), Upcast: s.UpcastOnGPU}
	pr, err := pl.p.Predict(pl.w, s)
	if err != nil {
		fmt.Fprintf(pl.out, "%-12s %5d %5d %5d  does not fit: %v\n", name, s.CPU, s.GPU, s.Resident, err)
		res.NotFit = err.Error()
		pl.results = append(pl.results, res)
		return nil
	}
	plan, err := scheduler.NewHeldPlan(pl.held, s)
	if err != nil {
		return err
	}
	ops, err := scheduler.Simulate(scheduler.Machine{Profile: pl.p, Threads: pl.threads}, scheduler.SimWorkload{Sizes: pl.sizes, GradDType: pl.w.GradDType, HostHeld: pl.held}, plan)
	if err != nil {
		return err
	}
	if name == "model" {
		pl.modelOps = ops
	}
	sum := scheduler.Summarize(ops)
	res.Predicted, res.Replayed, res.Bottleneck = pr.Makespan, sum.Makespan.Seconds(), pr.Bottleneck
	res.Busy = map[perfmodel.Resource]float64{}
	for _, r := range perfmodel.Resources {
		res.Busy[r] = sum.Fraction(r)
	}
	pl.results = append(pl.results, res)
	fmt.Fprintf(pl.out, "%-12s %5d %5d %5d %7s %7v %9.3f %9.3f %12.2f %-6s %5.2f %5.2f %5.2f\n", name, s.CPU, s.GPU, s.Resident, kString(s.K()), s.UpcastOnGPU,
		pr.Makespan, sum.Makespan.Seconds(), float64(pl.w.Params+pl.w.HostHeld)/pr.Makespan/1e9, pr.Bottleneck, sum.Fraction(perfmodel.ResCPU), sum.Fraction(perfmodel.ResH2D), sum.Fraction(perfmodel.ResD2H))
	return nil
}

// writePlanOutputs writes dos plan's outputs that were asked for: the
// model's schedule's replay as a Chrome trace and as a timeline, and every
// result as JSON (meta, the model's choice, the results), saying where.
//
// Errors: the output's, naming its flag.
func writePlanOutputs(out *outputs, stdout io.Writer, meta map[string]any, results []planResult, modelOps []scheduler.Op, rankParams int64) error {
	if *out.trace != "" {
		if err := writeTrace(*out.trace, modelOps); err != nil {
			return fmt.Errorf("--trace: %w", err)
		}
		fmt.Fprintf(stdout, "replay of the model's schedule written to %s\n", *out.trace)
	}
	if *out.json != "" {
		for i := range results {
			if results[i].Name == "model" {
				meta["choice"] = &results[i]
			}
		}
		meta["results"] = results
		if err := writeJSON(*out.json, meta); err != nil {
			return fmt.Errorf("--json: %w", err)
		}
		fmt.Fprintf(stdout, "results written to %s\n", *out.json)
	}
	if *out.plot != "" {
		if err := plotTimeline(modelOps, fmt.Sprintf("dos plan: the model's schedule replayed, %.3gB parameters per rank", float64(rankParams)/1e9), *out.plot); err != nil {
			return fmt.Errorf("--plot: %w", err)
		}
		fmt.Fprintf(stdout, "timeline written to %s\n", *out.plot)
	}
	return nil
}

// trainCut returns the subgroup size dos train --device cuda cuts w's
// parameters at: of cudaSubgroupSizes, perfmodel.PickSubgroupSize's pick
// by the update phase p predicts at each (offload's choice).
//
// Errors: the model's.
func trainCut(p *perfmodel.Profile, w perfmodel.Workload) (int64, error) {
	sizes := cudaSubgroupSizes()
	best := make([]float64, len(sizes))
	for k, size := range sizes {
		w.SubgroupSize = int64(size)
		pr, err := p.Choose(w)
		if err != nil {
			return 0, err
		}
		best[k] = pr.Makespan
	}
	return int64(sizes[perfmodel.PickSubgroupSize(sizes, best)]), nil
}

// iterationPlan prints the whole iteration the model predicts for cfg's
// run on one GPU under p (perfmodel.Profile.PredictIteration), from the
// forward's and backward's seconds measured alone: nothing overlapped, the
// next forward beside the update phase with the resident subgroups last
// (--resident-first=false) and first (dos train's default, and its
// iteration while steps clip), and with speculate GiB of speculation with
// the resident subgroups last and first (the default once a step keeps
// its speculative updates); and the iteration's lower bound.
// The update phase is dos train's on the GPU: w with the prefetch during
// the backward, under the model's choice for it. It adds the predictions
// to meta (iteration_*_s) for --json.
func iterationPlan(cfg trainer.TrainConfig, p *perfmodel.Profile, w perfmodel.Workload, cut string, fwd, bwd, speculate float64, stdout io.Writer, meta map[string]any) error {
	w.Prefetch = true
	ch, err := p.Choose(w)
	if err != nil {
		return err
	}
	it := perfmodel.IterationWork{Forward: fwd, Backward: bwd, Blocks: cfg.Model.NLayer}
	tokens := float64(cfg.Batch * cfg.Model.NCtx)
	row := func(name, key string, r perfmodel.IterationPrediction, schedule string) {
		extra := ""
		if r.Speculated > 0 {
			extra = fmt.Sprintf(", %.1f ms of CPU updates speculated in the backward", 1e3*r.Speculated)
		}
		fmt.Fprintf(stdout, "  %-86s %8.1f ms  %9.0f tokens/s  (%supdate phase after the backward %.1f ms%s)\n", name, 1e3*r.Seconds, tokens/r.Seconds, schedule, 1e3*r.After, extra)
		meta[key] = r.Seconds
	}
	line := func(name string, it perfmodel.IterationWork, key string) error {
		r, err := p.PredictIteration(w, ch.Schedule, it)
		if err == nil {
			row(name, key, r, "")
		}
		return err
	}
	held := ""
	if w.HostHeld > 0 {
		held = fmt.Sprintf(" (and first, on the CPU, the %s parameters of the blocks from host memory)", count(float64(w.HostHeld)))
	}
	fmt.Fprintf(stdout, "\nthe whole iteration, from a forward of %.1f ms and a backward of %.1f ms measured alone, %d x %d tokens; the update phase with its prefetch in the backward, %d CPU / %d streamed / %d resident subgroups of up to %s (%s)%s, %.1f ms:\n",
		1e3*fwd, 1e3*bwd, cfg.Batch, cfg.Model.NCtx, ch.CPU, ch.GPU, ch.Resident, count(float64(w.SubgroupSize)), cut, held, 1e3*ch.Makespan)
	if err := line("serial (--no-overlap-forward)", it, "iteration_serial_s"); err != nil {
		return err
	}
	it.OverlapForward = true
	if err := line("the next forward beside the phase, --resident-first=false", it, "iteration_overlap_s"); err != nil {
		return err
	}
	it.ResidentFirst = true
	if err := line("the next forward beside the phase (default while steps clip)", it, "iteration_overlap_first_s"); err != nil {
		return err
	}
	if speculate > 0 {
		it.SpeculateParams = int64(speculate*(1<<30)) / scheduler.SpeculateBytes(1, false) // dos train's AdamW has no amsgrad
		it.ResidentFirst = false
		if err := line(fmt.Sprintf("and --speculate %g --resident-first=false", speculate), it, "iteration_speculate_s"); err != nil {
			return err
		}
		it.ResidentFirst = true
		if err := line(fmt.Sprintf("and --speculate %g, the resident subgroups first", speculate), it, "iteration_speculate_first_s"); err != nil {
			return err
		}
		for _, first := range []bool{false, true} {
			it.ResidentFirst = first
			r, err := p.ChooseIteration(w, it)
			if err != nil {
				return err
			}
			name, key := "the schedule chosen for the iteration, --resident-first=false", "iteration_chosen"
			if first {
				name, key = "the schedule chosen for the iteration (default once a step keeps speculative updates)", key+"_first"
			}
			row(name, key+"_s", r, fmt.Sprintf("%d CPU / %d streamed / %d resident subgroups, update phase %.1f ms alone; ",
				r.Phase.CPU, r.Phase.GPU, r.Phase.Resident, 1e3*r.Phase.Makespan))
			meta[key+"_schedule"] = r.Phase.Schedule
		}
	}
	h2d, d2h := trainer.StreamedCopyBytes(cfg.Model, cfg.Streamed())
	b, err := p.IterationBound(w, perfmodel.Iteration{Compute: fwd + bwd, H2DBytes: h2d, D2HBytes: d2h})
	if err != nil {
		return err
	}
	meta["iteration_bound_s"] = b.Seconds
	fmt.Fprintf(stdout, "  %-86s %8.1f ms  %9.0f tokens/s  (%s-bound: each resource's work at its rate alone, every overlap reached%s)\n", "its lower bound", 1e3*b.Seconds, tokens/b.Seconds, b.Bottleneck, noHostMem(p))
	if speculate == 0 {
		fmt.Fprintf(stdout, "  (not modelled: the overlapped forward's contention with the phase's copies and kernels)\n")
		return nil
	}
	fmt.Fprintf(stdout, "  (not modelled: the overlapped forward's contention with the phase's copies and kernels. The speculation's rows are dos train --speculate's once a step kept its updates, at the profile's CPU rate slowed by its contention here, as the backward's copies run beside it (dos train measures the speculation's own: on one H100 host 4.67 Gparam/s at 4.24B under 40 GiB, where that host's profile said 6.49 alone and 5.07 with contention); a step that clips (dos train's default --clip 1 binds while the gradients are large, early in training) or is skipped keeps none; the CPU's speculated work is in its phase's CPU ms, not wall time. Speculation shortens only a CPU-bound phase: the rows without a gain are copy-bound, and the schedule chosen for the iteration, which dos train --speculate moves to, gives the CPU more)\n")
	return nil
}

// noHostMem is what a bound's line adds where the profile has a GPU but
// not the host memory's peak (one measured before dos calibrate did): the
// bound then leaves that resource out.
func noHostMem(p *perfmodel.Profile) string {
	if p.GPU == nil || p.GPU.HostMem > 0 {
		return ""
	}
	return "; this profile has no host memory rate (host_mem_rate), so the host memory's term is left out: a dos calibrate on the GPU machine measures it"
}
