package offload

import (
	"errors"
	"testing"

	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// iterProfile is a machine whose CPU workers and fused kernels update at
// the same rate, 1e8 parameters/s, over a fast PCIe: the phase alone is
// shortest split between them, but with a long backward to hide the CPU's
// speculative updates the iteration is shortest with every subgroup on the
// CPU.
func iterProfile() *perfmodel.Profile { return flatProfile(2, 1e8, 1e8, 1e12, 1e12) }

// TestPlanIteration: PlanIteration moves the engine from the phase's best
// schedule to the iteration's (perfmodel.Profile.ChooseIteration) when the
// speculation hides the CPU's work in a long backward, once a step has
// kept speculative updates (after a clipped one, none: no move); the steps
// after it keep the serial step's bits (speculation kept, and some left to
// the phase), a second call finds nothing better, a short backward
// (nothing to hide) keeps the phase's plan and later moves back to it
// (the steps after that keep the bits too), a forced schedule keeps the
// plan, and a closed optimizer says ErrClosed.
func TestPlanIteration(t *testing.T) {
	base := specBase()
	base.Profile, base.GPUBudget = iterProfile(), 1<<20
	r := newRig(t, testParams, base, nil, perfmodel.Schedule{}, scheduler.SpeculateBytes(1<<20, false))
	r.b.specPaused = false
	start, _ := r.b.Schedule()
	long := IterationWork{Forward: 1e-5, Backward: 1e-4, Blocks: 1, OverlapForward: true}
	short := long
	short.Backward = 0
	step := func(k int64, scale float32) StepResult {
		t.Helper()
		r.backward(t, k, scale, false, true)
		rr, err := r.ref.Step(StepArgs{})
		if err != nil {
			t.Fatal(err)
		}
		rb, err := r.b.Step(StepArgs{GradOnDevice: true})
		if err != nil {
			t.Fatal(err)
		}
		if rr.ClipCoef != rb.ClipCoef || rr.GradNorm != rb.GradNorm {
			t.Fatalf("step %d: clip %v norm %v, the reference's %v %v", k, rb.ClipCoef, rb.GradNorm, rr.ClipCoef, rr.GradNorm)
		}
		sameState(t, synced(t, r.ref), synced(t, r.b.workingNow(t)))
		return rb
	}
	// A step that clips keeps no speculation: none is predicted, and the
	// phase's schedule stays (a run whose every step clips is not moved).
	if res := step(1, 1); res.Speculated != 0 {
		t.Fatalf("a clipped step kept %d speculated parameters", res.Speculated)
	}
	if moved, err := r.b.PlanIteration(long); err != nil || moved {
		t.Fatalf("no speculation kept yet: moved %v, %v; want the phase's schedule %+v kept", moved, err, start)
	}
	r.b.specPaused = false
	if res := step(2, 0.01); res.Speculated == 0 {
		t.Fatal("no speculation kept")
	}
	if moved, err := r.b.PlanIteration(short); err != nil || moved {
		t.Fatalf("a backward too short to hide anything: moved %v, %v; want the phase's schedule %+v kept", moved, err, start)
	}
	before, ok := r.b.PredictIteration(long)
	if !ok {
		t.Fatal("no prediction")
	}
	moved, err := r.b.PlanIteration(long)
	if err != nil || !moved {
		t.Fatalf("PlanIteration: moved %v, %v; want a move from %+v", moved, err, start)
	}
	now, _ := r.b.Schedule()
	after, _ := r.b.PredictIteration(long)
	plan, _ := r.b.Plan()
	if now == start || now.CPU <= start.CPU || plan.Schedule != now || !(after.Seconds < 0.95*before.Seconds) || after.Speculated == 0 {
		t.Fatalf("schedule %+v -> %+v (plan %+v), iteration %.6f -> %.6f s (speculated %.6f s): want more CPU subgroups and a shorter iteration",
			start, now, plan.Schedule, before.Seconds, after.Seconds, after.Speculated)
	}
	t.Logf("schedule %+v -> %+v, the iteration predicted %.1f -> %.1f µs", start, now, 1e6*before.Seconds, 1e6*after.Seconds)
	if moved, err := r.b.PlanIteration(long); err != nil || moved {
		t.Fatalf("again: moved %v, %v; want nothing", moved, err)
	}
	kept := int64(0)
	for k := int64(3); k <= 6; k++ {
		kept += step(k, 0.01).Speculated
	}
	if kept == 0 {
		t.Error("no speculative update kept after the move")
	}
	// What the speculation leaves to the phase (every other CPU
	// subgroup from the last up) changes no bit (step compares), and the
	// last one is still speculated on.
	r.b.eng.SetSpeculateLeave(1 << 40)
	for k := int64(7); k <= 9; k++ {
		if res := step(k, 0.01); res.Speculated == 0 {
			t.Errorf("step %d, every other CPU subgroup left to the phase: nothing kept", k)
		}
	}
	// Back to the phase's schedule after steps that kept speculative
	// updates with a leave (subgroups leave the CPU for the device, their
	// state moved from the slots): the steps after it keep the serial
	// step's bits too (the seventh session's 4.24B run that moved so at
	// iteration 6 printed another loss at iteration 7, unexplained).
	more, _ := r.b.Schedule()
	if moved, err := r.b.PlanIteration(short); err != nil || !moved {
		t.Fatalf("a backward too short to hide anything after the move: moved %v, %v; want a move back from %+v", moved, err, more)
	}
	if back, _ := r.b.Schedule(); back.CPU >= more.CPU {
		t.Fatalf("moved back to %+v from %+v: want fewer CPU subgroups", back, more)
	}
	for k := int64(10); k <= 12; k++ {
		step(k, 0.01)
	}
	if err := r.sim.OrderErr(); err != nil {
		t.Fatal(err)
	}

	forced := newRig(t, testParams, base, nil, start, scheduler.SpeculateBytes(1<<20, false))
	if moved, err := forced.b.PlanIteration(long); err != nil || moved {
		t.Errorf("a forced schedule: moved %v, %v; want it kept", moved, err)
	}
	if err := forced.b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := forced.b.PlanIteration(long); !errors.Is(err, ErrClosed) {
		t.Errorf("closed: %v, want ErrClosed", err)
	}
}

// TestSpeculateLeaveOption: PlanIteration sets what the speculation
// leaves to the phase only with Options.SpeculateLeave and a forward that
// overlaps the phase, once a step kept speculative updates: more than
// none, at most half of what that step kept; the steps after it keep the
// serial step's bits.
func TestSpeculateLeaveOption(t *testing.T) {
	for _, on := range []bool{false, true} {
		base := specBase()
		base.Profile, base.GPUBudget, base.SpeculateLeave = iterProfile(), 1<<20, on
		r := newRig(t, testParams, base, nil, perfmodel.Schedule{}, scheduler.SpeculateBytes(1<<20, false))
		r.b.specPaused = false
		step := func(k int64) StepResult {
			t.Helper()
			r.backward(t, k, 0.01, false, true)
			if _, err := r.ref.Step(StepArgs{}); err != nil {
				t.Fatal(err)
			}
			rb, err := r.b.Step(StepArgs{GradOnDevice: true})
			if err != nil {
				t.Fatal(err)
			}
			sameState(t, synced(t, r.ref), synced(t, r.b.workingNow(t)))
			return rb
		}
		kept := step(1).Speculated
		if kept == 0 {
			t.Fatal("no speculation kept")
		}
		work := IterationWork{Forward: 1, Backward: 1e-4, Blocks: 1}
		if _, err := r.b.PlanIteration(work); err != nil || r.b.SpeculateLeave() != 0 {
			t.Fatalf("SpeculateLeave %v, a forward that does not overlap the phase: leave %d, %v", on, r.b.SpeculateLeave(), err)
		}
		work.OverlapForward = true
		if _, err := r.b.PlanIteration(work); err != nil {
			t.Fatal(err)
		}
		leave := r.b.SpeculateLeave()
		if on != (leave > 0) || leave > kept/2 {
			t.Fatalf("SpeculateLeave %v: leave %d parameters, the step kept %d", on, leave, kept)
		}
		for k := int64(2); k <= 4; k++ {
			step(k)
		}
		if err := r.b.Close(); err != nil {
			t.Fatal(err)
		}
	}
}
