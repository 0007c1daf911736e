package perfmodel

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
)

func rate(r float64) Fit { return Fit{Rate: r} }

// profile builds a profile with one CPU rate (for every dtype at 1 thread)
// and, when gpu, a GPU with the given rates (duplex = one-way).
func profile(uc float64, gpu bool, ug, pcie float64) *Profile {
	p := &Profile{Format: ProfileFormat, Version: ProfileVersion, Machine: Machine{CPU: "test"}}
	for _, d := range []adam.DType{adam.F32, adam.BF16, adam.F16} {
		p.CPU = append(p.CPU, CPUFit{Threads: 1, GradDType: d, Fit: rate(uc)})
	}
	if gpu {
		p.GPU = &GPUProfile{Update: rate(ug), H2D: rate(pcie), D2H: rate(pcie), H2DBoth: rate(pcie), D2HBoth: rate(pcie), Convert: rate(1e15)}
	}
	return p
}

// logUniform returns a draw from [lo, hi) uniform in log scale, from r.
func logUniform(r *rand.Rand) func(lo, hi float64) float64 {
	return func(lo, hi float64) float64 { return math.Exp(math.Log(lo) + r.Float64()*(math.Log(hi)-math.Log(lo))) }
}

// randomProfile draws a profile for the search tests: CPU, GPU and PCIe
// rates over two to three decades, slower duplex rates, a kernel latency.
func randomProfile(r *rand.Rand) *Profile {
	lg := logUniform(r)
	p := profile(lg(1e8, 1e10), true, lg(1e9, 1e12), lg(1e9, 1e11))
	p.GPU.H2DBoth = rate(p.GPU.H2D.Rate * lg(0.5, 1))
	p.GPU.D2HBoth = rate(p.GPU.D2H.Rate * lg(0.5, 1))
	p.GPU.Update.LatencyS = lg(1e-6, 1e-2)
	return p
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

// A 12-subgroup workload of 1M parameters each, bf16 gradients and copy.
var w12 = Workload{Params: 12e6, SubgroupSize: 1e6, GradDType: adam.BF16, CopyBytes: 2, Threads: 1}

// TestCPUOnly: without a GPU everything is on the CPU and there are no
// transfers (gradients and weights live on the host): exactly 12 x 3 s.
func TestCPUOnly(t *testing.T) {
	p := profile(1e6/3, false, 0, 0)
	pr, err := p.Choose(w12)
	if err != nil {
		t.Fatal(err)
	}
	if pr.CPU != 12 || pr.GPU != 0 || !math.IsInf(pr.K, 1) || pr.Bottleneck != ResCPU || !near(pr.Makespan, 36) {
		t.Fatalf("%+v", pr)
	}
	if _, err := p.Predict(w12, Schedule{GPU: 12}); err == nil {
		t.Error("a GPU schedule without GPU rates was accepted")
	}
}

// TestPCIeBound: the CPU takes 3 s a subgroup, a GPU subgroup's state takes
// 1 s each way, its update nothing; a CPU subgroup's gradient and copy 1/6 s
// each. By hand: c CPU and g = 12-c GPU subgroups cost max(3c, g + c/6), and
// c = 3 gives max(9, 9.5) = 9.5 s on the H2D lane, with no fill (a GPU state
// can go first) and no drain (a copy can go last); c = 2 gives 10.33, c = 4
// 12 + 1/6 + 1/6. No room for a resident subgroup next to the staging.
func TestPCIeBound(t *testing.T) {
	p := profile(1e6/3, true, 1e15, 12e6)
	w := w12
	w.GPUBudget = 24e6 // two staging slots of 12 MB
	pr, err := p.Choose(w)
	if err != nil {
		t.Fatal(err)
	}
	if pr.CPU != 3 || pr.GPU != 9 || pr.Resident != 0 || pr.UpcastOnGPU || pr.Bottleneck != ResH2D || !near(pr.Makespan, 9.5) || !near(pr.K, 1.0/3) {
		t.Fatalf("%+v", pr)
	}
	c4, _ := p.Predict(w, Schedule{CPU: 4, GPU: 8})
	if c4.Bottleneck != ResCPU || !near(c4.Makespan, 12+1.0/6+1.0/6) {
		t.Fatalf("c=4: %+v", c4)
	}
	allGPU, err := p.Predict(w, Schedule{GPU: 12})
	if err != nil || allGPU.K != 0 || !near(allGPU.Makespan, 12+1) { // H2D 12 s, drain: the last update and D2H
		t.Fatalf("all GPU: %+v %v", allGPU, err)
	}
	if _, err := p.Predict(w, Schedule{GPU: 11, Resident: 1}); err == nil || !strings.Contains(err.Error(), "budget") {
		t.Fatalf("over the budget: %v", err)
	}
}

// TestGPUBound: a slow GPU (1 s a subgroup), fast PCIe, a CPU at 10 s a
// subgroup, room for everything: 11 resident and 1 on the CPU (11 s on the
// GPU, 10 on the CPU) beat all resident (12 s).
func TestGPUBound(t *testing.T) {
	p := profile(1e5, true, 1e6, 1e15)
	w := w12
	w.GPUBudget = 1 << 40
	pr, err := p.Choose(w)
	if err != nil {
		t.Fatal(err)
	}
	if pr.Resident != 11 || pr.CPU != 1 || pr.GPU != 0 || pr.Bottleneck != ResGPU || !near(pr.Makespan, 11) {
		t.Fatalf("%+v", pr)
	}
}

// TestAllResident: with a CPU 100x slower than the GPU and room for all,
// every subgroup stays on the GPU: 12 s, no transfers, k = 0.
func TestAllResident(t *testing.T) {
	p := profile(1e4, true, 1e6, 1e10)
	w := w12
	w.GPUBudget = 1 << 40
	pr, err := p.Choose(w)
	if err != nil {
		t.Fatal(err)
	}
	if pr.Resident != 12 || pr.CPU != 0 || pr.GPU != 0 || pr.K != 0 || !near(pr.Makespan, 12) || pr.Busy[ResH2D] != 0 {
		t.Fatalf("%+v", pr)
	}
}

func TestScheduleK(t *testing.T) {
	for _, c := range []struct {
		s Schedule
		k float64
	}{{Schedule{CPU: 0, GPU: 5}, 0}, {Schedule{CPU: 5}, math.Inf(1)}, {Schedule{CPU: 2, GPU: 1}, 2}, {Schedule{Resident: 3}, 0}} {
		if got := c.s.K(); got != c.k {
			t.Errorf("%+v: K = %v, want %v", c.s, got, c.k)
		}
	}
}

func TestFitPoints(t *testing.T) {
	var pts []Point
	for _, x := range []float64{1e3, 1e5, 1e6, 1e7} {
		pts = append(pts, Point{x, 2e-5 + x/5e8})
	}
	f, err := FitPoints(pts)
	if err != nil || !near(f.LatencyS, 2e-5) || math.Abs(f.Rate/5e8-1) > 1e-9 || f.Residual > 1e-9 {
		t.Fatalf("%+v %v", f, err)
	}
	// Noise that would give a negative latency: refitted through the origin.
	f, err = FitPoints([]Point{{1, 0.9e-9}, {2, 2.1e-9}, {3, 3e-9}})
	if err != nil || f.LatencyS != 0 || !(f.Rate > 0) {
		t.Fatalf("%+v %v", f, err)
	}
	for _, bad := range [][]Point{nil, {{1, 1}}, {{1, 1}, {0, 1}}, {{1, 2}, {2, 1}}, {{1, math.Inf(1)}, {2, 1}}} {
		if _, err := FitPoints(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	here := Machine{CPU: "test", GPU: "H200"}
	p := profile(1e6, true, 1e6, 1e9)
	p.Machine = here
	write := func(p *Profile) string {
		b, _ := json.Marshal(p)
		path := filepath.Join(dir, "p.json")
		os.WriteFile(path, b, 0o644)
		return path
	}
	if _, err := Load(write(p), here); err != nil {
		t.Fatal(err)
	}
	other := *p
	other.Machine.GPU = "H100"
	if _, err := Load(write(&other), here); err == nil || !strings.Contains(err.Error(), "another machine") {
		t.Errorf("another machine: %v", err)
	}
	// The host memory's pages: another kind is refused; a profile from
	// before they were recorded ("") is not.
	pages := *p
	pages.Machine.HostPages = "small"
	hugeHere := here
	hugeHere.HostPages = "huge"
	if _, err := Load(write(&pages), hugeHere); err == nil || !strings.Contains(err.Error(), "small pages") || !strings.Contains(err.Error(), "DOS_HUGE_PAGES") {
		t.Errorf("small pages measured, huge here: %v", err)
	}
	if _, err := Load(write(p), hugeHere); err != nil {
		t.Errorf("a profile without host_pages: %v", err)
	}
	pages.Machine.HostPages = "huge"
	if _, err := Load(write(&pages), hugeHere); err != nil {
		t.Errorf("the same pages: %v", err)
	}
	old := *p
	old.Version = 0
	if _, err := Load(write(&old), here); err == nil || !strings.Contains(err.Error(), "version") {
		t.Errorf("old version: %v", err)
	}
	bad := *p
	bad.CPU = []CPUFit{{Threads: 1, GradDType: adam.F32, Fit: Fit{Rate: -1}}}
	if _, err := Load(write(&bad), here); err == nil {
		t.Error("a negative rate was accepted")
	}
	os.WriteFile(filepath.Join(dir, "junk.json"), []byte("{"), 0o644)
	if _, err := Load(filepath.Join(dir, "junk.json"), here); err == nil || !strings.Contains(err.Error(), "junk.json") {
		t.Errorf("junk: %v", err)
	}
}

// TestEdges: regressions from adversarial testing.
func TestEdges(t *testing.T) {
	p := profile(1e6, true, 1e6, 1e9)
	if _, err := p.Choose(Workload{Params: 1000, GradDType: adam.F32, Threads: 1}); err == nil || !strings.Contains(err.Error(), "SubgroupSize") {
		t.Errorf("SubgroupSize 0: %v", err)
	}
	var nilp *Profile
	if _, err := nilp.Choose(w12); err == nil {
		t.Error("a nil profile chose")
	}
	// A slightly less busy resource with a long fill and drain sets the
	// makespan: one GPU subgroup needs H2D 0.5 s, update 0.9 s and D2H 0.3 s
	// in turn (1.7 s) while the CPU is busy 1.0 s.
	q := profile(900, true, 1, 1)
	q.GPU.Update = Fit{LatencyS: 0.9, Rate: 1e15}
	q.GPU.H2D, q.GPU.H2DBoth = rate(2400), rate(2400)
	q.GPU.D2H, q.GPU.D2HBoth = rate(4000), rate(4000)
	w := Workload{Params: 1000, SubgroupSize: 100, GradDType: adam.BF16, CopyBytes: 2, Threads: 1, GPUBudget: 1 << 30}
	pr, err := q.Predict(w, Schedule{CPU: 9, GPU: 1})
	if err != nil || pr.Makespan < 1.7-1e-9 || pr.Bottleneck != ResGPU {
		t.Errorf("makespan %v on %s (%v), want at least 1.7 s on the GPU", pr.Makespan, pr.Bottleneck, err)
	}
	// A subgroup size above the parameters: the memory of the real subgroup.
	small := Workload{Params: 100, SubgroupSize: 1e9, GradDType: adam.F32, Threads: 1, GPUBudget: 1 << 30}
	if _, err := p.Predict(small, Schedule{GPU: 1}); err != nil {
		t.Errorf("one small GPU subgroup: %v", err)
	}
	dup := profile(1e6, false, 0, 0)
	dup.CPU = append(dup.CPU, dup.CPU[0])
	if err := dup.Validate(); err == nil {
		t.Error("two fits for the same threads and dtype accepted")
	}
	odd := profile(1e6, false, 0, 0)
	odd.CPU[0].GradDType = adam.DType(9)
	if err := odd.Validate(); err == nil {
		t.Error("an unknown dtype accepted")
	}
}

// TestLoadFutureVersion: a later version whose fields changed shape is
// refused for its version, not with a JSON type error.
func TestLoadFutureVersion(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.json")
	os.WriteFile(path, []byte(`{"format":"dos-profile","version":2,"cpu":{"changed":"shape"}}`), 0o644)
	if _, err := Load(path, Machine{}); err == nil || !strings.Contains(err.Error(), "version 2") {
		t.Fatalf("future version: %v", err)
	}
}

// bruteChoose is Choose over every split, the reference for the search.
func bruteChoose(p *Profile, w Workload) Prediction {
	n := w.Subgroups()
	best, _ := p.Predict(w, Schedule{CPU: n})
	for r := 0; r <= n; r++ {
		for g := 0; g <= n-r; g++ {
			for _, upcast := range []bool{false, true} {
				pr, err := p.predict(w, Schedule{CPU: n - r - g, GPU: g, Resident: r, UpcastOnGPU: upcast})
				if err == nil && better(pr, best) {
					best = pr
				}
			}
		}
	}
	return best
}

// TestChooseSearch: the searched Choose picks what the exhaustive one
// picks, on random profiles and workloads.
func TestChooseSearch(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	lg := logUniform(r)
	for i := range 3000 {
		p := randomProfile(r)
		p.GPU.H2D.LatencyS = lg(1e-6, 1e-3)
		p.GPU.Convert = rate(lg(1e9, 1e12))
		p.CPU[0].Rate *= lg(0.5, 2) // float32 differs from bf16
		n := 1 + r.IntN(40)
		sub := int64(1e6 * lg(1, 100))
		w := Workload{Params: int64(n) * sub, SubgroupSize: sub, GradDType: []adam.DType{adam.F32, adam.BF16}[r.IntN(2)],
			CopyBytes: 2 * r.IntN(2), Threads: 1, GPUBudget: int64(float64(n) * float64(sub) * 12 * r.Float64() * 1.2), AMSGrad: r.IntN(4) == 0}
		got, err := p.Choose(w)
		if err != nil {
			t.Fatal(err)
		}
		want := bruteChoose(p, w)
		if math.Abs(got.Makespan-want.Makespan) > 1e-9*want.Makespan {
			t.Fatalf("case %d (n=%d): search %+v (%.9g s), exhaustive %+v (%.9g s)", i, n, got.Schedule, got.Makespan, want.Schedule, want.Makespan)
		}
	}
}

// TestContention: the CPU workers take 1 s a subgroup alone and 1.5 s
// while copies run; a copy 2x as long while the CPU works. 6 CPU and 6
// GPU subgroups of 1M (state 12 MB each way, bf16 gradient and copy 2 MB)
// at 12 MB/s each way: alone the CPU needs 6 s, the H2D lane 6 + 1 = 7 s.
// Together the CPU would need 9 s and the lane 14: the CPU is done first,
// at 9 s, the lane has moved 4.5 s of its work and does the remaining
// 2.5 s alone: 11.5 s (no drain: a CPU subgroup's copy can go last).
func TestContention(t *testing.T) {
	p := profile(1e6, true, 1e15, 12e6)
	p.GPU.Contention = Contention{CPU: 1.5, PCIe: 2}
	w := w12
	w.GPUBudget = 1 << 40
	pr, err := p.Predict(w, Schedule{CPU: 6, GPU: 6})
	if err != nil {
		t.Fatal(err)
	}
	if !near(pr.Busy[ResCPU], 9) || !near(pr.Busy[ResH2D], 11.5) || pr.Bottleneck != ResH2D || !near(pr.Makespan, 11.5) {
		t.Fatalf("k = 1: %+v", pr)
	}
	// 10 CPU and 2 GPU: the lane (2 x 1 + 10/6 s alone, 22/3 together)
	// is done first; the CPU then has 10 - (22/3)/1.5 s left alone.
	pr, err = p.Predict(w, Schedule{CPU: 10, GPU: 2})
	if err != nil {
		t.Fatal(err)
	}
	lane := 2 + 10.0/6
	if want := 2*lane + 10 - 2*lane/1.5; !near(pr.Busy[ResCPU], want) || !near(pr.Busy[ResH2D], 2*lane) {
		t.Fatalf("k = 5: CPU %g, want %g; H2D %g, want %g", pr.Busy[ResCPU], want, pr.Busy[ResH2D], 2*lane)
	}
	// Without contention the same schedule is the plain maximum.
	p.GPU.Contention = Contention{}
	if pr, _ := p.Predict(w, Schedule{CPU: 6, GPU: 6}); !near(pr.Busy[ResCPU], 6) || !near(pr.Busy[ResH2D], 7) {
		t.Fatalf("no contention: %+v", pr)
	}
	p.GPU.Contention = Contention{CPU: 0.5, PCIe: 2}
	if err := p.Validate(); err == nil {
		t.Error("a slow-down below 1 was accepted")
	}
}

// TestPredictionJSON: an all-CPU prediction (k = +Inf) marshals, with K
// as "inf".
func TestPredictionJSON(t *testing.T) {
	pr, err := profile(1e6, false, 0, 0).Choose(w12)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(pr)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"K":"inf"`) || !strings.Contains(string(b), `"CPU":12`) {
		t.Errorf("%s", b)
	}
	if _, err := json.Marshal(Prediction{K: 1.5}); err != nil {
		t.Error(err)
	}
}

// TestWorkloadBounds: a subgroup size near MaxInt64 does not overflow the
// subgroup count, and too many subgroups are refused.
func TestWorkloadBounds(t *testing.T) {
	w := Workload{Params: 834304, SubgroupSize: math.MaxInt64, GradDType: adam.F32, Threads: 1}
	if w.Subgroups() != 1 {
		t.Errorf("Subgroups %d, want 1", w.Subgroups())
	}
	if pr, err := profile(1e6, false, 0, 0).Choose(w); err != nil || pr.CPU != 1 || !(pr.Makespan > 0) {
		t.Errorf("%+v %v", pr, err)
	}
	w = Workload{Params: 1e6, SubgroupSize: 1, GradDType: adam.F32, Threads: 1}
	if err := w.Validate(); err == nil {
		t.Error("a million subgroups accepted")
	}
	if (Workload{}).Subgroups() != 0 {
		t.Error("zero workload")
	}
	f := Fit{Rate: 1e6, LatencyS: 1e308}
	if f.Valid() {
		t.Error("a latency of 1e308 s is valid")
	}
}

func TestSubgroupSizes(t *testing.T) {
	for _, tc := range []struct {
		total, size int64
		want        []int64
	}{
		{10, 4, []int64{4, 4, 2}},
		{8, 4, []int64{4, 4}},
		{3, 4, []int64{3}},
		{0, 4, []int64{}},
		{5, 0, []int64{}},
	} {
		got := SubgroupSizes(tc.total, tc.size)
		if len(got) != len(tc.want) || SubgroupCount(tc.total, tc.size) != len(tc.want) {
			t.Fatalf("SubgroupSizes(%d, %d) = %v, want %v", tc.total, tc.size, got, tc.want)
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Fatalf("SubgroupSizes(%d, %d) = %v, want %v", tc.total, tc.size, got, tc.want)
			}
		}
	}
	if n := SubgroupCount(math.MaxInt64, 1<<40); n != 1<<23 {
		t.Errorf("SubgroupCount(MaxInt64, 2^40) = %d", n)
	}
}

// TestStaticSplit: as many subgroups resident as the budget holds their
// state (12 bytes a parameter, 16 with amsgrad), the rest on the CPU.
func TestStaticSplit(t *testing.T) {
	w := Workload{Params: 1000, SubgroupSize: 100, GradDType: adam.BF16, CopyBytes: 2, Threads: 1}
	for _, tc := range []struct {
		budget  int64
		amsgrad bool
		want    Schedule
	}{
		{0, false, Schedule{CPU: 10}},
		{1199, false, Schedule{CPU: 10}},
		{1200, false, Schedule{CPU: 9, Resident: 1}},
		{3 * 1200, false, Schedule{CPU: 7, Resident: 3}},
		{3 * 1200, true, Schedule{CPU: 8, Resident: 2}},
		{1 << 30, false, Schedule{Resident: 10}},
	} {
		w := w
		w.GPUBudget, w.AMSGrad = tc.budget, tc.amsgrad
		if got := StaticSplit(w); got != tc.want {
			t.Errorf("budget %d amsgrad %v: %+v, want %+v", tc.budget, tc.amsgrad, got, tc.want)
		}
	}
}

// TestScaled: a profile scaled by f predicts each resource's busy time f
// times the original's, leaves the original alone, and ignores factors
// that are not finite and positive.
func TestScaled(t *testing.T) {
	p := profile(1e9, true, 5e10, 2e10)
	p.GPU.H2D.LatencyS = 1e-5
	w := Workload{Params: 1e9, SubgroupSize: 1e8, GradDType: adam.BF16, CopyBytes: 2, Threads: 4, GPUBudget: 8 << 30}
	s := Schedule{CPU: 4, GPU: 4, Resident: 2}
	base, err := p.Predict(w, s)
	if err != nil {
		t.Fatal(err)
	}
	f := map[Resource]float64{ResCPU: 2, ResH2D: 0.5, ResD2H: 3, ResGPU: math.NaN()}
	q := p.Scaled(f)
	got, err := q.Predict(w, s)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []Resource{ResCPU, ResH2D, ResD2H, ResGPU} {
		want := base.Busy[r]
		if x := f[r]; x > 0 {
			want *= x
		}
		if !near(got.Busy[r], want) {
			t.Errorf("%s busy %g, want %g (base %g)", r, got.Busy[r], want, base.Busy[r])
		}
	}
	if p.GPU.H2D.LatencyS != 1e-5 || p.CPU[0].Rate != 1e9 {
		t.Error("Scaled changed the original profile")
	}
}

// TestLimit: the fluid limit. 12 subgroups of 1M, the CPU at 1 s a
// subgroup, PCIe at 12 MB/s each way (a state 1 s, a 16-bit gradient or
// copy 1/6 s), a budget for the two staging slots only: x subgroups' worth
// on the CPU balances the lanes at x = (12 - x) + x/6, x = 72/11 s. With
// no budget it is all on the CPU (12 s); with room for everything, the
// resident kernels alone. It never exceeds Choose's makespan (random
// profiles and workloads, contention and latencies included).
func TestLimit(t *testing.T) {
	p := profile(1e6, true, 1e15, 12e6)
	w := w12
	w.GPUBudget = 2 * 12e6
	l, err := p.Limit(w)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(l.Makespan-72.0/11) > 1e-3 || l.Fill != 0 || l.Drain != 0 || l.Resident != 0 {
		t.Fatalf("staging only: %+v, want 72/11 s", l)
	}
	w.GPUBudget = 0
	if l, _ := p.Limit(w); !near(l.Makespan, 12) || l.Schedule != (Schedule{CPU: 12}) {
		t.Fatalf("no budget: %+v, want all on the CPU, 12 s", l)
	}
	w.GPUBudget = 1 << 40
	if l, _ := p.Limit(w); l.Makespan > 1e-6 || l.Resident != 12 {
		t.Fatalf("all resident: %+v", l)
	}
	r := rand.New(rand.NewPCG(3, 4))
	lg := logUniform(r)
	for i := range 300 {
		p := randomProfile(r)
		p.GPU.Contention = Contention{CPU: lg(1, 2), PCIe: lg(1, 2)}
		n := 1 + r.IntN(40)
		sub := int64(1e6 * lg(1, 100))
		w := Workload{Params: int64(n) * sub, SubgroupSize: sub, GradDType: adam.BF16, CopyBytes: 2, Threads: 1,
			GPUBudget: int64(float64(n) * float64(sub) * 12 * r.Float64() * 1.2), Prefetch: r.IntN(2) == 0}
		l, err := p.Limit(w)
		if err != nil {
			t.Fatal(err)
		}
		c, err := p.Choose(w)
		if err != nil {
			t.Fatal(err)
		}
		if l.Makespan > c.Makespan*(1+1e-9) {
			t.Fatalf("case %d: the limit %.6g s (%+v) is above Choose's %.6g s (%+v)", i, l.Makespan, l.Schedule, c.Makespan, c.Schedule)
		}
	}
}

// TestPrefetchRates: with Workload.Prefetch and no streamed subgroup the
// phase moves nothing down, so its copies up go at the one-way rate (a
// review found the duplex rate charged).
func TestPrefetchRates(t *testing.T) {
	p := profile(1e9, true, 1e12, 10e9)
	p.GPU.H2DBoth, p.GPU.D2HBoth = rate(5e9), rate(5e9)
	w := w12
	w.GPUBudget, w.Prefetch = 1<<40, true
	pr, err := p.Predict(w, Schedule{CPU: 12})
	if err != nil {
		t.Fatal(err)
	}
	if want := 12 * 2e6 / 10e9; !near(pr.Busy[ResH2D], want) {
		t.Errorf("all-CPU with Prefetch: H2D busy %g s, want %g at the one-way rate", pr.Busy[ResH2D], want)
	}
	w.Prefetch = false
	if pr, _ := p.Predict(w, Schedule{CPU: 12}); !near(pr.Busy[ResH2D], 12*2e6/5e9) {
		t.Errorf("all-CPU without Prefetch: H2D busy %g s, want the duplex rate's", pr.Busy[ResH2D])
	}
}

// TestHostHeld: host-held parameters (Workload.HostHeld) are CPU work
// before the CPU lane's first subgroup: with the CPU at 1M params per 3 s
// and 6M held, 18 s more on the CPU, so the choice moves subgroups off the
// CPU (12 subgroups, the PCIe-bound case of TestPCIeBound: c = 3 without,
// and with 18 s of held work the CPU takes none: max(18, 12 s of state
// each way) = 18 s, and the GPU lane's 12 subgroups fill nothing of it);
// every subgroup host-held (Params 0) is the held time alone.
func TestHostHeld(t *testing.T) {
	p := profile(1e6/3, true, 1e15, 12e6)
	w := w12
	w.GPUBudget = 24e6 // two staging slots of 12 MB
	base, err := p.Choose(w)
	if err != nil {
		t.Fatal(err)
	}
	w.HostHeld = 6e6
	pr, err := p.Choose(w)
	if err != nil {
		t.Fatal(err)
	}
	if base.CPU != 3 || pr.CPU != 0 || pr.GPU != 12 || pr.Bottleneck != ResCPU || !near(pr.Makespan, 18) || !near(pr.Busy[ResCPU], 18) {
		t.Errorf("without held %+v; with 6M held %+v, want 0 CPU, 12 streamed, 18 s on the CPU", base, pr)
	}
	// At a fixed schedule the held time adds to the CPU's busy time.
	s := Schedule{CPU: 3, GPU: 9}
	nb := w
	nb.HostHeld = 0
	a, _ := p.Predict(nb, s)
	b, _ := p.Predict(w, s)
	if !near(b.Busy[ResCPU]-a.Busy[ResCPU], 18) || b.Makespan < a.Makespan {
		t.Errorf("%+v: CPU busy %g without, %g with 6M held (want 18 s more)", s, a.Busy[ResCPU], b.Busy[ResCPU])
	}
	all := Workload{SubgroupSize: 1e6, GradDType: adam.BF16, CopyBytes: 2, Threads: 1, HostHeld: 3e6}
	pa, err := p.Choose(all)
	if err != nil || pa.Schedule != (Schedule{}) || !near(pa.Makespan, 9) || pa.Bottleneck != ResCPU {
		t.Errorf("every subgroup host-held: %+v, %v; want 9 s on the CPU", pa, err)
	}
	if l, err := p.Limit(all); err != nil || !near(l.Makespan, 9) {
		t.Errorf("Limit, every subgroup host-held: %+v, %v", l, err)
	}
	for _, bad := range []Workload{{SubgroupSize: 1e6, GradDType: adam.BF16, Threads: 1}, {Params: 1, SubgroupSize: 1, GradDType: adam.BF16, Threads: 1, HostHeld: -1}} {
		if err := bad.Validate(); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}

// TestHostHeldUpcastRate (an adversarial review's find): the host-held
// subgroups' gradients stay GradDType on the host (never upcast), so their
// CPU time is the GradDType rate's with UpcastOnGPU too.
func TestHostHeldUpcastRate(t *testing.T) {
	p := profile(1e6, true, 1e15, 1e12)
	for i := range p.CPU {
		if p.CPU[i].GradDType == adam.F32 {
			p.CPU[i].Fit = rate(0.25e6) // f32 gradients 4x slower on this CPU
		}
	}
	w := w12
	w.GPUBudget = 1 << 40
	w.HostHeld = 1e6
	nb := w
	nb.HostHeld = 0
	for _, up := range []bool{false, true} {
		s := Schedule{CPU: 2, GPU: 10, UpcastOnGPU: up}
		a, err := p.Predict(nb, s)
		if err != nil {
			t.Fatal(err)
		}
		b, err := p.Predict(w, s)
		if err != nil {
			t.Fatal(err)
		}
		if d := b.Busy[ResCPU] - a.Busy[ResCPU]; !near(d, 1) {
			t.Errorf("upcast %v: 1M held bf16 params at 1e6/s add %g s of CPU, want 1", up, d)
		}
	}
}

// TestPickSubgroupSize: the largest size whose phase is within 2 % of the
// fastest, whatever the order.
func TestPickSubgroupSize(t *testing.T) {
	for _, c := range []struct {
		sizes []int
		times []float64
		want  int
	}{
		{[]int{100, 50, 25}, []float64{1.0, 1.0, 1.0}, 0},
		{[]int{100, 50, 25}, []float64{1.05, 1.0, 0.99}, 1},
		{[]int{100, 50, 25}, []float64{1.2, 1.1, 1.0}, 2},
		{[]int{25, 100, 50}, []float64{1.0, 1.019, 1.5}, 1},
	} {
		if got := PickSubgroupSize(c.sizes, c.times); got != c.want {
			t.Errorf("sizes %v, phases %v: picked %d, want %d", c.sizes, c.times, got, c.want)
		}
	}
}
