package offload

import (
	"maps"
	"math"
	"math/rand/v2"
	"path/filepath"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// truthProfile is a machine whose PCIe is slow next to its CPU: the CPU
// workers at 1e9 parameters/s, the fused update at 5e10, copies at 1e10
// bytes/s.
func truthProfile() *perfmodel.Profile { return flatProfile(1, 1e9, 5e10, 1e10, 4e11) }

// flatProfile is a machine of threads CPU workers at cpu parameters/s
// (either gradient dtype), the fused update at update, copies at pcie
// bytes/s each way (both at once too) and the upcast at convert, every
// operation with 10 µs of latency.
func flatProfile(threads int, cpu, update, pcie, convert float64) *perfmodel.Profile {
	fit := func(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate, LatencyS: 1e-5} }
	p := &perfmodel.Profile{Format: perfmodel.ProfileFormat, Version: perfmodel.ProfileVersion}
	for _, d := range []adam.DType{adam.F32, adam.BF16} {
		p.CPU = append(p.CPU, perfmodel.CPUFit{Threads: threads, GradDType: d, Fit: fit(cpu)})
	}
	p.GPU = &perfmodel.GPUProfile{Update: fit(update), H2D: fit(pcie), D2H: fit(pcie), H2DBoth: fit(pcie), D2HBoth: fit(pcie), Convert: fit(convert)}
	return p
}

// measured is the update phase that truth says schedule s takes, as the
// engine would measure it.
func measured(t *testing.T, truth *perfmodel.Profile, w perfmodel.Workload, s perfmodel.Schedule) scheduler.Busy {
	t.Helper()
	p, err := truth.Predict(w, s)
	if err != nil {
		t.Fatal(err)
	}
	d := func(r perfmodel.Resource) time.Duration { return seconds(p.Busy[r]) }
	return scheduler.Busy{CPU: d(perfmodel.ResCPU), H2D: d(perfmodel.ResH2D), D2H: d(perfmodel.ResD2H), GPU: d(perfmodel.ResGPU),
		Makespan: seconds(p.Makespan)}
}

// TestReplanObserve: a profile that thinks PCIe three times faster than it
// is chooses to stream subgroups the machine would rather update on the
// CPU. Fed the machine's update phases, Replan's refit learns the factor
// per resource, re-plans to the machine's best schedule (within 2 %), and
// its predictions then match the measured phases within 10 % (within 1 %
// here: the machine is the model).
func TestReplanObserve(t *testing.T) {
	truth := truthProfile()
	base := truth.Scaled(map[perfmodel.Resource]float64{perfmodel.ResH2D: 1.0 / 3, perfmodel.ResD2H: 1.0 / 3})
	w := perfmodel.Workload{Params: 24e8, SubgroupSize: 1e8, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 6 << 30}
	first, err := base.Choose(w)
	if err != nil {
		t.Fatal(err)
	}
	want, err := truth.Choose(w)
	if err != nil {
		t.Fatal(err)
	}
	if first.Schedule == want.Schedule {
		t.Fatalf("the wrong profile chose the machine's best schedule %+v: the test needs another", want.Schedule)
	}
	re := newReplanState(base, first, w, 0)
	cur, replans := &first, 0
	for step := int64(1); step <= 20; step++ {
		next, basePred, err := re.observe(measured(t, truth, w, cur.Schedule), cur, step, false)
		if err != nil {
			t.Fatal(err)
		}
		if next == nil {
			continue
		}
		if next.Schedule != cur.Schedule {
			replans++
			re.basePred = basePred
		}
		cur = next
	}
	got, err := truth.Predict(w, cur.Schedule)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first %+v (%.3f s on the machine), re-planned %d times to %+v (%.3f s; the machine's best %+v, %.3f s); factors %v",
		first.Schedule, must(truth.Predict(w, first.Schedule)).Makespan, replans, cur.Schedule, got.Makespan, want.Schedule, want.Makespan, re.f)
	if replans == 0 || got.Makespan > 1.02*want.Makespan {
		t.Errorf("ended on %+v: %.4f s on the machine, its best %.4f s", cur.Schedule, got.Makespan, want.Makespan)
	}
	if math.Abs(cur.Makespan-got.Makespan) > 0.01*got.Makespan {
		t.Errorf("predicted %.4f s, measured %.4f s", cur.Makespan, got.Makespan)
	}
	if f := re.f[perfmodel.ResH2D]; math.Abs(f-3) > 0.03 {
		t.Errorf("H2D factor %.3f, want 3", f)
	}
}

