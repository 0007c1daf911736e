package scheduler

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"testing"
	"unsafe"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// bkStep is one step of a differential run: engine a speculates (CPU
// subgroups, Options.Prefetch), engine r is the serial path (same options,
// no Speculate). Both must agree bitwise after every step.
type bkStep struct {
	plan      *perfmodel.Schedule // Replan both to it before the backward
	replanMid *perfmodel.Schedule // Replan both between Speculate and EndSpeculation
	clip      bool                // clipping binds (nothing kept)
	lrMid     bool                // group 1's lr changes after the speculation (its subgroups restored)
	failAt    int                 // FailAfter(failAt) for a's Update (0: none)
	nowait    bool                // no WaitSpeculation before the Step
	half      bool                // only the upper half is final when speculating
	late      bool                // a Speculate after EndSpeculation
	drop      bool                // DropPrefetch after EndSpeculation
	skip      bool                // a skipped step (EndSpeculation(nil), DropPrefetch)
	replanEnd *perfmodel.Schedule // Replan both after EndSpeculation kept, before the Update
}

type bkPair struct {
	t       *testing.T
	p       *problem
	da, dr  *Sim
	a, r    *Engine
	bwdA    Stream
	bwdR    Stream
	h       adam.Hyper
	step    int64
	sizes   []int
	groupLR [2]float64
}

func newBkPair(t *testing.T, sizes []int, s perfmodel.Schedule, ams bool, mirror []Span, budget int64) *bkPair {
	return newBkPairGD(t, adam.BF16, sizes, s, ams, mirror, budget)
}

func newBkPairGD(t *testing.T, gd adam.DType, sizes []int, s perfmodel.Schedule, ams bool, mirror []Span, budget int64) *bkPair {
	t.Helper()
	return newBkPairSpec(t, gd, sizes, s, ams, mirror, budget, false)
}

// newBkPairSpec is newBkPairGD with Options.SpeculateGPU gpu for the
// speculating engine.
func newBkPairSpec(t *testing.T, gd adam.DType, sizes []int, s perfmodel.Schedule, ams bool, mirror []Span, budget int64, gpu bool) *bkPair {
	t.Helper()
	n := 0
	for _, x := range sizes {
		n += x
	}
	bp := &bkPair{t: t, p: newProblem(n, gd, ams, 64, 7), sizes: sizes, h: adam.DefaultHyper()}
	bp.h.AMSGrad = ams
	bp.groupLR = [2]float64{1e-3, 3e-3}
	bp.da, bp.dr = NewSim(SimOptions{}), NewSim(SimOptions{})
	bp.engines(budget, Options{Sizes: sizes, GradDType: gd, WorkingDType: adam.BF16, AMSGrad: ams, Mirror: mirror, Prefetch: true, SpeculateGPU: gpu}, func() *Plan {
		plan, err := NewPlan(len(sizes), s)
		if err != nil {
			t.Fatal(err)
		}
		return plan
	})
	return bp
}

// sameState fails t unless got is want bit for bit, array by array.
func sameState(t testing.TB, what string, got, want adam.State) {
	t.Helper()
	for a, x := range [][2][]float32{{got.Param, want.Param}, {got.ExpAvg, want.ExpAvg}, {got.ExpAvgSq, want.ExpAvgSq}, {got.MaxExpAvgSq, want.MaxExpAvgSq}} {
		for i := range x[1] {
			if math.Float32bits(x[0][i]) != math.Float32bits(x[1][i]) {
				t.Fatalf("%s array %d element %d: %g, serial %g", what, a, i, x[0][i], x[1][i])
			}
		}
	}
}

// skip ends a skipped step on both engines: EndSpeculation keeps
// nothing, the prefetches are dropped.
func (bp *bkPair) skip() {
	bp.t.Helper()
	if _, err := bp.a.EndSpeculation(nil); err != nil {
		bp.t.Fatal(err)
	}
	if err := firstErr(bp.a.DropPrefetch(), bp.r.DropPrefetch()); err != nil {
		bp.t.Fatal(err)
	}
}

// engines makes bp's two engines on bp.da and bp.dr from o, each with a
// plan of its own, the first with budget bytes of Options.Speculate and
// the second without, loads bp.p into both, makes the backward streams
// and closes the engines when the test ends.
func (bp *bkPair) engines(budget int64, o Options, plan func() *Plan) {
	mk := func(d *Sim, spec int64) *Engine {
		o := o
		o.Device, o.Plan, o.Speculate = d, plan(), spec
		e, err := New(o)
		if err != nil {
			bp.t.Fatal(err)
		}
		loadProblem(bp.t, e, bp.p)
		return e
	}
	bp.a, bp.r = mk(bp.da, budget), mk(bp.dr, 0)
	bp.bwdA, _ = bp.da.NewStream()
	bp.bwdR, _ = bp.dr.NewStream()
	bp.t.Cleanup(func() {
		bp.a.Close()
		bp.r.Close()
	})
}

