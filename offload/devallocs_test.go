package offload

import (
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestStepDeviceNoAllocs: Step through the engine, on the simulated device
// with CPU, streamed and resident subgroups, allocates nothing either.
func TestStepDeviceNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are checked without -race (make test runs them)")
	}
	opts, _ := deviceOpts(Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, MaxGradNorm: 1, Threads: 2},
		perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2})
	o := newTest(t, opts)
	fill(o, 1)
	o.Step(StepArgs{LossScale: 2}) // the first Step loads the state onto the device
	if a := testing.AllocsPerRun(10, func() { o.Step(StepArgs{LossScale: 2}) }); a != 0 {
		t.Fatalf("Step on the device allocates %v times", a)
	}
}

// TestStepGradOnDeviceNoAllocs: Step with GradOnDevice (no gradient H2D,
// no working copy D2H) allocates nothing either.
func TestStepGradOnDeviceNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are checked without -race (make test runs them)")
	}
	opts, _ := deviceOpts(Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, MaxGradNorm: 1, Threads: 2},
		perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2})
	o := newTest(t, opts)
	fill(o, 1)
	o.Step(StepArgs{LossScale: 2}) // the first Step loads the state onto the device and its gradients
	if a := testing.AllocsPerRun(10, func() { o.Step(StepArgs{LossScale: 2, GradOnDevice: true}) }); a != 0 {
		t.Fatalf("Step with GradOnDevice allocates %v times", a)
	}
	if o.StepCount() != 12 {
		t.Fatalf("step %d: the steps were not taken", o.StepCount())
	}
}

// TestGradsFinalNoAllocs: with OverlapBackward, a trainer's GradsFinal for
// every parameter, from the last, and the Step that takes what they
// started allocate nothing either.
func TestGradsFinalNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are checked without -race (make test runs them)")
	}
	opts, sim := deviceOpts(Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, MaxGradNorm: 1, Threads: 2},
		perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2})
	opts.OverlapBackward = true
	o := newTest(t, opts)
	s, err := sim.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	fill(o, 1)
	o.Step(StepArgs{LossScale: 2}) // the first Step loads the state onto the device and its gradients
	params := make([][]int, len(o.Params()))
	for i := range params {
		params[i] = []int{len(params) - 1 - i}
	}
	if a := testing.AllocsPerRun(10, func() {
		for _, p := range params {
			if err := o.GradsFinal(s, p...); err != nil {
				t.Fatal(err)
			}
		}
		o.Step(StepArgs{LossScale: 2, GradOnDevice: true})
	}); a != 0 {
		t.Fatalf("GradsFinal and Step allocate %v times", a)
	}
}

// TestSpeculateNoAllocs: with Options.Speculate (no clipping, so that every
// step keeps what the CPU subgroups' speculation did), GradsFinal for every
// parameter and the Step allocate nothing either.
func TestSpeculateNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are checked without -race (make test runs them)")
	}
	opts, sim := deviceOpts(Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, Threads: 2},
		perfmodel.Schedule{CPU: 4, GPU: 1, Resident: 1})
	opts.OverlapBackward, opts.Speculate = true, 1<<20
	o := newTest(t, opts)
	s, err := sim.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	fill(o, 1)
	o.Step(StepArgs{}) // the first Step loads the state onto the device and its gradients
	params := make([][]int, len(o.Params()))
	for i := range params {
		params[i] = []int{len(params) - 1 - i}
	}
	var kept int64
	if a := testing.AllocsPerRun(10, func() {
		for _, p := range params {
			if err := o.GradsFinal(s, p...); err != nil {
				t.Fatal(err)
			}
		}
		o.eng.WaitSpeculation()
		res, err := o.Step(StepArgs{GradOnDevice: true})
		if err != nil {
			t.Fatal(err)
		}
		kept += res.Speculated
	}); a != 0 {
		t.Fatalf("GradsFinal and Step with Speculate allocate %v times", a)
	}
	if kept == 0 {
		t.Fatal("no step kept a speculative update: the test proves nothing")
	}
}

// TestWaitParamsNoAllocs: while a StepAsync phase runs (a Hold gate keeps
// the last subgroup's update back), WaitParams and ParamsReady over the
// first parameter's subgroups allocate nothing: the trainer calls them for
// every block of its forward.
func TestWaitParamsNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are checked without -race (make test runs them)")
	}
	opts, _ := deviceOpts(Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, MaxGradNorm: 1, Threads: 2},
		perfmodel.Schedule{CPU: 6})
	o := newTest(t, opts)
	fill(o, 1)
	o.Step(StepArgs{}) // the first Step loads the state onto the device and its gradients
	last := len(o.Subgroups()) - 1
	release := make(chan struct{})
	o.eng.Hold(func(i int) {
		if i == last {
			<-release
		}
	})
	if _, err := o.StepAsync(StepArgs{GradOnDevice: true}); err != nil {
		t.Fatal(err)
	}
	a := testing.AllocsPerRun(10, func() {
		if err := o.WaitParams(nil, 0, 1); err != nil || !o.ParamsReady(0, 1) {
			t.Errorf("WaitParams: %v; ParamsReady false", err)
		}
	})
	ready := o.ParamsReady(len(o.Params())-1, len(o.Params()))
	close(release)
	if _, err := o.WaitStep(); err != nil {
		t.Fatal(err)
	}
	if ready {
		t.Error("ParamsReady of the last parameter true while its subgroup's update is held back")
	}
	if a != 0 {
		t.Fatalf("WaitParams and ParamsReady allocate %v times during a phase", a)
	}
}