// TestReplanObserveIteration: once PlanIteration has chosen the schedule
// for the iteration (replanState.iter), the refits, which see only the
// phases that kept no speculation, correct its prediction and move
// nothing, although the phase alone would be faster elsewhere.
func TestReplanObserveIteration(t *testing.T) {
	truth := truthProfile()
	base := truth.Scaled(map[perfmodel.Resource]float64{perfmodel.ResH2D: 1.0 / 3, perfmodel.ResD2H: 1.0 / 3})
	w := perfmodel.Workload{Params: 24e8, SubgroupSize: 1e8, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 6 << 30, Prefetch: true}
	it := perfmodel.IterationWork{Forward: 0.5, Backward: 1.5, Blocks: 24, OverlapForward: true, SpeculateParams: 8e8}
	first := must(base.ChooseIteration(w, it)).Phase
	if phase := must(truth.Choose(w)); phase.Schedule == first.Schedule {
		t.Fatalf("the phase's best is the iteration's %+v: the test needs two", phase.Schedule)
	}
	for _, held := range []bool{false, true} {
		re := newReplanState(base, first, w, 0)
		if held {
			re.iter = &it
		}
		cur, moved := &first, false
		for step := int64(1); step <= 20; step++ {
			next, basePred, err := re.observe(measured(t, truth, w, cur.Schedule), cur, step, false)
			if err != nil {
				t.Fatal(err)
			}
			if next != nil {
				if next.Schedule != cur.Schedule {
					re.basePred, moved = basePred, true
				}
				cur = next
			}
		}
		got := must(truth.Predict(w, cur.Schedule))
		if moved == held || held && math.Abs(cur.Makespan-got.Makespan) > 0.01*got.Makespan {
			t.Errorf("iteration's schedule held %v: moved %v to %+v, predicted %.4f s, the machine %.4f s; want a move only without it, and the prediction corrected",
				held, moved, cur.Schedule, cur.Makespan, got.Makespan)
		}
	}
}

// TestReplanRevert: the model's best schedule, run, measures slower than
// a schedule run before by more than replanGain, with busy times the
// model foresaw (the miss is in their overlap, which no factor corrects:
// the corrected model keeps choosing it). The refit moves back to the
// schedule measured faster; not when it is within replanGain, nor once
// the schedule is the iteration's.
func TestReplanRevert(t *testing.T) {
	truth := truthProfile()
	w := perfmodel.Workload{Params: 24e8, SubgroupSize: 1e8, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 6 << 30}
	cur := must(truth.Choose(w))
	other := perfmodel.Schedule{CPU: w.Subgroups()}
	if cur.Schedule == other {
		t.Fatal("the model's best is all on the CPU: the test needs another")
	}
	for _, tc := range []struct {
		name   string
		seen   float64 // the other schedule's measured phase over the current one's
		iter   bool
		revert bool
	}{
		{"the other 10 % faster", 0.90, false, true},
		{"the other 3 % faster", 0.97, false, false},
		{"the iteration's schedule", 0.90, true, false},
	} {
		re := newReplanState(truth, cur, w, 0)
		re.warm = true
		b := measured(t, truth, w, cur.Schedule)
		b.Makespan = seconds(1.2 * cur.Makespan) // the overlap missed, every lane foreseen
		re.seen[other] = tc.seen * b.Makespan.Seconds()
		if tc.iter {
			re.iter = &perfmodel.IterationWork{Forward: 0.1, Backward: 0.3, Blocks: 24}
		}
		next, _, err := re.observe(b, &cur, replanEvery, false)
		if err != nil {
			t.Fatal(err)
		}
		if back := next != nil && next.Schedule == other; back != tc.revert {
			t.Errorf("%s: next %+v, want a move back to %+v: %v", tc.name, next, other, tc.revert)
		}
	}
}

