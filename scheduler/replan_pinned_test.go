package scheduler

import (
	"errors"
	"strings"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// pinCount is a Device that counts pinned host allocations, frees and
// bytes, and the most bytes pinned at once.
type pinCount struct {
	Device
	allocs, frees int
	bytes, peak   int64
}

func (c *pinCount) AllocHost(n int64) (Host, error) {
	c.allocs++
	c.bytes += n
	c.peak = max(c.peak, c.bytes)
	return c.Device.AllocHost(n)
}

func (c *pinCount) FreeHost(h Host) error {
	c.frees++
	c.bytes -= int64(len(h.Bytes()))
	return c.Device.FreeHost(h)
}

// TestReplanKeepsPinned: Replan gives the new plan the old plan's pinned
// host buffers (staging slots, prefetch memory) where they are large
// enough, so a re-plan that needs no more pins nothing, and one that needs
// a larger prefetch buffer frees the old one, then pins the new one alone
// (never both at once);
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
			before, bytesBefore := d.allocs, d.bytes
			d.peak = d.bytes
			if err := e.Replan(plan); err != nil {
				t.Fatal(err)
			}
			need := int64(len(e.gpre.Bytes()))
			wantNew := 0
			if need > gpre || 2*need < gpre {
				wantNew = 1 // the prefetch memory grew (or shrank below half); staging fits
			}
			if got := d.allocs - before; got != wantNew {
				t.Errorf("Replan to %+v: %d new pinned buffers, want %d (prefetch %d B, had %d)", s, got, wantNew, need, gpre)
			}
			if l := d.allocs - d.frees; l != live {
				t.Errorf("Replan to %+v: %d pinned buffers live, %d before", s, l, live)
			}
			if d.peak > max(bytesBefore, d.bytes) {
				t.Errorf("Replan to %+v: %d bytes pinned at once, %d before and %d after: a buffer pinned beside the one it replaces", s, d.peak, bytesBefore, d.bytes)
			}
			gpre = need
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

// failFree is a Device whose FreeHost fails while fail is set.
type failFree struct {
	Device
	fail bool
}

func (f *failFree) FreeHost(h Host) error {
	if f.fail {
		return errors.New("cuMemHostUnregister: injected")
	}
	return f.Device.FreeHost(h)
}

// TestReplanFreeFails: when the old plan's pinned buffer that the new plan
// does not take cannot be freed, Replan still succeeds (the engine runs
// the new plan, the update gives the reference's bits) and Close returns
// the failure.
func TestReplanFreeFails(t *testing.T) {
	h := adam.DefaultHyper()
	p := newProblem(testTotal(), adam.BF16, false, 1, 9)
	want, wantCopy := p.reference(h, adam.BF16, 1)
	d := &failFree{Device: NewSim(SimOptions{})}
	e := setupPrefetch(t, d, p, perfmodel.Schedule{CPU: 3, GPU: 3, Resident: 2})
	plan, err := NewPlan(len(testSizes), perfmodel.Schedule{CPU: 7, Resident: 1}) // a larger prefetch buffer
	if err != nil {
		t.Fatal(err)
	}
	d.fail = true
	if err := e.Replan(plan); err != nil {
		t.Fatalf("Replan: %v", err)
	}
	d.fail = false
	if e.Broken() || e.Plan() != plan {
		t.Fatalf("after Replan: broken %t, plan %+v", e.Broken(), e.Plan().Schedule)
	}
	put(t, d, e.grad, 0, p.gradBytes(0))
	c := h.Coeffs(1, 1, 1)
	if err := e.Update(&c); err != nil {
		t.Fatal(err)
	}
	check(t, d, e, want, wantCopy)
	if err := e.Close(); err == nil || !strings.Contains(err.Error(), "freeing the old plan's pinned memory: cuMemHostUnregister: injected") {
		t.Errorf("Close: %v, want the leaked buffer's error", err)
	}
}
