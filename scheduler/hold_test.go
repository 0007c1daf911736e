package scheduler

import (
	"math"
	"sync"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestEngineHold: a lazy checkpoint's copy-on-write through the engine.
// After step 1, DownloadAsync moves the resident state D2H and step 2's
// Update runs at once, before anyone waits for that copy: the copy still
// holds step 1's resident state (its kernels wait on the device). Hold's
// gate is called once for every CPU and streamed subgroup, and never for
// a resident one, each time while the host state of that subgroup is still
// step 1's; afterwards the state is step 2's, bitwise.
func TestEngineHold(t *testing.T) { forDevices(t, testEngineHold) }

func testEngineHold(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	n := testTotal()
	p := newProblem(n, adam.BF16, false, 2, 9)
	want1, _ := p.reference(h, adam.BF16, 1)
	want2, wantCopy2 := p.reference(h, adam.BF16, 2)
	d := newDev()
	e := setup(t, d, p, testSizes, perfmodel.Schedule{CPU: 3, GPU: 2, Resident: 3}, false)
	defer e.Close()
	put(t, d, e.grad, 0, p.gradBytes(0))
	c := h.Coeffs(1, 1, 1)
	if err := e.Update(&c); err != nil {
		t.Fatal(err)
	}

	hs := e.HostState()
	same := func(i int, want adam.State) bool {
		lo, hi := e.off[i], e.off[i]+int64(e.o.Sizes[i])
		for _, x := range [][2][]float32{{hs.Param, want.Param}, {hs.ExpAvg, want.ExpAvg}, {hs.ExpAvgSq, want.ExpAvgSq}} {
			for j := lo; j < hi; j++ {
				if math.Float32bits(x[0][j]) != math.Float32bits(x[1][j]) {
					return false
				}
			}
		}
		return true
	}
	var mu sync.Mutex
	calls := make([]int, len(testSizes))
	e.Hold(func(i int) {
		mu.Lock()
		defer mu.Unlock()
		calls[i]++
		if !same(i, want1) {
			t.Errorf("gate(%d): the host state changed before the gate", i)
		}
	})
	wait, err := e.DownloadAsync()
	if err != nil {
		t.Fatal(err)
	}
	put(t, d, e.grad, 0, p.gradBytes(1))
	c = h.Coeffs(2, 1, 1)
	if err := e.Update(&c); err != nil {
		t.Fatal(err)
	}
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	e.Hold(nil)
	for i, r := range e.plan.Roles {
		switch {
		case r == Resident && calls[i] != 0:
			t.Errorf("resident subgroup %d: gate called %d times", i, calls[i])
		case r != Resident && calls[i] != 1:
			t.Errorf("%v subgroup %d: gate called %d times, want once", r, i, calls[i])
		case r == Resident && !same(i, want1):
			t.Errorf("resident subgroup %d: the D2H did not capture step 1's state", i)
		case r != Resident && !same(i, want2):
			t.Errorf("%v subgroup %d: not step 2's state after the update", r, i)
		}
	}
	check(t, d, e, want2, wantCopy2)
}