// TestReplanLanes: a profile that thinks the CPU 1.2 times slower and
// PCIe 1.1 times faster than they are predicts its schedule's makespan
// within replanMiss (so a check of the makespan alone never refits) while
// it misses both lanes by 15 %: the streamed lane is the bottleneck, the
// CPU idles, and the machine's best schedule is 7 % faster. The refit per
// resource re-plans to it.
func TestReplanLanes(t *testing.T) {
	truth := truthProfile()
	base := truth.Scaled(map[perfmodel.Resource]float64{perfmodel.ResCPU: 1.2, perfmodel.ResH2D: 0.9, perfmodel.ResD2H: 0.9})
	w := perfmodel.Workload{Params: 24e8, SubgroupSize: 1e8, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 6 << 30}
	first := must(base.Choose(w))
	onTruth := must(truth.Predict(w, first.Schedule))
	want := must(truth.Choose(w))
	if math.Abs(first.Makespan-onTruth.Makespan) > replanMiss*onTruth.Makespan || want.Makespan > (1-replanGain)*onTruth.Makespan {
		t.Fatalf("the test needs a first schedule whose makespan is foreseen (predicted %.3f s, on the machine %.3f s) and a best schedule %+v more than %v faster (%.3f s)",
			first.Makespan, onTruth.Makespan, want.Schedule, replanGain, want.Makespan)
	}
	if m := predictionMiss(&first, measured(t, truth, w, first.Schedule)); m <= replanMiss*onTruth.Makespan {
		t.Fatalf("predictionMiss %.3f s: the lanes should be missed by more than %v of %.3f s", m, replanMiss, onTruth.Makespan)
	}
	re := newReplanState(base, first, w, 0)
	cur := &first
	for step := int64(1); step <= 12; step++ {
		next, basePred, err := re.observe(measured(t, truth, w, cur.Schedule), cur, step, false)
		if err != nil {
			t.Fatal(err)
		}
		if next != nil {
			if next.Schedule != cur.Schedule {
				re.basePred = basePred
			}
			cur = next
		}
	}
	got := must(truth.Predict(w, cur.Schedule))
	t.Logf("first %+v (%.3f s on the machine, %.3f predicted), ended on %+v (%.3f s; best %+v, %.3f s)",
		first.Schedule, onTruth.Makespan, first.Makespan, cur.Schedule, got.Makespan, want.Schedule, want.Makespan)
	if got.Makespan > 1.02*want.Makespan {
		t.Errorf("ended on %+v at %.3f s; the machine's best is %+v at %.3f s", cur.Schedule, got.Makespan, want.Schedule, want.Makespan)
	}
}

