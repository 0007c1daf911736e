package scheduler

import (
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// slowDev delays Sync of the events in slow (the speculation worker's
// specEv) and every D2H into the host buffer gpre (Prefetch's gradient
// copies), before the simulated device runs them.
type slowDev struct {
	*Sim
	mu        sync.Mutex
	slow      map[Event]bool
	gpre      Host
	syncDelay time.Duration
	d2hDelay  time.Duration
}

func (d *slowDev) Sync(e Event) error {
	d.mu.Lock()
	s := d.slow[e]
	d.mu.Unlock()
	if s {
		time.Sleep(d.syncDelay)
	}
	return d.Sim.Sync(e)
}

func (d *slowDev) D2H(st Stream, dst Host, dstOff int64, src Mem, srcOff, n int64) error {
	d.mu.Lock()
	s := d.gpre != nil && dst == d.gpre
	d.mu.Unlock()
	if s {
		time.Sleep(d.d2hDelay)
	}
	return d.Sim.D2H(st, dst, dstOff, src, srcOff, n)
}

// TestSpeculatePrefetchFailThenGoOn: a trainer drives the backward as
// runSpeculate does (Prefetch, then Speculate, for each subgroup, the last
// first); one Prefetch fails midway (dropped, as documented) and the
// trainer goes on. The Speculate after the failed Prefetch covers CPU
// subgroups whose gradient copy was not issued: they must not be
// speculated on (the worker would sync the copy's old end event and read
// the gradient before it lands), and every step is the serial one. The
// device delays the worker's syncs and the gradient copies, which opened
// that window before Speculate decided the subgroups itself.
func TestSpeculatePrefetchFailThenGoOn(t *testing.T) {
	runOrder(t, 150*time.Millisecond, func(t *testing.T, sim *Sim, a *Engine, bwd Stream, k, i int, cs []adam.Coeffs) {
		if k == 1 && i == len(testSizes)-2 {
			sim.FailAfter(1) // this subgroup's gradient D2H cannot be enqueued
		}
		perr := a.Prefetch(bwd, a.off[i])
		sim.FailAfter(0)
		serr := a.Speculate(bwd, a.off[i], cs)
		t.Logf("step %d subgroup %d: Prefetch %v, Speculate %v", k, i, perr, serr)
	})
}

// TestSpeculateBeforePrefetch: Speculate(ready) before Prefetch(ready)
// for each block (the other order than runSpeculate's), no fault: a CPU
// subgroup whose gradient copy Prefetch issues after the Speculate that
// covered it is not speculated on, and every step is the serial one.
func TestSpeculateBeforePrefetch(t *testing.T) {
	runOrder(t, 50*time.Millisecond, func(t *testing.T, sim *Sim, a *Engine, bwd Stream, k, i int, cs []adam.Coeffs) {
		if err := firstErr(a.Speculate(bwd, a.off[i], cs), a.Prefetch(bwd, a.off[i])); err != nil {
			t.Fatal(err)
		}
	})
}

// runOrder runs two steps of every subgroup on the CPU over testSizes, on
// an engine with Options.Speculate whose device delays the speculation's
// syncs by syncDelay and the gradient copies into the prefetch memory,
// with each subgroup's calls during the backward made by call (the last
// subgroup first), against an engine without speculation: the host states
// must agree bit for bit after each step.
func runOrder(t *testing.T, syncDelay time.Duration, call func(t *testing.T, sim *Sim, a *Engine, bwd Stream, k, i int, cs []adam.Coeffs)) {
	n := len(testSizes)
	p := newProblem(testTotal(), adam.BF16, false, 4, 9)
	h := adam.DefaultHyper()
	mk := func(d Device, spec int64) *Engine {
		plan, err := NewPlan(n, perfmodel.Schedule{CPU: n})
		if err != nil {
			t.Fatal(err)
		}
		e, err := New(Options{Device: d, Sizes: testSizes, GradDType: adam.BF16, WorkingDType: adam.BF16, Plan: plan, Prefetch: true, Speculate: spec})
		if err != nil {
			t.Fatal(err)
		}
		loadProblem(t, e, p)
		return e
	}
	sim := NewSim(SimOptions{})
	d := &slowDev{Sim: sim, slow: map[Event]bool{}, syncDelay: syncDelay, d2hDelay: 100 * time.Millisecond}
	a := mk(d, 1<<20)
	defer a.Close()
	d.mu.Lock()
	for _, ev := range a.specEv {
		d.slow[ev] = true
	}
	d.gpre = a.gpre
	d.mu.Unlock()
	dr := NewSim(SimOptions{})
	r := mk(dr, 0)
	defer r.Close()
	bwd, _ := sim.NewStream()
	bwdR, _ := dr.NewStream()
	for k := range 2 {
		put(t, sim, a.grad, 0, p.gradBytes(k))
		put(t, dr, r.grad, 0, p.gradBytes(k))
		cs := make([]adam.Coeffs, n)
		for i := range cs {
			cs[i] = h.Coeffs(int64(k+1), 1, 1)
		}
		for i := n - 1; i >= 0; i-- {
			call(t, sim, a, bwd, k, i, cs)
			if err := r.Prefetch(bwdR, r.off[i]); err != nil {
				t.Fatal(err)
			}
		}
		a.WaitSpeculation()
		kept, err := a.EndSpeculation(cs)
		if err != nil {
			t.Fatal(err)
		}
		if err := firstErr(a.UpdatePer(cs), r.UpdatePer(cs)); err != nil {
			t.Fatal(err)
		}
		if err := firstErr(a.Download(), r.Download()); err != nil {
			t.Fatal(err)
		}
		sa, sr := a.current(), r.current()
		for name, x := range map[string][2][]float32{"p": {sa.Param, sr.Param}, "exp_avg": {sa.ExpAvg, sr.ExpAvg}, "exp_avg_sq": {sa.ExpAvgSq, sr.ExpAvgSq}} {
			for j := range x[0] {
				if math.Float32bits(x[0][j]) != math.Float32bits(x[1][j]) {
					t.Fatalf("step %d (kept %d): %s[%d] %g, serial %g", k, kept, name, j, x[0][j], x[1][j])
				}
			}
		}
		wa, wr := make([]uint16, a.total), make([]uint16, r.total)
		if err := firstErr(a.GetWorking(wa), r.GetWorking(wr)); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(wa, wr) {
			t.Fatalf("step %d (kept %d): the working copy differs from the serial one", k, kept)
		}
	}
}
