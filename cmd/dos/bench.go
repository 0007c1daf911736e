package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
	"github.com/deepstates/dos/trainer"
)

// benchResult is one measured schedule of dos bench.
type benchResult struct {
	Name       string                         `json:"name"`
	CPU        int                            `json:"cpu_subgroups"`
	GPU        int                            `json:"gpu_subgroups"`
	Resident   int                            `json:"resident_subgroups"`
	K          string                         `json:"k"`
	Upcast     bool                           `json:"upcast_on_gpu"`
	Seconds    float64                        `json:"update_s"` // median over the timed steps
	Steps      []float64                      `json:"steps_s"`  // every timed step
	Predicted  float64                        `json:"predicted_s"`
	Bottleneck perfmodel.Resource             `json:"bottleneck"` // the model's
	Busy       map[perfmodel.Resource]float64 `json:"busy_fraction"`
	Overlap    float64                        `json:"overlap"`
}

func runBench(args []string, stdout, stderr io.Writer) int {
	c := newCLI("dos bench", "dos bench [--params N] [--subgroup-size N] [--gpu-budget GiB] [--profile PATH] [--json PATH] [--trace PATH] [--plot PATH]",
		"Runs the update phase of a synthetic Llama-shaped parameter set on GPU 0 (bf16 gradients written on\n"+
			"the device, a bf16 working copy, fp32 state in pinned host memory) under each strategy: all on the\n"+
			"CPU (ZeRO-Offload), a static split (as many subgroups GPU-resident as the budget holds, the rest on\n"+
			"the CPU: ZeRO-Offload++/TwinFlow), all resident when it fits, the performance model's interleaved\n"+
			"schedule, and a sweep of the stride k. Prints the measured and predicted time of each. Without a\n"+
			"GPU it says so and exits 1.")
	var params int64
	sgSize := int64(100_000_000)
	sizeVar(c, &params, "params", "parameters `N` of the synthetic Llama-shaped model (0: as many as 35% of the available host memory holds at 12 B/param, at most 6e9)")
	sizeVar(c, &sgSize, "subgroup-size", "parameters per subgroup `N`")
	budget := c.Float64("gpu-budget", 16, "GPU memory in `GiB` the update phase may use (resident state and staging)")
	steps := c.Int("steps", 3, "timed update phases per schedule, after one warm-up; the median is reported")
	threads := c.Int("threads", 0, fmt.Sprintf("CPU workers `N`, at most 4 × the CPUs (%d here) (0: GOMAXPROCS)", trainer.MaxThreads()))
	profPath := c.String("profile", "", "a dos calibrate --json profile `PATH` of this machine (default: calibrate briefly first)")
	sweep := c.Int("sweep", 7, "schedules `N` of the k sweep (GPU subgroups from 0 to all, the model's residents), 0 for none")
	out := outputFlags(c, "the results", "the model's schedule's last update phase", "the model's schedule's last update phase as a timeline, one row per resource,")
	if rc, ok := c.parseNoArgs(args, stdout, stderr); !ok {
		return rc
	}
	usage := func(format string, a ...any) int { return c.usageError(stderr, format, a...) }
	switch {
	case params < 0 || params > perfmodel.MaxParams:
		return usage("--params %d: want 0 to %d", params, int64(perfmodel.MaxParams))
	case sgSize <= 0:
		return usage("--subgroup-size %d: want > 0", sgSize)
	case !(*budget >= 0) || *budget > 1<<20:
		return usage("--gpu-budget %v: want a number of GiB >= 0", *budget)
	case *steps < 1:
		return usage("--steps %d: want >= 1", *steps)
	case *threads < 0 || *threads > trainer.MaxThreads():
		return usage("--threads %d: want 0..%d (0: GOMAXPROCS; at most 4 × the CPUs, as more workers only time-share them)", *threads, trainer.MaxThreads())
	case *sweep < 0:
		return usage("--sweep %d: want >= 0", *sweep)
	}
	if rc, ok := out.check(c, stderr); !ok {
		return rc
	}
	dev, kern, release, err := kernels.Open(0)
	if err != nil {
		return c.fail(stderr, "no GPU (%v): dos bench measures the GPU machine; dos calibrate --cpu-only measures this one", err)
	}
	defer release()
	if *threads == 0 {
		*threads = runtime.GOMAXPROCS(0)
	}
	if params == 0 {
		params = defaultBenchParams()
	}
	sizes := llamaSubgroups(params, sgSize)
	n := int64(0)
	for _, s := range sizes {
		n += int64(s)
	}
	prof, err := benchProfile(*profPath, dev, kern, *threads, stderr)
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	w := perfmodel.Workload{Params: n, SubgroupSize: sgSize, GradDType: adam.BF16, CopyBytes: 2, Threads: *threads, GPUBudget: int64(*budget * (1 << 30))}
	choice, err := prof.Choose(w)
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	nsg := len(sizes)
	cands := strategies(w, choice, *sweep)
	fmt.Fprintf(stdout, "dos bench: %.2fB parameters in %d subgroups of up to %dM, bf16 gradients and copy, %d CPU workers, GPU budget %g GiB, %s\n",
		float64(n)/1e9, nsg, sgSize/1_000_000, *threads, *budget, dev)
	fmt.Fprintf(stdout, "model's choice: %d CPU, %d GPU, %d resident subgroups, k = %s, upcast on GPU %v: %.3f s predicted, bottleneck %s\n",
		choice.CPU, choice.GPU, choice.Resident, kString(choice.K), choice.UpcastOnGPU, choice.Makespan, choice.Bottleneck)
	plan, err := scheduler.NewPlan(nsg, cands[0].s)
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	pool := adam.NewPool(*threads)
	defer pool.Close()
	t0 := time.Now()
	fmt.Fprintf(stderr, "dos bench: allocating %.1f GB of pinned host state and %.1f GB of device gradients and copies...\n", 12*float64(n)/1e9, 4*float64(n)/1e9)
	e, err := scheduler.New(scheduler.Options{Device: scheduler.NewCUDA(dev, kern), Sizes: sizes, GradDType: adam.BF16, WorkingDType: adam.BF16, Pool: pool, Plan: plan})
	if err != nil {
		return c.fail(stderr, "%v", err)
	}
	defer e.Close()
	if err := fillBench(e, dev); err != nil {
		return c.fail(stderr, "%v", err)
	}
	fmt.Fprintf(stderr, "dos bench: set up in %s\n", time.Since(t0).Round(time.Millisecond))
	step := int64(0)
	var results []benchResult
	if g := prof.GPU; g != nil {
		fmt.Fprintf(stdout, "profile: Uc %.2f Gparam/s (bf16 gradients, %d workers), Ug %.1f Gparam/s, H2D/D2H %.1f/%.1f GB/s (%.1f/%.1f both at once), contention CPU %.2fx, PCIe %.2fx\n",
			cpuRate(prof, *threads)/1e9, *threads, g.Update.Rate/1e9, g.H2D.Rate/1e9, g.D2H.Rate/1e9, g.H2DBoth.Rate/1e9, g.D2HBoth.Rate/1e9, g.Contention.CPU, g.Contention.PCIe)
	}
	fmt.Fprintf(stdout, "%-16s %4s %4s %4s %6s %6s %9s %9s %7s %10s %-6s %5s %5s %5s %5s %7s\n",
		"schedule", "cpu", "gpu", "res", "k", "upcast", "update s", "model s", "error", "Gparam/s", "bneck", "cpu", "h2d", "d2h", "gpu", "overlap")
	var modelOps []scheduler.Op
	for _, cand := range cands {
		res, ops, err := measureSchedule(e, prof, w, cand, *steps, &step)
		if errors.Is(err, errDoesNotFit) {
			fmt.Fprintf(stdout, "%-16s skipped: %v\n", cand.name, err)
			continue
		}
		if err != nil {
			return c.fail(stderr, "%s: %v", cand.name, err)
		}
		if cand.name == "model" {
			modelOps = ops
		}
		results = append(results, res)
		fmt.Fprintf(stdout, "%-16s %4d %4d %4d %6s %6v %9.3f %9.3f %+6.1f%% %10.2f %-6s %5.2f %5.2f %5.2f %5.2f %7.2f\n",
			cand.name, cand.s.CPU, cand.s.GPU, cand.s.Resident, res.K, cand.s.UpcastOnGPU, res.Seconds, res.Predicted, 100*(res.Predicted/res.Seconds-1),
			float64(n)/res.Seconds/1e9, res.Bottleneck, res.Busy[perfmodel.ResCPU], res.Busy[perfmodel.ResH2D], res.Busy[perfmodel.ResD2H], res.Busy[perfmodel.ResGPU], res.Overlap)
	}
	benchVerdicts(stdout, results)
	lim, limErr := prof.Limit(w)
	if limErr == nil {
		fmt.Fprintf(stdout, "%s\n", limitLine(lim, results))
	}
	if b, err := prof.Bound(w); err == nil {
		fmt.Fprintf(stdout, "%s\n", boundLine(prof, b, results))
	}
	if *out.trace != "" && modelOps != nil {
		if err := writeTrace(*out.trace, modelOps); err != nil {
			return c.fail(stderr, "--trace: %v", err)
		}
		fmt.Fprintf(stdout, "trace of the model's schedule written to %s\n", *out.trace)
	}
	if *out.plot != "" && modelOps != nil {
		if err := plotTimeline(modelOps, fmt.Sprintf("dos bench: the model's schedule, %.2fB parameters, %s", float64(n)/1e9, dev.Name), *out.plot); err != nil {
			return c.fail(stderr, "--plot: %v", err)
		}
		fmt.Fprintf(stdout, "timeline written to %s\n", *out.plot)
	}
	if *out.json != "" {
		meta := map[string]any{"params": n, "subgroups": nsg, "threads": *threads, "gpu_budget_gib": *budget, "results": results}
		if limErr == nil {
			meta["limit_s"] = lim.Makespan
		}
		if err := writeJSON(*out.json, meta); err != nil {
			return c.fail(stderr, "--json: %v", err)
		}
		fmt.Fprintf(stdout, "results written to %s\n", *out.json)
	}
	return 0
}

