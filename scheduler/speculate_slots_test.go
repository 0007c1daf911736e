package scheduler

import (
	"math"
	"sync"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestAllocSlot: the first free run of the slots that holds n elements, at
// a multiple of slotAlign, stepping over every run in use (a subgroup's
// state there, or a speculative update's new state), and none when no run
// is long enough.
func TestAllocSlot(t *testing.T) {
	e := &Engine{sizes: []int64{100, 50, 30, 20}, specN: 200}
	e.loc, e.specTo = []int64{homeLoc, homeLoc, homeLoc, homeLoc}, []int64{noSpec, noSpec, noSpec, noSpec}
	at := func(n int64, want int64, ok bool) {
		t.Helper()
		got, gotOK := e.allocSlot(n)
		if gotOK != ok || ok && got != want {
			t.Fatalf("allocSlot(%d) with loc %v specTo %v: %d %v, want %d %v", n, e.loc, e.specTo, got, gotOK, want, ok)
		}
	}
	at(100, 0, true)
	e.specTo[0] = 0 // a speculation wrote there
	at(50, 112, true)
	e.loc[1] = 112   // a kept one's state is there
	at(30, 0, false) // 176 + 30 > 200: the alignment's waste counts
	at(24, 176, true)
	e.specTo[0] = noSpec // undone: free again
	at(30, 0, true)
	e.loc[2] = 0
	at(80, 32, true) // after subgroup 2's run, before subgroup 1's
	at(81, 0, false)
	e.specN = 0
	at(1, 0, false)
}

// TestSpeculateSlots: every held subgroup speculated and kept goes out to
// a slot of its own (disjoint, aligned, inside the slots), comes home at
// the next kept step, and goes out again; HostState's arrays hold the
// last step's state only after DropSpeculation, which brings every state
// home; the Hold gate is called for a subgroup's writes into the host
// state (a speculative update home, DropSpeculation's move) and not for a
// speculative update into a slot; and the state is the serial steps'
// bit for bit throughout.
func TestSpeculateSlots(t *testing.T) {
	h := adam.DefaultHyper()
	const steps = 5
	held := heldPatterns[5] // every subgroup host-held
	p := heldProblem(adam.BF16, steps, 7, -1)
	d := NewSim(SimOptions{})
	budget := SpeculateBytes(int64(p.state.Len())+slotAlign*int64(len(heldSizes)), false)
	e := specEngine(t, d, p, held, heldSchedules(0)[0], budget)
	defer e.Close()
	bwd, ev, host := backwardIO(t, d, 2*e.total)
	var mu sync.Mutex
	gated := make([]int, len(e.sizes))
	e.Hold(func(i int) {
		mu.Lock()
		gated[i]++
		mu.Unlock()
	})
	cs := make([]adam.Coeffs, len(e.sizes))
	for k := range steps {
		clear(gated)
		for i := range cs {
			cs[i] = h.Coeffs(int64(k+1), 1, 1)
		}
		speculateBackward(t, d, e, bwd, ev, host, p.gradBytes(k), cs, true)
		e.WaitSpeculation()
		wasOut := e.loc[0] != homeLoc
		kept, err := e.EndSpeculation(cs) // clip 1, as speculated: every one kept
		if err != nil || kept != e.total {
			t.Fatalf("step %d: kept %d of %d, %v", k, kept, e.total, err)
		}
		for i := range e.sizes {
			// Only the updates that wrote home passed the gate.
			if want := map[bool]int{true: 1, false: 0}[wasOut]; gated[i] != want {
				t.Fatalf("step %d: subgroup %d gated %d times by its speculative update, want %d (its state was in a slot: %v)", k, i, gated[i], want, wasOut)
			}
		}
		if err := e.UpdatePer(cs); err != nil {
			t.Fatal(err)
		}
		// Out and home in turn, all together.
		type run struct{ lo, hi int64 }
		var runs []run
		for i, l := range e.loc {
			if (l != homeLoc) == wasOut {
				t.Fatalf("step %d: subgroup %d at %d after a step from a slot %v", k, i, l, wasOut)
			}
			if l == homeLoc {
				continue
			}
			if l%slotAlign != 0 || l < 0 || l+e.sizes[i] > e.specN {
				t.Fatalf("step %d: subgroup %d's slot [%d, %d) is not aligned or not inside the %d slots", k, i, l, l+e.sizes[i], e.specN)
			}
			for _, r := range runs {
				if l < r.hi && r.lo < l+e.sizes[i] {
					t.Fatalf("step %d: subgroup %d's slot [%d, %d) overlaps [%d, %d)", k, i, l, l+e.sizes[i], r.lo, r.hi)
				}
			}
			runs = append(runs, run{l, l + e.sizes[i]})
		}
		want, _ := specReference(p, h, make([]specCase, k+1))
		got := e.current()
		stale := false
		for j := range want.Param {
			if math.Float32bits(got.Param[j]) != math.Float32bits(want.Param[j]) || math.Float32bits(got.ExpAvgSq[j]) != math.Float32bits(want.ExpAvgSq[j]) {
				t.Fatalf("step %d: element %d: p %g exp_avg_sq %g, serial %g %g", k, j, got.Param[j], got.ExpAvgSq[j], want.Param[j], want.ExpAvgSq[j])
			}
			stale = stale || math.Float32bits(e.HostState().Param[j]) != math.Float32bits(want.Param[j])
		}
		if stale != !wasOut {
			t.Fatalf("step %d: HostState stale %v with the states in slots %v", k, stale, !wasOut)
		}
	}
	// The last step sent every state out: DropSpeculation brings them
	// home, through the gate.
	clear(gated)
	e.DropSpeculation()
	for i, l := range e.loc {
		if l != homeLoc || gated[i] != 1 {
			t.Fatalf("after DropSpeculation: subgroup %d at %d, gated %d times, want home and once", i, l, gated[i])
		}
	}
	want, wantCopy := specReference(p, h, make([]specCase, steps))
	checkHeldRun(t, d, e, want, wantCopy)
	for j, x := range e.HostState().Param {
		if math.Float32bits(x) != math.Float32bits(want.Param[j]) {
			t.Fatalf("after DropSpeculation: HostState's p[%d] %g, serial %g", j, x, want.Param[j])
		}
	}
}
