package scheduler

import (
	"fmt"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestEngineUpdatePer: each subgroup updated with its own scalars (its
// group's lr and weight_decay) gives, on every device and schedule, the
// state of adam.DefaultPath run subgroup by subgroup with those scalars,
// bitwise.
func TestEngineUpdatePer(t *testing.T) {
	forDevices(t, testEngineUpdatePer)
}

func testEngineUpdatePer(t *testing.T, newDev func() Device) {
	n := testTotal()
	hyper := func(i int) adam.Hyper {
		h := adam.DefaultHyper()
		h.LR = 1e-3 * float64(1+i%3)
		h.WeightDecay = []float64{0, 0.1, 0.01}[i%3]
		return h
	}
	p := newProblem(n, adam.BF16, false, 3, 5)
	want := p.state.Clone()
	wantCopy := adam.Copy16{DType: adam.BF16, Data: make([]uint16, n)}
	for step := range 3 {
		g := p.grad(step)
		off := 0
		for i, sz := range testSizes {
			c := hyper(i).Coeffs(int64(step+1), 1, 1)
			adam.DefaultPath.Step(&c, want.Slice(off, off+sz), g.Slice(off, off+sz), wantCopy.Slice(off, off+sz))
			off += sz
		}
	}
	cs := make([]adam.Coeffs, len(testSizes))
	for _, s := range schedules(len(testSizes)) {
		t.Run(fmt.Sprintf("%+v", s), func(t *testing.T) {
			d := newDev()
			e := setup(t, d, p, testSizes, s, false)
			defer e.Close()
			for step := range 3 {
				put(t, d, e.grad, 0, p.gradBytes(step))
				for i := range cs {
					cs[i] = hyper(i).Coeffs(int64(step+1), 1, 1)
				}
				if err := e.UpdatePer(cs); err != nil {
					t.Fatal(err)
				}
			}
			check(t, d, e, want, wantCopy.Data)
		})
	}
	d := newDev()
	e := setup(t, d, p, testSizes, schedules(len(testSizes))[0], false)
	defer e.Close()
	if err := e.UpdatePer(cs[:2]); err == nil {
		t.Error("UpdatePer with too few coefficients accepted")
	}
}