func (bp *bkPair) coeffs(step int64, unscale, clip float32, lr [2]float64) []adam.Coeffs {
	cs := make([]adam.Coeffs, len(bp.sizes))
	for i := range cs {
		h := bp.h
		h.LR = lr[i%2]
		cs[i] = h.Coeffs(step, unscale, clip)
	}
	return cs
}

func (bp *bkPair) replan(s perfmodel.Schedule) {
	t := bp.t
	t.Helper()
	for _, e := range []*Engine{bp.a, bp.r} {
		plan, err := NewPlan(len(bp.sizes), s)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Replan(plan); err != nil {
			t.Fatal(err)
		}
	}
}

// run runs the steps and compares after each.
func (bp *bkPair) run(steps []bkStep) {
	t := bp.t
	t.Helper()
	for k, st := range steps {
		if st.plan != nil {
			bp.replan(*st.plan)
		}
		g := bp.p.gradBytes(k)
		put(t, bp.da, bp.a.grad, 0, g)
		put(t, bp.dr, bp.r.grad, 0, g)
		spec := bp.coeffs(bp.step+1, 1, 1, bp.groupLR)
		for i := len(bp.sizes) - 1; i >= 0; i-- {
			if st.half && i < len(bp.sizes)/2 {
				break
			}
			if err := firstErr(bp.a.Prefetch(bp.bwdA, bp.a.off[i]), bp.a.Speculate(bp.bwdA, bp.a.off[i], spec)); err != nil {
				t.Fatal(err)
			}
			if err := bp.r.Prefetch(bp.bwdR, bp.r.off[i]); err != nil {
				t.Fatal(err)
			}
		}
		if !st.nowait {
			bp.a.WaitSpeculation()
		}
		if st.replanMid != nil {
			bp.replan(*st.replanMid)
		}
		fa, sa, err := bp.a.Stats(1)
		if err != nil {
			t.Fatal(err)
		}
		fr, sr, err := bp.r.Stats(1)
		if err != nil {
			t.Fatal(err)
		}
		if fa != fr || math.Float64bits(sa) != math.Float64bits(sr) {
			t.Fatalf("step %d: stats differ", k)
		}
		if st.skip {
			bp.skip()
			bp.compare(k)
			continue
		}
		lr := bp.groupLR
		if st.lrMid {
			lr[1] *= 2
			bp.groupLR = lr
		}
		clip := float32(1)
		if st.clip {
			clip = 0.5
		}
		cs := bp.coeffs(bp.step+1, 1, clip, lr)
		kept, err := bp.a.EndSpeculation(cs)
		if err != nil {
			t.Fatal(err)
		}
		if st.replanEnd != nil {
			bp.replan(*st.replanEnd)
		}
		if st.drop {
			if err := bp.a.DropPrefetch(); err != nil {
				t.Fatal(err)
			}
		}
		if st.late {
			other := bp.coeffs(bp.step+5, 1, 1, lr)
			if err := bp.a.Speculate(bp.bwdA, 0, other); err != nil {
				t.Fatal(err)
			}
			if !st.nowait {
				bp.a.WaitSpeculation()
			}
		}
		bp.step++
		if st.failAt > 0 {
			bp.da.FailAfter(st.failAt)
		}
		errA := bp.a.UpdatePer(cs)
		bp.da.FailAfter(0)
		var fe *FaultError
		if errA != nil && !errors.As(errA, &fe) {
			t.Fatalf("step %d (kept %d): a's Update: %v", k, kept, errA)
		}
		if err := bp.r.UpdatePer(cs); err != nil {
			t.Fatal(err)
		}
		t.Logf("step %d: kept %d, a's Update: %v", k, kept, errA)
		bp.compare(k)
	}
	if err := bp.da.OrderErr(); err != nil {
		t.Fatal(err)
	}
}

