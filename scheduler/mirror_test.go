package scheduler

import (
	"errors"
	"fmt"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// rvMirrors returns Options.Mirror layouts that stress the cut at the
// subgroups: every other whole subgroup, one element in 97, and adjacent
// spans on each subgroup boundary.
func rvMirrors(sizes []int) map[string][]Span {
	total := int64(0)
	offs := []int64{}
	for _, n := range sizes {
		offs = append(offs, total)
		total += int64(n)
	}
	var subs, ones []Span
	for i, n := range sizes {
		if i%2 == 0 {
			subs = append(subs, Span{Off: offs[i], N: int64(n)})
		}
	}
	for x := int64(0); x < total; x += 97 {
		ones = append(ones, Span{Off: x, N: 1})
	}
	// Boundaries: the last element of a subgroup and the first of the next,
	// adjacent spans.
	var edges []Span
	for i := 1; i < len(sizes); i++ {
		edges = append(edges, Span{Off: offs[i] - 1, N: 1}, Span{Off: offs[i], N: 1})
	}
	return map[string][]Span{"all": {{Off: 0, N: total}}, "subgroups": subs, "ones": ones, "edges": edges}
}

// TestMirrorShapes: mirrors of whole subgroups, single elements and spans
// on every subgroup boundary stay bitwise equal to the master weights
// through updates on every schedule and a Replan.
func TestMirrorShapes(t *testing.T) {
	n := testTotal()
	h := adam.DefaultHyper()
	p := newProblem(n, adam.BF16, false, 3, 21)
	want, wantCopy := p.reference(h, adam.BF16, 3)
	for name, m := range rvMirrors(testSizes) {
		for _, s := range schedules(len(testSizes)) {
			t.Run(fmt.Sprintf("%s/%+v", name, s), func(t *testing.T) {
				d := NewSim(SimOptions{})
				e := setupWith(t, d, p, testSizes, s, false, m)
				defer e.Close()
				checkMirror(t, d, e, p.state.Param)
				for step := range 3 {
					if step == 1 {
						// Another plan between the steps.
						plan, _ := NewPlan(len(testSizes), perfmodel.Schedule{CPU: 3, GPU: 3, Resident: 2})
						if err := e.Replan(plan); err != nil {
							t.Fatal(err)
						}
					}
					put(t, d, e.grad, 0, p.gradBytes(step))
					c := h.Coeffs(int64(step+1), 1, 1)
					if err := e.Update(&c); err != nil {
						t.Fatal(err)
					}
				}
				check(t, d, e, want, wantCopy)
				if err := d.OrderErr(); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

// TestMirrorShapesFaults: with those mirrors, every injected copy or
// launch fault of an update leaves the mirror equal to the master weights.
func TestMirrorShapesFaults(t *testing.T) {
	n := testTotal()
	h := adam.DefaultHyper()
	p := newProblem(n, adam.BF16, false, 1, 22)
	want, wantCopy := p.reference(h, adam.BF16, 1)
	c := h.Coeffs(1, 1, 1)
	for name, m := range rvMirrors(testSizes) {
		for _, s := range schedules(len(testSizes)) {
			d := NewSim(SimOptions{})
			e := setupWith(t, d, p, testSizes, s, false, m)
			put(t, d, e.grad, 0, p.gradBytes(0))
			before := d.Ops()
			if err := e.Update(&c); err != nil {
				t.Fatal(err)
			}
			ops := d.Ops() - before
			e.Close()
			for i := 1; i <= ops; i++ {
				d := NewSim(SimOptions{})
				e := setupWith(t, d, p, testSizes, s, false, m)
				put(t, d, e.grad, 0, p.gradBytes(0))
				d.FailAfter(i)
				err := e.Update(&c)
				var fe *FaultError
				if !errors.As(err, &fe) || !errors.Is(err, ErrInjected) {
					t.Fatalf("%s/%+v/op %d: %v", name, s, i, err)
				}
				check(t, d, e, want, wantCopy)
				if err := d.OrderErr(); err != nil {
					t.Fatalf("%s/%+v/op %d: %v", name, s, i, err)
				}
				e.Close()
			}
		}
	}
}
