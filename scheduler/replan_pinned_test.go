package scheduler

import (
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// pinCount is a Device that counts pinned host allocations and frees.
type pinCount struct {
	Device
	allocs, frees int
}

func (c *pinCount) AllocHost(n int64) (Host, error) { c.allocs++; return c.Device.AllocHost(n) }
func (c *pinCount) FreeHost(h Host) error           { c.frees++; return c.Device.FreeHost(h) }

// TestReplanKeepsPinned: Replan gives the new plan the old plan's pinned
// host buffers (staging slots, prefetch memory) where they are large
// enough, so a re-plan that needs no more pins nothing, and one that needs
// a larger prefetch buffer pins that one alone and frees what it replaced;
// the updates in between, their gradients prefetched into the reused
// memory, give the reference's state bitwise, and Close frees every
// buffer.
func TestReplanKeepsPinned(t *testing.T) {
	h := adam.DefaultHyper()
	n := testTotal()
	p := newProblem(n, adam.BF16, false, 3, 7)
	want, wantCopy := p.reference(h, adam.BF16, 3)
	d := &pinCount{Device: NewSim(SimOptions{})}
	plans := []perfmodel.Schedule{{CPU: 5, GPU: 1, Resident: 2}, {CPU: 3, GPU: 3, Resident: 2}, {CPU: 7, Resident: 1}}
	e := setupPrefetch(t, d, p, plans[0])
	defer e.Close()
	bwd, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer d.FreeStream(bwd)
	live := d.allocs - d.frees
	gpre := int64(len(e.gpre.Bytes()))
	for step, s := range plans {
		if step > 0 {
			plan, err := NewPlan(len(testSizes), s)
			if err != nil {
				t.Fatal(err)
			}
			before := d.allocs
			if err := e.Replan(plan); err != nil {
				t.Fatal(err)
			}
			need := int64(len(e.gpre.Bytes()))
			wantNew := 0
			if need > gpre {
				wantNew = 1 // the prefetch memory grew; staging fits
			}
			if got := d.allocs - before; got != wantNew {
				t.Errorf("Replan to %+v: %d new pinned buffers, want %d (prefetch %d B, had %d)", s, got, wantNew, need, gpre)
			}
			if l := d.allocs - d.frees; l != live {
				t.Errorf("Replan to %+v: %d pinned buffers live, %d before", s, l, live)
			}
			gpre = max(gpre, need)
		}
		put(t, d, e.grad, 0, p.gradBytes(step))
		if err := e.Prefetch(bwd, 0); err != nil {
			t.Fatal(err)
		}
		c := h.Coeffs(int64(step+1), 1, 1)
		if err := e.Update(&c); err != nil {
			t.Fatal(err)
		}
	}
	if gpre <= 0 {
		t.Fatal("no prefetch memory: the test does not exercise it")
	}
	check(t, d, e, want, wantCopy)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if d.allocs != d.frees {
		t.Errorf("after Close: %d pinned allocations, %d frees", d.allocs, d.frees)
	}
}
