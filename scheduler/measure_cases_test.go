package scheduler

import (
	"errors"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestMeasureNoDrift: on the simulated device, the same update phase
// repeated (with a GetWorking between, as offload's Step does) measures
// the same makespan each time (the device's virtual clocks start no
// earlier than what the host waited for).
func TestMeasureNoDrift(t *testing.T) {
	n := testTotal()
	p := newProblem(n, adam.BF16, false, 1, 9)
	fit := func(rate float64) perfmodel.Fit { return perfmodel.Fit{Rate: rate, LatencyS: 1e-6} }
	d := NewSim(SimOptions{Profile: &perfmodel.GPUProfile{H2D: fit(1e6), D2H: fit(1e6), Update: fit(1e9), Convert: fit(1e10)}})
	e := setup(t, d, p, testSizes, perfmodel.Schedule{CPU: 6, Resident: 2}, false)
	defer e.Close()
	c := adam.DefaultHyper().Coeffs(1, 1, 1)
	work := make([]uint16, n)
	g := adam.Grad16(adam.BF16, make([]uint16, n))
	var ms []Busy
	for k := 0; k < 4; k++ {
		if err := e.SetGrad(g); err != nil {
			t.Fatal(err)
		}
		if err := e.Update(&c); err != nil {
			t.Fatal(err)
		}
		b, err := e.Measure()
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, b)
		if err := e.GetWorking(work); err != nil {
			t.Fatal(err)
		}
	}
	for k, b := range ms {
		t.Logf("phase %d: %+v", k, b)
	}
	if ms[3].Makespan > ms[0].Makespan*11/10 {
		t.Errorf("the same phase measured %v then %v", ms[0].Makespan, ms[3].Makespan)
	}
}

// TestMeasureAfterReplan: between Replan and the next Update there is no
// phase of the new plan to read: Measure and Trace say so (ErrNoPhase).
func TestMeasureAfterReplan(t *testing.T) {
	e := onePhase(t, NewSim(SimOptions{}))
	before, _ := e.Measure()
	plan, _ := NewPlan(len(testSizes), perfmodel.Schedule{Resident: 8})
	if err := e.Replan(plan); err != nil {
		t.Fatal(err)
	}
	if before.H2D <= 0 {
		t.Errorf("Measure before Replan: %+v", before)
	}
	if _, err := e.Measure(); !errors.Is(err, ErrNoPhase) {
		t.Errorf("Measure after Replan: %v, want ErrNoPhase", err)
	}
	if _, err := e.Trace(); !errors.Is(err, ErrNoPhase) {
		t.Errorf("Trace after Replan: %v, want ErrNoPhase", err)
	}
}