// limitLine says the machine's limit for the update phase
// (perfmodel.Profile.Limit: the model's fluid limit, a prediction) and, when the model's
// schedule was measured, how far above it that ran.
func limitLine(lim perfmodel.Prediction, rs []benchResult) string {
	s := fmt.Sprintf("machine limit: %.3f s, the performance model's fluid limit (perfmodel.Profile.Limit: the subgroups split in any proportion, about %d CPU, %d streamed, %d resident, with no fill or drain; a prediction with the model's rates and contention, which a run may dip under: the lower bound is below)",
		lim.Makespan, lim.CPU, lim.GPU, lim.Resident)
	for _, r := range rs {
		if r.Name == "model" && lim.Makespan > 0 {
			s += fmt.Sprintf("; the model's schedule ran %.3f s, %+.1f%% of it", r.Seconds, 100*(r.Seconds/lim.Makespan-1))
		}
	}
	return s
}

// boundLine says the lower bound of the update phase
// (perfmodel.Profile.Bound: every resource at its rate alone, no latency
// or contention) and, when the model's schedule was measured, how far
// above it that ran; p is the profile it came from.
func boundLine(p *perfmodel.Profile, b perfmodel.Bound, rs []benchResult) string {
	s := fmt.Sprintf("lower bound: %.3f s, %s-bound (perfmodel.Profile.Bound: every resource at its measured rate alone, no latency, fill, drain or contention, at about %.0f CPU, %.0f streamed, %.0f resident; a phase under it means the profile's rates are off%s)",
		b.Seconds, b.Bottleneck, b.CPU, b.GPU, b.Resident, noHostMem(p))
	for _, r := range rs {
		if r.Name == "model" && b.Seconds > 0 {
			s += fmt.Sprintf("; the model's schedule ran %.2fx it", r.Seconds/b.Seconds)
		}
	}
	return s
}