// TestReplanLanesContention: on a machine whose CPU workers and copies
// slow each other (the model's contention), the corrected model cannot
// match every lane, so a lane's miss would refit every replanEvery steps
// for good; it refits each schedule once for its lanes (the makespan still
// refits whenever it misses), whatever the number of steps.
func TestReplanLanesContention(t *testing.T) {
	truth := truthProfile()
	truth.GPU.Contention = perfmodel.Contention{CPU: 1.5, PCIe: 1.5}
	base := truth.Scaled(map[perfmodel.Resource]float64{perfmodel.ResCPU: 1.2, perfmodel.ResH2D: 0.9, perfmodel.ResD2H: 0.9})
	w := perfmodel.Workload{Params: 24e8, SubgroupSize: 1e8, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 6 << 30}
	first := must(base.Choose(w))
	re := newReplanState(base, first, w, 0)
	cur, refits, schedules := &first, 0, map[perfmodel.Schedule]bool{first.Schedule: true}
	for step := int64(1); step <= 300; step++ {
		next, basePred, err := re.observe(measured(t, truth, w, cur.Schedule), cur, step, false)
		if err != nil {
			t.Fatal(err)
		}
		if next != nil {
			refits++
			if next.Schedule != cur.Schedule {
				re.basePred = basePred
				schedules[next.Schedule] = true
			}
			cur = next
		}
	}
	t.Logf("%d refits over 300 steps, %d schedules, ended on %+v", refits, len(schedules), cur.Schedule)
	if refits > 2*len(schedules)+2 {
		t.Errorf("%d refits over 300 steps for %d schedules: a lane's miss the model cannot fit refits for good", refits, len(schedules))
	}
}

func must[T any](p T, err error) T {
	if err != nil {
		panic(err)
	}
	return p
}

// TestReplanExact: an optimizer that re-plans (Options.Replan on the
// simulated device, with a profile that mispredicts it) keeps the state
// bit for bit the host-only optimizer's, reports the predicted and
// measured update phase of every step, and refuses a forced Schedule or a
// missing profile.
func TestReplanExact(t *testing.T) {
	fit := func(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate, LatencyS: 1e-6} }
	sim := scheduler.NewSim(scheduler.SimOptions{Profile: &perfmodel.GPUProfile{H2D: fit(1e5), D2H: fit(1e5), Update: fit(5e10), Convert: fit(4e11)}})
	prof := truthProfile()
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2, MaxGradNorm: 1}
	ref := newWith(t, testParams, base)
	opts := base
	opts.Device, opts.Profile, opts.GPUBudget, opts.Replan = sim, prof, 2*12*300, true
	o := newWith(t, testParams, opts)
	r := rand.New(rand.NewPCG(5, 6))
	start, _ := o.Plan()
	replans := 0
	for step := 1; step <= 12; step++ {
		a, b := stepBoth(t, ref, o, r)
		if a.GradNorm != b.GradNorm || !(b.Predicted > 0) || !(b.Measured > 0) {
			t.Fatalf("step %d: host %v, device %v (predicted %v, measured %v)", step, a, b, b.Predicted, b.Measured)
		}
		if b.Replanned {
			replans++
		}
	}
	end, _ := o.Plan()
	t.Logf("schedule %+v, re-planned %d times to %+v", start.Schedule, replans, end.Schedule)
	if replans == 0 || start.Schedule == end.Schedule {
		t.Errorf("no re-plan: the simulated device copies 10^5 times slower than the profile says")
	}
	sameState(t, synced(t, ref), synced(t, o))
	for _, bad := range []Options{{Replan: true, Device: sim, WorkingDType: adam.BF16, Schedule: &perfmodel.Schedule{CPU: 5}, Profile: prof},
		{Replan: true, Device: sim, WorkingDType: adam.BF16}, {Replan: true}} {
		if _, err := New(testParams, bad); err == nil {
			t.Errorf("New with %+v: no error", bad)
		}
	}
}

// TestReplanNoCycle: a schedule already measured no faster than the one in
// use is not chosen again, whatever the corrected model says of it.
func TestReplanNoCycle(t *testing.T) {
	truth := truthProfile()
	base := truth.Scaled(map[perfmodel.Resource]float64{perfmodel.ResH2D: 1.0 / 3, perfmodel.ResD2H: 1.0 / 3})
	w := perfmodel.Workload{Params: 24e8, SubgroupSize: 1e8, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 6 << 30}
	first := must(base.Choose(w))
	best := must(truth.Choose(w))
	re := newReplanState(base, first, w, 0)
	re.seen[best.Schedule] = 10 * must(truth.Predict(w, first.Schedule)).Makespan // measured far slower once
	cur := &first
	for step := int64(1); step <= 12; step++ {
		next, _, err := re.observe(measured(t, truth, w, cur.Schedule), cur, step, false)
		if err != nil {
			t.Fatal(err)
		}
		if next != nil {
			if next.Schedule != first.Schedule {
				t.Fatalf("step %d: re-planned to %+v, measured slower before", step, next.Schedule)
			}
			cur = next
		}
	}
}

