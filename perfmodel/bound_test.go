package perfmodel

import (
	"fmt"
	"math"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestBoundUnderPredictions: with the H200's profile, for models from 124M
// to 5.6B parameters, GPU budgets from none to all-resident, with and
// without the prefetch and host-held subgroups, the bound is at most the
// fluid limit (Limit), which is at most the model's chosen schedule
// (Choose): the bound counts no latency, fill, drain or contention.
func TestBoundUnderPredictions(t *testing.T) {
	p, err := Read("../testdata/profiles/h200.json")
	if err != nil {
		t.Fatal(err)
	}
	const gib = 1 << 30
	for _, params := range []int64{124_000_000, 1_557_000_000, 4_236_000_000, 5_600_000_000} {
		for _, budget := range []int64{0, 2 * gib, 16 * gib, 80 * gib} {
			for _, pre := range []bool{false, true} {
				for _, held := range []int64{0, params / 3} {
					w := Workload{Params: params - held, SubgroupSize: 100_000_000, GradDType: adam.BF16, CopyBytes: 2, Threads: 16,
						GPUBudget: budget, Prefetch: pre, HostHeld: held}
					name := fmt.Sprintf("%d/%dGiB/prefetch=%v/held=%d", params, budget/gib, pre, held)
					b, err := p.Bound(w)
					if err != nil {
						t.Fatalf("%s: %v", name, err)
					}
					lim, err := p.Limit(w)
					if err != nil {
						t.Fatalf("%s: %v", name, err)
					}
					ch, err := p.Choose(w)
					if err != nil {
						t.Fatalf("%s: %v", name, err)
					}
					if !(b.Seconds > 0) || b.Seconds > lim.Makespan*(1+1e-9) || lim.Makespan > ch.Makespan*(1+1e-9) {
						t.Errorf("%s: bound %.4f s (%s), limit %.4f s, chosen %.4f s: want bound <= limit <= chosen", name, b.Seconds, b.Bottleneck, lim.Makespan, ch.Makespan)
					}
					if b.Busy[b.Bottleneck] != b.Seconds {
						t.Errorf("%s: the bottleneck %s's time %v is not the bound %v", name, b.Bottleneck, b.Busy[b.Bottleneck], b.Seconds)
					}
				}
			}
		}
	}
}

// TestBoundMeasured: phases measured on the H200 (BENCHMARKS.md) are over
// the bound of their workload under the H200's profile, and the bound of an
// all-CPU machine is the CPU's work at its rate.
func TestBoundMeasured(t *testing.T) {
	p, err := Read("../testdata/profiles/h200.json")
	if err != nil {
		t.Fatal(err)
	}
	// dos bench --params 3.91e9 --subgroup-size 50000000 (a 16 GiB budget),
	// 2026-12-01: the model's schedule measured 0.500 s, 7.2 % under Limit.
	w := Workload{Params: 3_910_000_000, SubgroupSize: 50_000_000, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 16 << 30}
	b, err := p.Bound(w)
	if err != nil {
		t.Fatal(err)
	}
	lim, err := p.Limit(w)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("3.91B in 50M subgroups, 16 GiB: bound %.3f s (%s at %.1f CPU / %.1f GPU / %.0f resident), limit %.3f s, measured 0.500 s",
		b.Seconds, b.Bottleneck, b.CPU, b.GPU, b.Resident, lim.Makespan)
	if b.Seconds >= 0.500 {
		t.Errorf("the bound %.3f s is over the measured 0.500 s", b.Seconds)
	}
	cpu := &Profile{CPU: p.CPU}
	b, err = cpu.Bound(w)
	if err != nil {
		t.Fatal(err)
	}
	f, _ := p.CPURate(16, adam.BF16)
	if want := float64(w.Params) / f.Rate; b.Seconds != want || b.Bottleneck != ResCPU {
		t.Errorf("without a GPU: bound %v s (%s), want the CPU's %v s", b.Seconds, b.Bottleneck, want)
	}
}

// TestIterationBound: a whole iteration's bound is at least the update
// phase's (with its prefetched work counted) and at least the compute;
// with no compute and no copies it is the phase's; the streamed weights'
// copies add to PCIe; a negative compute is refused.
func TestIterationBound(t *testing.T) {
	p, err := Read("../testdata/profiles/h200.json")
	if err != nil {
		t.Fatal(err)
	}
	w := Workload{Params: 4_236_000_000, SubgroupSize: 100_000_000, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 6 << 30, Prefetch: true}
	noPre := w
	noPre.Prefetch = false
	phase, err := p.Bound(noPre)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := p.IterationBound(w, Iteration{}); err != nil || b.Seconds != phase.Seconds {
		t.Errorf("no compute, no copies: %v s (%v), want the phase's %v s with the prefetched work", b.Seconds, err, phase.Seconds)
	}
	for _, it := range []Iteration{{Compute: 0.52}, {Compute: 0.1}, {Compute: 0.52, H2DBytes: 2 * 2 * 2.0e9, D2HBytes: 2 * 2.0e9}} {
		b, err := p.IterationBound(w, it)
		if err != nil {
			t.Fatal(err)
		}
		if b.Seconds < phase.Seconds || b.Seconds < it.Compute {
			t.Errorf("%+v: bound %.3f s (%s), under the phase's %.3f s or the compute", it, b.Seconds, b.Bottleneck, phase.Seconds)
		}
		t.Logf("4.24B, 6 GiB of update budget, %+v: iteration bound %.3f s (%s)", it, b.Seconds, b.Bottleneck)
	}
	with, _ := p.IterationBound(w, Iteration{H2DBytes: 8e9, D2HBytes: 4e9})
	if with.Busy[ResPCIe] <= phase.Busy[ResPCIe] {
		t.Errorf("12 GB of streamed copies left PCIe at %v s (the phase alone %v s)", with.Busy[ResPCIe], phase.Busy[ResPCIe])
	}
	if _, err := p.IterationBound(w, Iteration{Compute: -1}); err == nil {
		t.Error("a negative compute accepted")
	}
}

// TestBoundOneDType: a profile with the CPU's rate for bfloat16 gradients
// alone (the trainer's start-up calibration measures the run's dtype
// only) bounds and chooses without the upcast, which needs the fp32 rate,
// instead of failing.
func TestBoundOneDType(t *testing.T) {
	p, err := Read("../testdata/profiles/h200.json")
	if err != nil {
		t.Fatal(err)
	}
	q := *p
	q.CPU = nil
	for _, f := range p.CPU {
		if f.GradDType == adam.BF16 {
			q.CPU = append(q.CPU, f)
		}
	}
	w := Workload{Params: 1_557_000_000, SubgroupSize: 100_000_000, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 8 << 30, Prefetch: true}
	b, err := q.Bound(w)
	if err != nil || !(b.Seconds > 0) || b.UpcastOnGPU {
		t.Fatalf("Bound: %+v, %v; want a bound without the upcast", b, err)
	}
	if full, err := p.Bound(w); err != nil || full.Seconds > b.Seconds*(1+1e-9) {
		t.Errorf("the bound with the fp32 rate %v (%v) is over the one without it %v: it has more splits", full.Seconds, err, b.Seconds)
	}
	if _, err := q.IterationBound(w, Iteration{Compute: 0.2}); err != nil {
		t.Errorf("IterationBound: %v", err)
	}
	if r, err := q.ChooseIteration(w, IterationWork{Forward: 0.1, Backward: 0.3, Blocks: 48, SpeculateParams: 1e9}); err != nil || r.Phase.UpcastOnGPU {
		t.Errorf("ChooseIteration: %+v, %v; want a schedule without the upcast", r.Phase.Schedule, err)
	}
}

// TestBoundHostMem: with the host memory's peak (GPUProfile.HostMem) the
// bound counts the bytes the updates and copies pass through it: a slow
// host memory binds, at between 24 bytes a parameter (the GPU lane's
// state in and out, the least any split moves) and 32 (a CPU update's 28
// and its gradient's and copy's 4 over PCIe) at its rate, and the bound is
// never below the one without the term, which a profile without HostMem
// keeps; Validate refuses a negative or infinite rate.
func TestBoundHostMem(t *testing.T) {
	p, err := Read("../testdata/profiles/h200.json")
	if err != nil {
		t.Fatal(err)
	}
	if p.GPU.HostMem != 0 {
		t.Fatalf("the H200 profile has HostMem %v: the test wants one without", p.GPU.HostMem)
	}
	for _, budget := range []int64{0, 16 << 30} {
		w := Workload{Params: 4_236_000_000, SubgroupSize: 100_000_000, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: budget}
		without, err := p.Bound(w)
		if err != nil {
			t.Fatal(err)
		}
		if without.Busy[ResHostMem] != 0 {
			t.Fatalf("no HostMem: host memory busy %v s", without.Busy[ResHostMem])
		}
		q := *p
		g := *p.GPU
		q.GPU = &g
		for _, rate := range []float64{1e9, 150e9, 1e15} {
			g.HostMem = rate
			b, err := q.Bound(w)
			if err != nil {
				t.Fatal(err)
			}
			if b.Seconds < without.Seconds*(1-1e-12) {
				t.Errorf("budget %d, host memory %g B/s: bound %v s under the one without the term, %v s", budget, rate, b.Seconds, without.Seconds)
			}
			if rate == 1e15 && b.Seconds != without.Seconds {
				t.Errorf("budget %d: a host memory that never binds changed the bound: %v s, want %v s", budget, b.Seconds, without.Seconds)
			}
			if rate == 1e9 {
				nonRes := float64(w.Params) - b.Resident*float64(w.SubgroupSize)
				lo, hi := 24*nonRes/rate, 32*nonRes/rate
				if b.Bottleneck != ResHostMem || b.Seconds < lo*(1-1e-9) || b.Seconds > hi*(1+1e-9) {
					t.Errorf("budget %d, 1 GB/s host memory: bound %v s (%s, %.1f resident), want host-memory in [%v, %v] s", budget, b.Seconds, b.Bottleneck, b.Resident, lo, hi)
				}
			}
		}
	}
	q := *p
	g := *p.GPU
	q.GPU = &g
	for _, bad := range []float64{-1, math.Inf(1), math.NaN()} {
		g.HostMem = bad
		if err := q.Validate(); err == nil {
			t.Errorf("HostMem %v: Validate says nothing", bad)
		}
	}
}