// benchVerdicts prints the ratios the interleaved schedule is judged by.
func benchVerdicts(w io.Writer, rs []benchResult) {
	get := func(name string) *benchResult {
		for i := range rs {
			if rs[i].Name == name {
				return &rs[i]
			}
		}
		return nil
	}
	m := get("model")
	if m == nil {
		return
	}
	if c := get("cpu-only"); c != nil {
		fmt.Fprintf(w, "model's schedule against cpu-only: %.2fx the throughput\n", c.Seconds/m.Seconds)
	}
	if s := get("static"); s != nil {
		fmt.Fprintf(w, "model's schedule against the static split: %.2fx the throughput\n", s.Seconds/m.Seconds)
	}
	best := m
	worst := 0.0
	for i := range rs {
		if strings.HasPrefix(rs[i].Name, "sweep") || rs[i].Name == "model" {
			if rs[i].Seconds < best.Seconds {
				best = &rs[i]
			}
			worst = max(worst, math.Abs(rs[i].Predicted/rs[i].Seconds-1))
		}
	}
	fmt.Fprintf(w, "best measured of the sweep and the model's: %s (k = %s) %.3f s; the model's choice is %.1f%% slower; largest prediction error %.1f%%\n",
		best.Name, best.K, best.Seconds, 100*(m.Seconds/best.Seconds-1), 100*worst)
}