// TestPlacement: Options.Placement "cpu" puts every subgroup on the CPU and
// "static" as many resident as GPUBudget holds (12 bytes a parameter each),
// over the optimizer's own subgroups (parameter groups included); an
// unknown name, or one with a forced Schedule or Replan, is refused.
func TestPlacement(t *testing.T) {
	sim := scheduler.NewSim(scheduler.SimOptions{})
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Device: sim, Groups: twoGroups}
	for _, tc := range []struct {
		placement string
		budget    int64
		want      perfmodel.Schedule
	}{
		{"cpu", 0, perfmodel.Schedule{CPU: 7}},
		{"static", 2*12*300 + 100, perfmodel.Schedule{CPU: 5, Resident: 2}},
	} {
		o := base
		o.Placement, o.GPUBudget = tc.placement, tc.budget
		opt, err := New(groupParams, o)
		if err != nil {
			t.Fatal(err)
		}
		if s, _ := opt.Schedule(); s != tc.want {
			t.Errorf("Placement %s: %+v, want %+v", tc.placement, s, tc.want)
		}
		opt.Close()
	}
	for _, bad := range []Options{{Placement: "fast"}, {Placement: "cpu", Schedule: &perfmodel.Schedule{CPU: 7}}, {Placement: "cpu", Replan: true, Calibrate: true}} {
		o := base
		o.Placement, o.Schedule, o.Replan, o.Calibrate = bad.Placement, bad.Schedule, bad.Replan, bad.Calibrate
		if opt, err := New(groupParams, o); err == nil {
			opt.Close()
			t.Errorf("Placement %q with %+v: no error", bad.Placement, bad)
		}
	}
}

// TestReplanHeld: a phase that may have waited on a lazy checkpoint's
// capture is reported (Predicted, Measured) but not folded into the
// factors or the measured schedules; the same phase not held is.
func TestReplanHeld(t *testing.T) {
	fit := func(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate, LatencyS: 1e-6} }
	sim := scheduler.NewSim(scheduler.SimOptions{Profile: &perfmodel.GPUProfile{H2D: fit(1e7), D2H: fit(1e7), Update: fit(5e10), Convert: fit(4e11)}})
	opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2, MaxGradNorm: 1,
		Device: sim, Profile: truthProfile(), GPUBudget: 2 * 12 * 300, Replan: true}
	o := newWith(t, testParams, opts)
	for step := 1; ; step++ { // until a phase after the first that did not re-plan (Measure reads it)
		fillGrads(o, 0)
		res, err := o.Step(StepArgs{})
		if err != nil {
			t.Fatal(err)
		}
		if step >= 2 && !res.Replanned {
			break
		}
		if step == 20 {
			t.Fatal("re-planned at each of 20 steps")
		}
	}
	// One more phase that Step does not observe (no base profile for it),
	// so that refit below sees a phase the factors have not seen: its
	// CPU lane's busy time is measured, never the same twice.
	base := o.re.base
	o.re.base = nil
	if _, err := o.Step(StepArgs{}); err != nil {
		t.Fatal(err)
	}
	o.re.base = base
	snapshot := func() (map[perfmodel.Resource]float64, map[perfmodel.Schedule]float64) {
		return maps.Clone(o.re.f), maps.Clone(o.re.seen)
	}
	f0, seen0 := snapshot()
	var res StepResult
	if err := o.refit(&res, true, false); err != nil {
		t.Fatal(err)
	}
	if !(res.Measured > 0) || !(res.Predicted > 0) {
		t.Errorf("held phase: predicted %v, measured %v: want both reported", res.Predicted, res.Measured)
	}
	if f, seen := snapshot(); !maps.Equal(f, f0) || !maps.Equal(seen, seen0) {
		t.Errorf("held phase folded in: factors %v -> %v, measured schedules %v -> %v", f0, f, seen0, seen)
	}
	if err := o.refit(&res, false, false); err != nil {
		t.Fatal(err)
	}
	if f, seen := snapshot(); maps.Equal(f, f0) && maps.Equal(seen, seen0) {
		t.Errorf("the same phase not held left the factors %v and measured schedules %v as they were", f, seen)
	}
}

