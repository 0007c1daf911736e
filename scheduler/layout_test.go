package scheduler

import (
	"fmt"
	"slices"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestResidentFirstPlan: NewPlanIn's ResidentFirst puts the R resident
// subgroups first, the GPU lane starting with their kernels, and the
// stride of NewPlan over the others (the same roles, shifted); an unknown
// layout is refused.
func TestResidentFirstPlan(t *testing.T) {
	s := perfmodel.Schedule{CPU: 5, GPU: 2, Resident: 3}
	p, err := NewPlanIn(10, s, ResidentFirst)
	if err != nil {
		t.Fatal(err)
	}
	last, _ := NewPlan(10, s)
	for j := range 7 { // the non-resident ones: last's first 7, shifted by 3
		if p.Roles[3+j] != last.Roles[j] {
			t.Errorf("subgroup %d: %v, want %v (NewPlan's subgroup %d)", 3+j, p.Roles[3+j], last.Roles[j], j)
		}
	}
	if !slices.Equal(p.Roles[:3], []Role{Resident, Resident, Resident}) {
		t.Errorf("roles %v: want the first 3 resident", p.Roles)
	}
	var streamed []int
	for _, i := range p.GPUOrder[3:] {
		streamed = append(streamed, i)
	}
	if !slices.Equal(p.GPUOrder[:3], []int{0, 1, 2}) || len(p.GPUOrder) != 5 || len(p.CPUOrder) != 5 || !slices.IsSorted(streamed) || !slices.IsSorted(p.CPUOrder) {
		t.Errorf("GPU lane %v, CPU lane %v", p.GPUOrder, p.CPUOrder)
	}
	if _, err := NewPlanIn(10, s, Layout(7)); err == nil {
		t.Error("layout 7: no error")
	}
}

// TestEngineResidentFirst: with the resident subgroups first, every
// pattern of host-held subgroups and schedule of the others gives the
// flat update's state and working copy bitwise over four steps, clipped
// or not, with a skipped step (TestEngineHostHeld's cases).
func TestEngineResidentFirst(t *testing.T) { forDevices(t, testEngineResidentFirst) }

func testEngineResidentFirst(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	for pi, held := range heldPatterns {
		inf := []int{-1, 5, 70000, 40001, 95600, 200000}[pi]
		p := heldProblem(adam.BF16, 4, uint64(60+pi), inf)
		for _, maxNorm := range []float64{0, 1} {
			want, wantCopy := heldReference(p, h, 4, maxNorm)
			for _, s := range heldSchedules(len(heldSizes) - countHeld(held)) {
				t.Run(fmt.Sprintf("held%d/clip=%g/%+v", pi, maxNorm, s), func(t *testing.T) {
					d := newDev()
					hh := held
					if hh == nil {
						hh = make([]bool, len(heldSizes))
					}
					plan, err := NewHeldPlanIn(hh, s, ResidentFirst)
					if err != nil {
						t.Fatal(err)
					}
					e, err := New(Options{Device: d, Sizes: heldSizes, GradDType: p.gd, WorkingDType: adam.BF16, Plan: plan, HostHeld: hh})
					if err != nil {
						t.Fatal(err)
					}
					defer e.Close()
					loadProblem(t, e, p)
					runHeld(t, d, e, p, h, 4, maxNorm)
					checkHeldRun(t, d, e, want, wantCopy)
					if sim, ok := d.(*Sim); ok {
						if err := sim.OrderErr(); err != nil {
							t.Fatal(err)
						}
					}
				})
			}
		}
	}
}