func (bp *bkPair) compare(k int) {
	t := bp.t
	t.Helper()
	if err := firstErr(bp.a.Download(), bp.r.Download()); err != nil {
		t.Fatal(err)
	}
	sameState(t, fmt.Sprintf("step %d: state", k), bp.a.current(), bp.r.current())
	wa, wr := make([]uint16, bp.a.total), make([]uint16, bp.r.total)
	if err := firstErr(bp.a.GetWorking(wa), bp.r.GetWorking(wr)); err != nil {
		t.Fatal(err)
	}
	for i := range wa {
		if wa[i] != wr[i] {
			t.Fatalf("step %d: working copy element %d: %#04x, serial %#04x", k, i, wa[i], wr[i])
		}
	}
	if bp.a.mirrorN > 0 {
		ma := get(t, bp.da, bp.a.mirror, 0, 4*bp.a.mirrorN)
		mr := get(t, bp.dr, bp.r.mirror, 0, 4*bp.r.mirrorN)
		// only the spans: padding is not written
		fa := unsafe.Slice((*float32)(unsafe.Pointer(&ma[0])), bp.a.mirrorN)
		fr := unsafe.Slice((*float32)(unsafe.Pointer(&mr[0])), bp.r.mirrorN)
		ats, _ := MirrorLayout(bp.a.o.Mirror)
		for s, sp := range bp.a.o.Mirror {
			for j := range sp.N {
				if math.Float32bits(fa[ats[s]+j]) != math.Float32bits(fr[ats[s]+j]) {
					t.Fatalf("step %d: mirror span %d element %d: %g, serial %g", k, s, j, fa[ats[s]+j], fr[ats[s]+j])
				}
			}
		}
	}
	_ = bytes.Equal
}

func sched(c, g, r int, up bool) *perfmodel.Schedule {
	return &perfmodel.Schedule{CPU: c, GPU: g, Resident: r, UpcastOnGPU: up}
}

// TestSpeculateDiff: a broad differential run.
func TestSpeculateDiff(t *testing.T) {
	n := len(testSizes)
	mirror := []Span{{Off: 0, N: int64(testTotal())}}
	for _, ams := range []bool{false, true} {
		for _, budget := range []int64{1 << 20, SpeculateBytes(1100, ams), SpeculateBytes(2100, ams)} {
			t.Run(fmt.Sprintf("ams=%v/budget=%d", ams, budget), func(t *testing.T) {
				bp := newBkPair(t, testSizes, perfmodel.Schedule{CPU: n}, ams, mirror, budget)
				bp.run([]bkStep{
					{}, {}, {lrMid: true}, {clip: true}, {late: true}, {drop: true}, {half: true}, {skip: true}, {},
					{plan: sched(4, 3, 1, false)}, {}, {plan: sched(n, 0, 0, true)}, {}, {plan: sched(5, 2, 1, false)}, {nowait: true},
					{replanMid: sched(3, 2, 3, false)}, {replanMid: sched(n, 0, 0, false)}, {lrMid: true, late: true}, {},
				})
			})
		}
	}
}

// TestSpeculateFaults: a fault at each operation of the phase after a
// kept speculation (CPU subgroups), with a mirror over everything.
func TestSpeculateFaults(t *testing.T) {
	n := len(testSizes)
	mirror := []Span{{Off: 0, N: int64(testTotal())}}
	for _, s := range []perfmodel.Schedule{{CPU: n}, {CPU: 5, GPU: 2, Resident: 1}} {
		for k := 1; k <= 60; k++ {
			t.Run(fmt.Sprintf("%+v/%d", s, k), func(t *testing.T) {
				bp := newBkPair(t, testSizes, s, false, mirror, 1<<20)
				bp.run([]bkStep{{}, {failAt: k}, {}, {lrMid: true, failAt: k}, {}})
			})
		}
	}
}

// TestSpeculateDiffDTypes: F32 and F16 gradients.
func TestSpeculateDiffDTypes(t *testing.T) {
	n := len(testSizes)
	mirror := []Span{{Off: 3, N: 900}, {Off: 2000, N: 2500}}
	for _, gd := range []adam.DType{adam.F32, adam.F16} {
		t.Run(fmt.Sprint(gd), func(t *testing.T) {
			bp := newBkPairGD(t, gd, testSizes, perfmodel.Schedule{CPU: 5, GPU: 2, Resident: 1}, false, mirror, SpeculateBytes(3000, false))
			bp.run([]bkStep{{}, {}, {lrMid: true}, {plan: sched(n, 0, 0, false)}, {}, {late: true}, {failAt: 9}, {}, {plan: sched(n-1, 0, 1, true)}, {}, {plan: sched(n, 0, 0, false)}, {}})
		})
	}
}

// TestSpeculateReplanAfterEnd: Replan between EndSpeculation (kept) and
// the Update, changing which subgroups are CPU ones, with and without a
// late speculation.
func TestSpeculateReplanAfterEnd(t *testing.T) {
	n := len(testSizes)
	mirror := []Span{{Off: 0, N: int64(testTotal())}}
	bp := newBkPair(t, testSizes, perfmodel.Schedule{CPU: n}, true, mirror, SpeculateBytes(2500, true))
	bp.run([]bkStep{{}, {replanEnd: sched(4, 3, 1, false)}, {replanEnd: sched(n, 0, 0, false)}, {replanEnd: sched(n-1, 0, 1, true), late: true},
		{replanEnd: sched(n, 0, 0, false), late: true, nowait: true}, {}, {replanMid: sched(2, 2, 4, false), late: true}, {}})
}