// TestReplanHeldStep: a Step whose update phase waits on a lazy save's
// capture (here stalled by the disk) is not folded into Replan's fit; the
// next one, with the capture done, is.
func TestReplanHeldStep(t *testing.T) {
	fit := func(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate, LatencyS: 1e-6} }
	sim := scheduler.NewSim(scheduler.SimOptions{Profile: &perfmodel.GPUProfile{H2D: fit(1e7), D2H: fit(1e7), Update: fit(5e10), Convert: fit(4e11)}})
	opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2, MaxGradNorm: 1,
		Device: sim, Profile: truthProfile(), GPUBudget: 2 * 12 * 300, Replan: true}
	o := newWith(t, testParams, opts)
	if s, _ := o.Schedule(); s.CPU == 0 {
		t.Fatalf("schedule %+v: the test needs CPU subgroups (their host state waits for the capture)", s)
	}
	for k := 0; k < 4; k++ {
		fillGrads(o, k)
		if _, err := o.Step(StepArgs{}); err != nil {
			t.Fatal(err)
		}
	}
	fs := heldOS{checkpoint.OS, make(chan struct{})} // capture_test.go's
	e, err := checkpoint.NewEngine(fs, filepath.Join(t.TempDir(), "root"), checkpoint.EngineOptions{ChunkBytes: 4096, RingBytes: 8192})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	h, err := o.SaveAsync(e, o.StepCount(), nil)
	if err != nil {
		t.Fatal(err)
	}
	f0, seen0 := maps.Clone(o.re.f), maps.Clone(o.re.seen)
	go func() { time.Sleep(50 * time.Millisecond); close(fs.release) }()
	fillGrads(o, 5)
	res, err := o.Step(StepArgs{}) // waits for the capture, which waits for the disk
	if err != nil {
		t.Fatal(err)
	}
	if !(res.Measured > 0) {
		t.Errorf("held step: measured %v, want it reported", res.Measured)
	}
	if !maps.Equal(o.re.f, f0) || !maps.Equal(o.re.seen, seen0) {
		t.Errorf("the step that waited on the capture was folded in: factors %v -> %v", f0, o.re.f)
	}
	if _, err := h.Wait(); err != nil {
		t.Fatal(err)
	}
	fillGrads(o, 6)
	if _, err := o.Step(StepArgs{}); err != nil {
		t.Fatal(err)
	}
	if maps.Equal(o.re.f, f0) && maps.Equal(o.re.seen, seen0) {
		t.Errorf("the step after the capture was not folded in either")
	}
}

// stepBoth gives ref and o the same random bf16 gradients from r and steps
// both, failing the test on an error.
func stepBoth(t *testing.T, ref, o *Optimizer, r *rand.Rand) (a, b StepResult) {
	t.Helper()
	for i := range o.Params() {
		g, h := ref.Grad(i).Uint16(), o.Grad(i).Uint16()
		for j := range g {
			g[j] = adam.F32ToBF16(float32(r.NormFloat64()))
			h[j] = g[j]
		}
	}
	var err error
	if a, err = ref.Step(StepArgs{}); err != nil {
		t.Fatal(err)
	}
	if b, err = o.Step(StepArgs{}); err != nil {
		t.Fatal(err)
	}
	return a, b
}

