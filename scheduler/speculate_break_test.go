package scheduler

import (
	"fmt"
	"math"
	"testing"

	"github.com/deepstates/dos/perfmodel"
)

// TestSpeculateDropAfterCloseSlots: after steps that kept speculative
// updates (states left in slots), Close, then DropSpeculation: it must
// return (DropPrefetch after Close does), not touch freed memory.
func TestSpeculateDropAfterCloseSlots(t *testing.T) {
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

// TestSpeculateCopyFaultSkipped: a copy of the worker's specCopy (the new working
// copy H2D, or its mirror part) fails, the other one is enqueued all the
// same; the step is then skipped (EndSpeculation(nil), DropPrefetch): the
// device working copy and the mirror must be the last step's, as the
// serial engine's.
func TestSpeculateCopyFaultSkipped(t *testing.T) {
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

// TestSpeculateNaNState: a master weight or moment that is NaN (a user's
// write; Load takes it): the speculation's StepTo against the serial
// Step, bit for bit.
func TestSpeculateNaNState(t *testing.T) {
	n := len(testSizes)
	for _, ams := range []bool{false, true} {
		t.Run(fmt.Sprint(ams), func(t *testing.T) {
			bp := newBkPair(t, testSizes, perfmodel.Schedule{CPU: n}, ams, nil, 1<<20)
			for _, e := range []*Engine{bp.a, bp.r} {
				hs := e.HostState()
				for _, j := range []int{0, 1, 17, 999, 1000, 1001, 2500, 5290, 5353, 6353} {
					hs.Param[j] = math.Float32frombits(0xffc00001 + uint32(j))
					hs.ExpAvg[(j+1)%6354] = math.Float32frombits(0x7fa00003)
					hs.ExpAvgSq[(j+2)%6354] = math.Float32frombits(0xffc12345)
				}
				if err := e.Load(); err != nil {
					t.Fatal(err)
				}
			}
			bp.run([]bkStep{{}, {}, {}, {}})
		})
	}
}

// TestSpeculateSettleBroken: the Update's settling undoes a late
// speculation (a Speculate after EndSpeculation) whose re-copy of the old
// working copy fails to enqueue: the engine is then broken, and the
// Update must say so, not return nil.
func TestSpeculateSettleBroken(t *testing.T) {
	n := len(testSizes)
	bp := newBkPair(t, testSizes, perfmodel.Schedule{CPU: n}, false, nil, 1<<20)
	bp.run([]bkStep{{}})
	put(t, bp.da, bp.a.grad, 0, bp.p.gradBytes(1))
	for i := n - 1; i >= 0; i-- {
		if err := bp.a.Prefetch(bp.bwdA, bp.a.off[i]); err != nil {
			t.Fatal(err)
		}
	}
	cs := bp.coeffs(bp.step+1, 1, 1, bp.groupLR)
	if _, err := bp.a.EndSpeculation(cs); err != nil { // nothing speculated yet
		t.Fatal(err)
	}
	if err := bp.a.Speculate(bp.bwdA, 0, bp.coeffs(bp.step+5, 1, 1, bp.groupLR)); err != nil { // late, other scalars
		t.Fatal(err)
	}
	bp.a.WaitSpeculation()
	bp.da.FailAfter(1) // the settling's first re-copy
	err := bp.a.UpdatePer(cs)
	bp.da.FailAfter(0)
	if bp.a.Broken() && err == nil {
		t.Fatalf("UpdatePer returned nil, but the engine is broken (Broken() = true)")
	}
}
