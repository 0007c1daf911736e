package perfmodel

import (
	"math"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestPredictIteration: with the H200's profile and the 4.24B model's
// update phase (a CPU-bound schedule), the serial iteration is forward,
// backward and the phase; the overlapped forward hides the shorter of
// itself and the phase but for its last block, or with the resident
// subgroups last but for their suffix; speculation takes the CPU
// time of the speculated parameters out of the phase, capped by the
// backward's window after the resident share, by the CPU's busy time and
// by what the CPU may speculate on (nothing of the CPU subgroups without
// the prefetch or with the upcast; the host-held ones always).
func TestPredictIteration(t *testing.T) {
	p, err := Read("../testdata/profiles/h200.json")
	if err != nil {
		t.Fatal(err)
	}
	const held = 600_000_000
	w := Workload{Params: 3_600_000_000, SubgroupSize: 100_000_000, GradDType: adam.BF16, CopyBytes: 2, Threads: 16,
		GPUBudget: 16 << 30, Prefetch: true, HostHeld: held}
	ch, err := p.Choose(w)
	if err != nil {
		t.Fatal(err)
	}
	s := ch.Schedule
	if s.CPU == 0 || s.UpcastOnGPU {
		t.Fatalf("the chosen schedule %+v: the test wants CPU subgroups without the upcast", s)
	}
	ph, err := p.Predict(w, s)
	if err != nil {
		t.Fatal(err)
	}
	if ph.Bottleneck != ResCPU {
		t.Fatalf("the chosen schedule %+v is %s-bound: the test wants the CPU the bottleneck", s, ph.Bottleneck)
	}
	cpuParams := float64(w.Params) / float64(w.Subgroups()) * float64(s.CPU)
	share := func(n float64) float64 { return n / (held + cpuParams) * ph.Busy[ResCPU] } // n parameters' share of the CPU's time
	cf, err := p.CPURate(16, adam.BF16)
	if err != nil {
		t.Fatal(err)
	}
	if p.GPU.Contention.CPU <= 1 {
		t.Fatalf("the profile's CPU contention %v: the test wants the speculation's rate slowed by it", p.GPU.Contention.CPU)
	}
	specRate := cf.Rate / p.GPU.Contention.CPU // the backward's copies run beside the speculation
	sizes := SubgroupSizes(w.Params, w.SubgroupSize)
	var resParams int64 // the resident subgroups: the flat space's suffix
	for _, n := range sizes[len(sizes)-s.Resident:] {
		resParams += n
	}
	if s.Resident == 0 {
		t.Fatalf("the chosen schedule %+v: the test wants resident subgroups", s)
	}
	resShare := float64(resParams) / float64(w.Params+held)
	if resShare <= 1.0/36 {
		t.Fatalf("the resident suffix is %.3f of the parameters: the test wants more than a block's", resShare)
	}
	rest := ph.Fill + ph.Drain
	for _, r := range Resources {
		if r != ResCPU {
			rest = max(rest, ph.Busy[r])
		}
	}
	const fwd, bwd = 0.150, 0.400
	near := func(a, b float64) bool { return math.Abs(a-b) <= 1e-12*max(1, math.Abs(b)) }
	for _, tc := range []struct {
		name    string
		w       Workload
		s       Schedule
		it      IterationWork
		spec    float64 // the expected Speculated
		seconds func(after float64) float64
	}{
		{"serial", w, s, IterationWork{Forward: fwd, Backward: bwd, Blocks: 36}, 0,
			func(a float64) float64 { return fwd + bwd + a }},
		{"overlap: the resident suffix's forward after the phase", w, s, IterationWork{Forward: fwd, Backward: bwd, Blocks: 36, OverlapForward: true}, 0,
			func(a float64) float64 { return bwd + max(a+fwd*max(1.0/36, resShare), fwd) }},
		{"overlap, resident first: the last block's forward after the phase", w, s, IterationWork{Forward: fwd, Backward: bwd, Blocks: 36, OverlapForward: true, ResidentFirst: true}, 0,
			func(a float64) float64 { return bwd + max(a+fwd/36, fwd) }},
		{"overlap, a long forward", w, s, IterationWork{Forward: 10, Backward: bwd, Blocks: 36, OverlapForward: true}, 0,
			func(a float64) float64 { return bwd + 10 }},
		{"speculate 100M", w, s, IterationWork{Forward: fwd, Backward: bwd, Blocks: 36, OverlapForward: true, SpeculateParams: 100_000_000, ResidentFirst: true}, share(100_000_000),
			func(a float64) float64 { return bwd + max(a+fwd/36, fwd) }},
		{"speculate all: the window after the residents", w, s, IterationWork{Forward: fwd, Backward: bwd, Blocks: 36, SpeculateParams: 1 << 40},
			share(min(held+cpuParams, specRate*(1-float64(resParams)/float64(w.Params+held))*bwd)),
			func(a float64) float64 { return fwd + bwd + a }},
		{"speculate all, resident first: the whole backward", w, s, IterationWork{Forward: fwd, Backward: bwd, Blocks: 36, SpeculateParams: 1 << 40, ResidentFirst: true},
			share(min(held+cpuParams, specRate*bwd)),
			func(a float64) float64 { return fwd + bwd + a }},
		{"speculate all, a long backward", w, s, IterationWork{Forward: fwd, Backward: 100, Blocks: 36, SpeculateParams: 1 << 40},
			ph.Busy[ResCPU],
			func(a float64) float64 { return fwd + 100 + a }},
		{"speculate at a measured rate", w, s, IterationWork{Forward: fwd, Backward: bwd, Blocks: 36, SpeculateParams: 1 << 40, SpeculateRate: 1e9, ResidentFirst: true},
			share(min(held+cpuParams, 1e9*bwd)),
			func(a float64) float64 { return fwd + bwd + a }},
	} {
		r, err := p.PredictIteration(tc.w, tc.s, tc.it)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		after := ph.Makespan
		if tc.spec > 0 {
			after = max(ph.Makespan-tc.spec, rest)
		}
		want := tc.seconds(after)
		if tc.it.OverlapForward { // the GPU runs the forward, the backward and the phase's kernels
			want = max(want, tc.it.Forward+tc.it.Backward+ph.Busy[ResGPU])
		}
		if r.Phase.Makespan != ph.Makespan || !near(r.Speculated, tc.spec) || !near(r.After, after) ||
			!near(r.Seconds, want) || !near(r.Serial, tc.it.Forward+tc.it.Backward+ph.Makespan) {
			t.Errorf("%s: phase %.4f speculated %.4f after %.4f iteration %.4f serial %.4f s; want %.4f %.4f %.4f %.4f %.4f",
				tc.name, r.Phase.Makespan, r.Speculated, r.After, r.Seconds, r.Serial,
				ph.Makespan, tc.spec, after, want, tc.it.Forward+tc.it.Backward+ph.Makespan)
		}
		if wantRate := map[bool]float64{true: specRate, false: tc.it.SpeculateRate}[tc.it.SpeculateRate == 0]; tc.spec > 0 && r.SpeculateRate != wantRate {
			t.Errorf("%s: speculated at %v parameters a second, want %v", tc.name, r.SpeculateRate, wantRate)
		}
		if tc.spec > 0 && !(r.Seconds < r.Serial) {
			t.Errorf("%s: iteration %.4f s not under the serial %.4f s", tc.name, r.Seconds, r.Serial)
		}
	}

	// Without the prefetch, or with the upcast on the GPU, only the
	// host-held parameters are speculated on.
	for _, tc := range []struct {
		name string
		w    Workload
		s    Schedule
	}{
		{"no prefetch", func() Workload { v := w; v.Prefetch = false; return v }(), s},
		{"upcast", func() Workload { v := w; v.GPUBudget = 24 << 30; return v }(), Schedule{CPU: s.CPU, GPU: s.GPU, Resident: s.Resident, UpcastOnGPU: true}},
	} {
		ph, err := p.Predict(tc.w, tc.s)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		r, err := p.PredictIteration(tc.w, tc.s, IterationWork{Forward: fwd, Backward: 100, Blocks: 36, SpeculateParams: 1 << 40})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		cpu := float64(tc.w.Params) / float64(tc.w.Subgroups()) * float64(tc.s.CPU)
		if want := held / (held + cpu) * ph.Busy[ResCPU]; !near(r.Speculated, want) {
			t.Errorf("%s: speculated %.4f s, want the host-held parameters' %.4f s", tc.name, r.Speculated, want)
		}
	}

	for _, bad := range []IterationWork{
		{Forward: -1, Backward: 1, Blocks: 1},
		{Forward: 1, Backward: math.NaN(), Blocks: 1},
		{Forward: math.Inf(1), Backward: 1, Blocks: 1},
		{Forward: 1, Backward: 1},
		{Forward: 1, Backward: 1, Blocks: 1, SpeculateParams: -1},
		{Forward: 1, Backward: 1, Blocks: 1, SpeculateRate: -1},
		{Forward: 1, Backward: 1, Blocks: 1, SpeculateRate: math.Inf(1)},
	} {
		if _, err := p.PredictIteration(w, s, bad); err == nil || !strings.Contains(err.Error(), "PredictIteration") {
			t.Errorf("%+v: error %v, want PredictIteration's", bad, err)
		}
	}
}