// fillGrads writes o's bf16 gradients from a pattern shifted by k.
func fillGrads(o *Optimizer, k int) {
	for i := range o.Params() {
		for j, g := 0, o.Grad(i).Uint16(); j < len(g); j++ {
			g[j] = adam.F32ToBF16(0.01 * float32((j+k)%7-3))
		}
	}
}

// TestOptimizerLimit: with a device and a profile, Limit is the profile's
// fluid limit for the optimizer's subgroups and budget, at or below its
// plan's prediction; OverlapBackward plans (and bounds) the phase without
// the prefetched copies; without a profile or a device there is none.
func TestOptimizerLimit(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2,
		Device: scheduler.NewSim(scheduler.SimOptions{}), Profile: truthProfile(), GPUBudget: 2 * 12 * 300}
	o := newWith(t, testParams, base)
	lim, ok := o.Limit()
	plan, _ := o.Plan()
	want, err := truthProfile().Limit(o.workload())
	if !ok || err != nil || lim.Makespan != want.Makespan || !(lim.Makespan > 0 && lim.Makespan <= plan.Makespan) {
		t.Fatalf("Limit %+v (%v), want %g, at most the plan's %g", lim, ok, want.Makespan, plan.Makespan)
	}
	over := base
	over.Device, over.OverlapBackward = scheduler.NewSim(scheduler.SimOptions{}), true
	if l, ok := newWith(t, testParams, over).Limit(); !ok || l.Makespan > lim.Makespan {
		t.Errorf("with OverlapBackward: %+v (%v), want at most %g", l, ok, lim.Makespan)
	}
	noProf := base
	noProf.Device, noProf.Profile, noProf.Schedule = scheduler.NewSim(scheduler.SimOptions{}), nil, &perfmodel.Schedule{CPU: 6}
	if _, ok := newWith(t, testParams, noProf).Limit(); ok {
		t.Error("a limit without a profile")
	}
	if _, ok := newTest(t, Options{SubgroupSize: 300}).Limit(); ok {
		t.Error("a limit without a device")
	}
}

// TestReplanGPUShared: a phase whose GPU kernels ran beside the caller's
// next forward (StepAsync), every subgroup resident, measures the GPU
// three times slower than it is
// and the makespan 1.5 times the prediction. Observed as shared, the
// GPU's factor is not folded in and the refit keeps the schedule; observed
// as the phase's own, the GPU's factor is 3.
func TestReplanGPUShared(t *testing.T) {
	truth := truthProfile()
	// Every subgroup resident (no cap): the phase is the GPU's.
	w := perfmodel.Workload{Params: 24e8, SubgroupSize: 1e8, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 64 << 30}
	cur := must(truth.Choose(w))
	if cur.Busy[perfmodel.ResGPU] < replanMinShare*cur.Makespan {
		t.Fatalf("the test needs a phase with GPU work: %+v", cur)
	}
	for _, shared := range []bool{true, false} {
		re := newReplanState(truth, cur, w, 0)
		re.warm = true
		b := measured(t, truth, w, cur.Schedule)
		b.GPU *= 3
		b.Makespan = seconds(1.5 * cur.Makespan)
		next, _, err := re.observe(b, &cur, replanEvery, shared)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case shared && re.f[perfmodel.ResGPU] != 0:
			t.Errorf("shared: the GPU's factor %v, want it not folded in (0)", re.f[perfmodel.ResGPU])
		case shared && (next == nil || next.Schedule != cur.Schedule):
			t.Errorf("shared: next %+v, want the schedule kept, %+v", next, cur.Schedule)
		case !shared && math.Abs(re.f[perfmodel.ResGPU]-3) > 1e-9:
			t.Errorf("the phase's own: the GPU's factor %v, want 3", re.f[perfmodel.ResGPU])
		}
	}
}

