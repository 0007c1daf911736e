package offload

import (
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

func r2fit(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate, LatencyS: 1e-6} }

// r2slowCopies: TestReplanExact's device (copies 1e5 B/s): 3/3/0 -> 4/0/2
// at step 3 with truthProfile and a budget of 2*12*300.
func r2slowCopies() *scheduler.Sim {
	return scheduler.NewSim(scheduler.SimOptions{Profile: &perfmodel.GPUProfile{H2D: r2fit(1e5), D2H: r2fit(1e5), Update: r2fit(5e10), Convert: r2fit(4e11)}})
}

// r2slowKernel: the fused update slow; with a profile that thinks PCIe
// slow, the optimizer starts all resident (0/0/6) and re-plans to 6/0/0
// at step 3.
func r2slowKernel() *scheduler.Sim {
	return scheduler.NewSim(scheduler.SimOptions{Profile: &perfmodel.GPUProfile{H2D: r2fit(1e10), D2H: r2fit(1e10), Update: r2fit(1e3), Convert: r2fit(4e11)}})
}

type r2case struct {
	name   string
	newSim func() *scheduler.Sim
	prof   func() *perfmodel.Profile
	budget int64
}

func r2cases() []r2case {
	return []r2case{
		{"stream-to-resident", r2slowCopies, truthProfile, 2 * 12 * 300},
		{"resident-to-cpu", r2slowKernel, func() *perfmodel.Profile {
			return truthProfile().Scaled(map[perfmodel.Resource]float64{perfmodel.ResH2D: 1e3, perfmodel.ResD2H: 1e3})
		}, 6 * 12 * 300},
	}
}

func (c r2case) opts(base Options) (host, dev Options, sim *scheduler.Sim) {
	sim = c.newSim()
	dev = base
	dev.Device, dev.Profile, dev.GPUBudget, dev.Replan = sim, c.prof(), c.budget, true
	if base.Hyper.AMSGrad {
		dev.GPUBudget = c.budget * 16 / 12
	}
	return base, dev, sim
}

func r2base() Options {
	return Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2, MaxGradNorm: 1}
}

func r2step(t *testing.T, step int64, os ...*Optimizer) []StepResult {
	t.Helper()
	var rs []StepResult
	for _, o := range os {
		fill(o, step)
		r, err := o.Step(StepArgs{})
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		rs = append(rs, r)
	}
	return rs
}

// TestReplanStepNoAllocs: with Replan on, a Step that cannot refit
// (replanEvery gates it) allocates nothing (the workload is built once).
func TestReplanStepNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are checked without -race")
	}
	c := r2cases()[0]
	_, dopts, _ := c.opts(r2base())
	o := newWith(t, testParams, dopts)
	for s := int64(1); s <= 4; s++ {
		r2step(t, s, o) // re-planned at step 3
	}
	// Right after a refit (last = 3): steps 5 and 6 cannot refit.
	o.re.last = o.step
	a := testing.AllocsPerRun(1, func() {
		if _, err := o.Step(StepArgs{}); err != nil {
			t.Fatal(err)
		}
	})
	if a != 0 {
		t.Errorf("Step with Replan (no refit possible: %d steps since the last) allocates %v times", o.step-o.re.last, a)
	}
}

// TestReplanPlanRace: Plan read from another goroutine while Steps
// re-plan (Step writes o.plan under o.mu, Plan reads under it): clean
// under -race.
func TestReplanPlanRace(t *testing.T) {
	c := r2cases()[0]
	_, dopts, _ := c.opts(r2base())
	o := newWith(t, testParams, dopts)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
				_, _ = o.Plan()
			}
		}
	}()
	for s := int64(1); s <= 12; s++ {
		r2step(t, s, o)
	}
	close(stop)
	wg.Wait()
}

