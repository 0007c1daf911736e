package scheduler

import (
	"fmt"
	"testing"

	"github.com/deepstates/dos/perfmodel"
)

// TestBreakDropSpeculationAfterClose: after steps that kept speculative
// updates (states left in slots), Close, then DropSpeculation: it must
// return (DropPrefetch after Close does), not touch freed memory.
func TestBreakDropSpeculationAfterClose(t *testing.T) {
	n := len(testSizes)
	bp := newBkPair(t, testSizes, perfmodel.Schedule{CPU: n}, false, nil, 1<<20)
	bp.run([]bkStep{{}, {}, {}})
	moved := 0
	for _, l := range bp.a.loc {
		if l != homeLoc {
			moved++
		}
	}
	if moved == 0 {
		t.Fatal("no state in a slot")
	}
	if err := bp.a.Close(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("DropSpeculation after Close panicked: %v", r)
		}
	}()
	bp.a.DropSpeculation()
}

// TestBreakSpecCopyFault: a copy of the worker's specCopy (the new working
// copy H2D, or its mirror part) fails, the other one is enqueued all the
// same; the step is then skipped (EndSpeculation(nil), DropPrefetch): the
// device working copy and the mirror must be the last step's, as the
// serial engine's.
func TestBreakSpecCopyFault(t *testing.T) {
	n := len(testSizes)
	mirror := []Span{{Off: 0, N: int64(testTotal())}}
	for k := 1; k <= 4; k++ {
		t.Run(fmt.Sprint(k), func(t *testing.T) {
			bp := newBkPair(t, testSizes, perfmodel.Schedule{CPU: n}, false, mirror, 1<<20)
			bp.run([]bkStep{{}})
			g := bp.p.gradBytes(1)
			put(t, bp.da, bp.a.grad, 0, g)
			put(t, bp.dr, bp.r.grad, 0, g)
			for i := n - 1; i >= 0; i-- {
				if err := firstErr(bp.a.Prefetch(bp.bwdA, bp.a.off[i]), bp.r.Prefetch(bp.bwdR, bp.r.off[i])); err != nil {
					t.Fatal(err)
				}
			}
			bp.da.FailAfter(k)
			if err := bp.a.Speculate(bp.bwdA, 0, bp.coeffs(bp.step+1, 1, 1, bp.groupLR)); err != nil {
				t.Fatal(err)
			}
			bp.a.WaitSpeculation()
			bp.da.FailAfter(0)
			if _, err := bp.a.EndSpeculation(nil); err != nil {
				t.Fatal(err)
			}
			if err := firstErr(bp.a.DropPrefetch(), bp.r.DropPrefetch()); err != nil {
				t.Fatal(err)
			}
			if bp.a.Broken() {
				t.Fatal("broken")
			}
			bp.compare(1)
		})
	}
}