// TestReplanObserveCPU: a phase that kept speculative updates of a
// quarter of the CPU's parameters folds in the CPU's factor alone, its
// busy time against three quarters of the predicted (the CPU 1.25 times
// slower than the profile: the factor 1.25), then halfway to the next
// phase's; the other lanes' factors are untouched and nothing re-plans.
func TestReplanObserveCPU(t *testing.T) {
	truth := truthProfile()
	w := perfmodel.Workload{Params: 24e8, SubgroupSize: 1e8, GradDType: adam.BF16, CopyBytes: 2, Threads: 16, GPUBudget: 6 << 30}
	cur := must(truth.Choose(w))
	re := newReplanState(truth, cur, w, 0)
	b := measured(t, truth, w, cur.Schedule)
	re.observeCPU(b, 4, 3) // the first phase: not folded
	if re.f[perfmodel.ResCPU] != 0 || re.cpuSeen != 0 {
		t.Fatalf("the first phase folded: %v", re.f)
	}
	b.CPU = seconds(1.25 * 0.75 * cur.Busy[perfmodel.ResCPU])
	re.observeCPU(b, 4e8, 3e8)
	if f := re.f[perfmodel.ResCPU]; math.Abs(f-1.25) > 1e-6 {
		t.Errorf("the CPU's factor %v, want 1.25", f)
	}
	b.CPU = seconds(1.5 * 0.5 * cur.Busy[perfmodel.ResCPU])
	re.observeCPU(b, 4e8, 2e8)
	if f := re.f[perfmodel.ResCPU]; math.Abs(f-1.375) > 1e-6 || re.cpuSeen != 2 {
		t.Errorf("after a second phase 1.5 times slower: the CPU's factor %v, want 1.375 (halfway); %d phases", f, re.cpuSeen)
	}
	for _, r := range []perfmodel.Resource{perfmodel.ResH2D, perfmodel.ResD2H, perfmodel.ResGPU} {
		if re.f[r] != 0 {
			t.Errorf("%v's factor %v, want it untouched", r, re.f[r])
		}
	}
	for _, bad := range [][2]int64{{0, 0}, {4, 0}, {4, 5}, {1e9, 1}} { // the last: too little left to tell
		re.observeCPU(b, bad[0], bad[1])
	}
	if re.cpuSeen != 2 {
		t.Errorf("%d phases folded after bad counts, want 2", re.cpuSeen)
	}
}

// TestReplanStepAsyncBeside: Replan folds the GPU's rate from a StepAsync
// phase as from Step's, unless the caller says it ran GPU work of its own
// beside it (StepArgs.Beside: a trainer's next forward).
func TestReplanStepAsyncBeside(t *testing.T) {
	fit := func(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate, LatencyS: 1e-6} }
	var f [3]float64
	for mode := range f {
		sim := scheduler.NewSim(scheduler.SimOptions{Profile: &perfmodel.GPUProfile{H2D: fit(1e7), D2H: fit(1e7), Update: fit(5e8), Convert: fit(4e11)}})
		opts := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2, MaxGradNorm: 1,
			Device: sim, Profile: truthProfile(), GPUBudget: 2 * 12 * 300, Replan: true}
		o := newWith(t, testParams, opts)
		fillGrads(o, 0)
		if _, err := o.Step(StepArgs{}); err != nil { // loads the device
			t.Fatal(err)
		}
		for step := range 8 {
			fillGrads(o, step)
			var err error
			if mode == 0 {
				_, err = o.Step(StepArgs{GradOnDevice: true})
			} else if _, err = o.StepAsync(StepArgs{GradOnDevice: true, Beside: mode == 2}); err == nil {
				_, err = o.WaitStep()
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		f[mode] = o.re.f[perfmodel.ResGPU]
		if err := o.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if !(f[0] > 0) || !(f[1] > 0) || f[2] != 0 {
		t.Errorf("the GPU's factor: %v after Step, %v after StepAsync alone, %v beside the caller's work: want the first two folded, the last 0", f[0], f[1], f[2])
	}
}