func cpuRate(p *perfmodel.Profile, threads int) float64 {
	f, err := p.CPURate(threads, adam.BF16)
	if err != nil {
		return 0
	}
	return f.Rate
}

func median(x []float64) float64 {
	s := slices.Sorted(slices.Values(x))
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

func kString(k float64) string {
	if math.IsInf(k, 1) {
		return "inf"
	}
	return fmt.Sprintf("%.2f", k)
}

// checkWritable fails early on an output path that cannot be written:
// its directory missing or not writable, or the path a directory ("" is
// fine: no output). It leaves no file behind.
func checkWritable(path string) error {
	if path == "" {
		return nil
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return fmt.Errorf("%s is a directory", path)
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".check*")
	if err != nil {
		return fmt.Errorf("%s: cannot create a file in its directory %s: %w", path, filepath.Dir(path), osCause(err))
	}
	f.Close()
	return os.Remove(f.Name())
}

// defaultBenchParams is 35% of the available host memory at 12 B/param,
// at most 6e9 and at least 1e8.
func defaultBenchParams() int64 {
	avail := int64(0)
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			var kb int64
			if _, err := fmt.Sscanf(line, "MemAvailable: %d kB", &kb); err == nil {
				avail = kb << 10
			}
		}
	}
	return min(max(avail*35/100/12, 1e8), 6e9)
}

// llamaSubgroups cuts a Llama-shaped parameter set of about params
// parameters (hidden size d, 4 attention matrices d x d and 3 MLP
// matrices d x 8d/3 per layer, two norms per layer, a 32000-token
// embedding and output layer) into subgroups of at most sg parameters, as
// offload cuts its flat parameter space.
func llamaSubgroups(params, sg int64) []int {
	d := int64(4096)
	switch {
	case params < 2e9:
		d = 2048
	case params > 20e9:
		d = 8192
	}
	ffn := (8*d/3 + 255) / 256 * 256
	layer := 4*d*d + 3*d*ffn + 2*d
	fixed := 2*32000*d + d
	layers := max(1, (params-fixed+layer/2)/layer)
	total := fixed + layers*layer
	var sizes []int
	for _, n := range perfmodel.SubgroupSizes(total, sg) {
		sizes = append(sizes, int(n))
	}
	return sizes
}

// benchProfile loads path, or calibrates the CPU at threads workers (fp32
// and bf16 gradients) and the GPU briefly.
func benchProfile(path string, dev *cuda.Device, kern *kernels.Kernels, threads int, stderr io.Writer) (*perfmodel.Profile, error) {
	here := perfmodel.Here()
	here.GPU = dev.Name
	if path != "" {
		return perfmodel.Load(path, here)
	}
	fmt.Fprintf(stderr, "dos bench: calibrating (no --profile)...\n")
	fits, err := perfmodel.CalibrateCPU(perfmodel.CPUOptions{Threads: []int{threads}}, nil)
	if err != nil {
		return nil, err
	}
	g, err := perfmodel.CalibrateGPU(dev, kern, perfmodel.GPUOptions{Threads: threads}, nil)
	if err != nil {
		return nil, err
	}
	here.GPUMemBytes = dev.TotalMem
	return &perfmodel.Profile{Format: perfmodel.ProfileFormat, Version: perfmodel.ProfileVersion, Created: time.Now().UTC().Truncate(time.Second), Machine: here, CPU: fits, GPU: g}, nil
}