// TestReplanThenFaultReload: after a re-plan, a device fault and the
// LoadCheckpoint that rebuilds the engine on the profile's first choice
// start Replan's state over from that choice (its factors would otherwise
// divide one schedule's measured busy times by another's predictions),
// and the state stays exact.
func TestReplanThenFaultReload(t *testing.T) {
	c := r2cases()[0]
	hopts, dopts, d := c.opts(r2base())
	ref := newWith(t, testParams, hopts)
	o := newWith(t, testParams, dopts)
	first, _ := o.Schedule()
	replanned := false
	for s := int64(1); s <= 4; s++ {
		rs := r2step(t, s, ref, o)
		replanned = replanned || rs[1].Replanned
	}
	if !replanned {
		t.Fatal("no re-plan")
	}
	root := t.TempDir()
	if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
		t.Fatal(err)
	}
	broke := false
	for k := 1; k <= 200 && !broke; k++ {
		fill(o, 5)
		d.FailSync(k)
		_, err := o.Step(StepArgs{})
		d.FailSync(0)
		broke = errors.Is(err, scheduler.ErrBroken)
		if !broke {
			// undo: reload the good state
			if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
				t.Fatal(err)
			}
		}
	}
	if !broke {
		t.Fatal("no k broke the engine")
	}
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	now, _ := o.Schedule()
	plan, _ := o.Plan()
	t.Logf("first %+v; after the fault and load: engine %+v, Plan %+v, replanState.basePred %+v", first, now, plan.Schedule, o.re.basePred.Schedule)
	if o.re.basePred.Schedule != now {
		t.Errorf("replanState.basePred is for %+v, the engine runs %+v: the next refits' factors compare different schedules", o.re.basePred.Schedule, now)
	}
	// State stays exact anyway.
	for s := int64(5); s <= 10; s++ {
		r2step(t, s, ref, o)
	}
	sameState(t, synced(t, ref), synced(t, o))
	t.Logf("factors after: %v", o.re.f)
}

// TestReplanErrorKeepsWorking: when the re-plan of a taken step fails
// without breaking the engine (a D2H of the resident state that cannot be
// enqueued, in Engine.Replan's Download), Step has already fetched this
// step's working copy (or marked it stale): Working never returns the
// previous step's copy as current.
func TestReplanErrorKeepsWorking(t *testing.T) {
	c := r2cases()[1]
	for k := 1; k <= 80; k++ {
		hopts, dopts, d := c.opts(r2base())
		ref := newWith(t, testParams, hopts)
		o := newWith(t, testParams, dopts)
		r2step(t, 1, ref, o)
		r2step(t, 2, ref, o)
		fill(ref, 3)
		fill(o, 3)
		if _, err := ref.Step(StepArgs{}); err != nil {
			t.Fatal(err)
		}
		before, _ := o.Schedule()
		d.FailAfter(k)
		_, err := o.Step(StepArgs{})
		d.FailAfter(0)
		after, _ := o.Schedule()
		if err == nil || o.StepCount() != 3 || o.dev == devBroken || after != before || isFault(err) {
			continue
		}
		t.Logf("k=%d: %v (step taken, engine not broken, schedule %+v kept)", k, err, after)
		if !o.workStale.Load() && !slices.Equal(o.work.Data, ref.work.Data) {
			t.Errorf("step 3 taken with an error, the host working copy is step 2's, and workStale is false: Working returns it as current")
		}
		return
	}
	t.Skip("no k made the re-plan's Download fail alone")
}

// TestReplanAfterReloadEarlier: after LoadCheckpoint of an earlier step
// (same optimizer), refits resume from the loaded step (replanState.last
// follows it) instead of waiting for the old step counter, and the state
// stays exact.
func TestReplanAfterReloadEarlier(t *testing.T) {
	for _, c := range r2cases() {
		testReplanSkippedAndReload(t, c)
	}
}

func testReplanSkippedAndReload(t *testing.T, c r2case) {
	hopts, dopts, _ := c.opts(r2base())
	ref := newWith(t, testParams, hopts)
	o := newWith(t, testParams, dopts)
	r2step(t, 1, ref, o)
	root := t.TempDir()
	if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ref.SaveCheckpoint(checkpoint.OS, t.TempDir(), nil); err != nil {
		t.Fatal(err)
	}
	// A skipped step.
	fill(o, 2)
	o.Grad(0).Uint16()[0] = 0x7fc0 // NaN
	r, err := o.Step(StepArgs{})
	if err != nil || !r.Skipped || r.Replanned || r.Measured != 0 {
		t.Fatalf("skipped step: %+v %v", r, err)
	}
	for s := int64(2); s <= 30; s++ {
		r2step(t, s, ref, o)
	}
	last := o.re.last
	sched, _ := o.Schedule()
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	ref2 := newWith(t, testParams, hopts)
	r2step(t, 1, ref2)
	for s := int64(2); s <= 6; s++ {
		r2step(t, s, ref2, o)
	}
	sameState(t, synced(t, ref2), synced(t, o))
	t.Logf("re.last %d before the load (schedule %+v); step now %d; re.last now %d", last, sched, o.step, o.re.last)
	if o.re.last > o.step {
		t.Errorf("after loading step 1, no refit can re-plan until step %d", o.re.last+replanEvery)
	}
}