// fillBench writes a non-trivial state (master weights ~ N(0, 0.02), zero
// moments) on the host and bf16 gradients ~ N(0, 1e-3) on the device, then
// loads the device.
func fillBench(e *scheduler.Engine, dev *cuda.Device) error {
	st := e.HostState()
	const pattern = 1 << 24
	vals := make([]float32, pattern)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range vals {
		vals[i] = float32(r.NormFloat64() * 0.02)
	}
	var wg sync.WaitGroup
	chunk := (len(st.Param) + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0)
	for lo := 0; lo < len(st.Param); lo += chunk {
		hi := min(lo+chunk, len(st.Param))
		wg.Go(func() {
			for i := lo; i < hi; i += pattern {
				copy(st.Param[i:min(i+pattern, hi)], vals)
			}
		})
	}
	wg.Wait()
	if err := e.Load(); err != nil {
		return err
	}
	g16, err := dev.HostAlloc(2 * pattern)
	if err != nil {
		return err
	}
	defer g16.Free()
	u := unsafe.Slice((*uint16)(unsafe.Pointer(&g16.Bytes()[0])), pattern)
	for i := range u {
		u[i] = adam.F32ToBF16(float32(r.NormFloat64() * 1e-3))
	}
	s, err := dev.NewStream()
	if err != nil {
		return err
	}
	defer s.Free()
	gv := e.Grad()
	buf := gv.Mem.(*cuda.Buffer)
	for off := int64(0); off < gv.N; off += pattern {
		if err := s.CopyHtoD(buf, 2*off, g16, 0, 2*min(pattern, gv.N-off)); err != nil {
			return err
		}
	}
	return s.Sync()
}

// errDoesNotFit: the performance model cannot place a schedule (over the
// GPU budget, no rate): dos bench skips it.
var errDoesNotFit = errors.New("does not fit")

// measureSchedule runs candidate cand on e: its plan installed (Replan),
// a warm-up update phase, then steps timed ones (wall clock; *step counts
// the optimizer steps across schedules); it returns the result with the
// model's prediction and the busy fractions of the last phase's trace.
//
// Errors: errDoesNotFit wrapping the model's reason; the engine's.
func measureSchedule(e *scheduler.Engine, prof *perfmodel.Profile, w perfmodel.Workload, cand strategy, steps int, step *int64) (benchResult, []scheduler.Op, error) {
	pr, err := prof.Predict(w, cand.s)
	if err != nil {
		return benchResult{}, nil, fmt.Errorf("%w: %v", errDoesNotFit, err)
	}
	p, err := scheduler.NewPlan(w.Subgroups(), cand.s)
	if err == nil {
		err = e.Replan(p)
	}
	if err != nil {
		return benchResult{}, nil, err
	}
	h := adam.DefaultHyper()
	var times []float64
	for r := 0; r <= steps; r++ {
		*step++
		co := h.Coeffs(*step, 1, 1)
		t := time.Now()
		if err := e.Update(&co); err != nil {
			return benchResult{}, nil, err
		}
		if r > 0 { // the first is the warm-up
			times = append(times, time.Since(t).Seconds())
		}
	}
	ops, err := e.Trace()
	if err != nil {
		return benchResult{}, nil, fmt.Errorf("trace: %w", err)
	}
	sum := scheduler.Summarize(ops)
	res := benchResult{Name: cand.name, CPU: cand.s.CPU, GPU: cand.s.GPU, Resident: cand.s.Resident, K: kString(cand.s.K()), Upcast: cand.s.UpcastOnGPU,
		Seconds: median(times), Steps: times, Predicted: pr.Makespan, Bottleneck: pr.Bottleneck, Busy: map[perfmodel.Resource]float64{}, Overlap: sum.Overlap}
	for _, r := range perfmodel.Resources {
		res.Busy[r] = sum.Fraction(r)
	}
	return res, ops, nil
}

// writeTrace writes ops as Chrome trace-event JSON to path, atomically.
func writeTrace(path string, ops []scheduler.Op, counters ...scheduler.Counter) error {
	return writeAtomic(path, func(f *os.File) error {
		bw := bufio.NewWriter(f)
		if err := scheduler.WriteChrome(bw, ops, counters...); err != nil {
			return err
		}
		return bw.Flush()
	})
}
