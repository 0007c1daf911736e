package scheduler

import (
	"errors"
	"fmt"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestEnginePrefetch: with the gradients written by a "backward" on a
// stream of its own, suffix by suffix, and Prefetch called after each
// suffix, every schedule gives the state, working copy and mirror of
// adam.DefaultPath bitwise, as without Prefetch; a prefetch dropped (a
// skipped step, then new gradients) leaves no trace. On the simulated
// device its ordering check also proves that no prefetched copy reads a
// gradient before the backward wrote it.
func TestEnginePrefetch(t *testing.T) { forDevices(t, testEnginePrefetch) }

func testEnginePrefetch(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	n := testTotal()
	for _, gd := range []adam.DType{adam.F32, adam.BF16} {
		p := newProblem(n, gd, false, 3, 5)
		want, wantCopy := p.reference(h, adam.BF16, 3)
		for _, s := range schedules(len(testSizes)) {
			t.Run(fmt.Sprintf("%v/%+v", gd, s), func(t *testing.T) {
				d := newDev()
				e := setupPrefetch(t, d, p, s)
				defer e.Close()
				gb := elemBytes(gd)
				bwd, ev, host := backwardIO(t, d, gb*int64(n))
				// backward writes step's gradients from the last element
				// down, in four suffixes, calling Prefetch after each.
				backward := func(grad []byte) {
					copy(host.Bytes(), grad)
					hi := int64(n)
					for _, lo := range []int64{int64(n) * 3 / 4, int64(n) / 2, int64(n) / 5, 0} {
						if err := d.H2D(bwd, e.grad, gb*lo, host, gb*lo, gb*(hi-lo)); err != nil {
							t.Fatal(err)
						}
						if err := e.Prefetch(bwd, lo); err != nil {
							t.Fatal(err)
						}
						hi = lo
					}
					if err := firstErr(d.Record(ev, bwd), d.Sync(ev)); err != nil {
						t.Fatal(err)
					}
				}
				for step := range 3 {
					if step == 1 {
						// A skipped step: garbage gradients prefetched,
						// dropped, then the real ones.
						garbage := make([]byte, gb*int64(n))
						for i := range garbage {
							garbage[i] = 0xff
						}
						backward(garbage)
						if err := e.DropPrefetch(); err != nil {
							t.Fatal(err)
						}
					}
					backward(p.gradBytes(step))
					c := h.Coeffs(int64(step+1), 1, 1)
					if err := e.Update(&c); err != nil {
						t.Fatal(err)
					}
					ops, err := e.Trace()
					if err != nil {
						t.Fatal(err)
					}
					pre := 0
					for i := range e.sizes {
						for _, op := range e.core.ops(i) {
							if e.preLast[i]&(1<<op) != 0 {
								pre++
							}
						}
					}
					if want := prefetchable(e); pre != want {
						t.Fatalf("step %d: %d operations prefetched, want %d", step, pre, want)
					}
					if got, want := len(ops), e.core.numHeads; got != want {
						t.Fatalf("step %d: %d operations traced, want %d", step, got, want)
					}
				}
				check(t, d, e, want, wantCopy)
			})
		}
	}
}

// prefetchable counts the operations Prefetch issues for e's plan when
// every gradient is final: every CPU subgroup's gradient D2H (without the
// upcast) and the first two streamed subgroups' state H2D.
func prefetchable(e *Engine) int {
	n := min(e.plan.Schedule.GPU, 2)
	if !e.core.upcast {
		n += len(e.plan.CPUOrder)
	}
	return n
}

// TestPrefetchThenLoad: Load after a Prefetch (the host state changed in
// between) drops it: the update starts from the new state, the streamed
// subgroups' prefetched copies of the old one unused (an adversarial
// review found them used).
func TestPrefetchThenLoad(t *testing.T) {
	h := adam.DefaultHyper()
	n := testTotal()
	p := newProblem(n, adam.BF16, false, 1, 5)
	q := newProblem(n, adam.BF16, false, 1, 9) // another initial state, the same gradient
	q.g16 = p.g16
	want, wantCopy := q.reference(h, adam.BF16, 1)
	d := NewSim(SimOptions{})
	e := setupPrefetch(t, d, p, schedules(len(testSizes))[5])
	defer e.Close()
	put(t, d, e.grad, 0, p.gradBytes(0))
	bwd, _ := d.NewStream()
	defer d.FreeStream(bwd)
	if err := e.Prefetch(bwd, 0); err != nil {
		t.Fatal(err)
	}
	loadState(t, e, q.state)
	c := h.Coeffs(1, 1, 1)
	if err := e.Update(&c); err != nil {
		t.Fatal(err)
	}
	check(t, d, e, want, wantCopy)
}

// TestPrefetchFaults: after a full Prefetch, a fault at each copy or
// launch of the phase still ends in the reference state (complete() reads
// the prefetched gradients and keeps the prefetched slots); so does a
// fault at each of the first operations inside Prefetch, the phase then
// doing that work itself.
func TestPrefetchFaults(t *testing.T) {
	h := adam.DefaultHyper()
	n := testTotal()
	for _, gd := range []adam.DType{adam.F32, adam.BF16} {
		p := newProblem(n, gd, false, 1, 2)
		want, wantCopy := p.reference(h, adam.BF16, 1)
		for _, s := range schedules(len(testSizes)) {
			mk := func(t *testing.T) (*Sim, *Engine) {
				d := NewSim(SimOptions{})
				e := setupPrefetch(t, d, p, s)
				put(t, d, e.grad, 0, p.gradBytes(0))
				bwd, _ := d.NewStream()
				if err := e.Prefetch(bwd, 0); err != nil {
					t.Fatal(err)
				}
				return d, e
			}
			d, e := mk(t)
			before := d.Ops()
			c := h.Coeffs(1, 1, 1)
			if err := e.Update(&c); err != nil {
				t.Fatal(err)
			}
			ops := d.Ops() - before
			e.Close()
			for i := 1; i <= ops; i++ {
				t.Run(fmt.Sprintf("%v/%+v/op%d", gd, s, i), func(t *testing.T) {
					d, e := mk(t)
					defer e.Close()
					d.opts.FailAt = d.Ops() + i
					err := e.Update(&c)
					var fe *FaultError
					if !errors.As(err, &fe) {
						t.Fatalf("Update: %v", err)
					}
					check(t, d, e, want, wantCopy)
				})
			}
			// a fault inside Prefetch itself, then a clean update
			for i := 1; i <= 12; i++ {
				t.Run(fmt.Sprintf("%v/%+v/pre%d", gd, s, i), func(t *testing.T) {
					d := NewSim(SimOptions{})
					e := setupPrefetch(t, d, p, s)
					defer e.Close()
					put(t, d, e.grad, 0, p.gradBytes(0))
					bwd, _ := d.NewStream()
					d.opts.FailAt = d.Ops() + i
					_ = e.Prefetch(bwd, int64(n)/2)
					_ = e.Prefetch(bwd, 0)
					d.opts.FailAt = 0
					if err := e.Update(&c); err != nil {
						t.Fatal(err)
					}
					check(t, d, e, want, wantCopy)
				})
			}
		}
	}
}

// waitFail fails Wait once armed.
type waitFail struct {
	Device
	arm bool
}

func (w *waitFail) Wait(s Stream, e Event) error {
	if w.arm {
		return errors.New("wait refused")
	}
	return w.Device.Wait(s, e)
}

// TestUpdateFailsBeforePhase: an Update that fails before its phase starts
// (a stream wait refused) leaves the prefetch pending, so that
// DropPrefetch, Load or Close still wait for its copies (a review found it
// forgotten without a wait).
func TestUpdateFailsBeforePhase(t *testing.T) {
	h := adam.DefaultHyper()
	n := testTotal()
	p := newProblem(n, adam.BF16, false, 1, 2)
	sim := NewSim(SimOptions{})
	d := &waitFail{Device: sim}
	e := setupPrefetch(t, d, p, schedules(len(testSizes))[5])
	defer e.Close()
	put(t, sim, e.grad, 0, p.gradBytes(0))
	bwd, _ := sim.NewStream()
	if err := e.Prefetch(bwd, 0); err != nil {
		t.Fatal(err)
	}
	d.arm = true
	c := h.Coeffs(1, 1, 1)
	err := e.Update(&c)
	d.arm = false
	if err == nil || !e.preOn {
		t.Fatalf("Update: %v; the prefetch pending after it: %v, want an error and true", err, e.preOn)
	}
	if err := e.DropPrefetch(); err != nil || e.preOn {
		t.Fatalf("DropPrefetch: %v, pending %v", err, e.preOn)
	}
}

// setupPrefetch builds an engine with Options.Prefetch on d for p with the
// schedule s over testSizes and a mirror (testMirror), and loads p's
// initial state.
func setupPrefetch(t testing.TB, d Device, p *problem, s perfmodel.Schedule) *Engine {
	t.Helper()
	plan, err := NewPlan(len(testSizes), s)
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Device: d, Sizes: testSizes, GradDType: p.gd, WorkingDType: adam.BF16, Plan: plan, Mirror: testMirror(int64(testTotal())), Prefetch: true})
	if err != nil {
		t.Fatal(err)
	}
	loadState(t, e, p.state)
	return e
}

// loadState writes s into e's host state and loads it onto the device.
func loadState(t testing.TB, e *Engine, s adam.State) {
	t.Helper()
	hs := e.HostState()
	copy(hs.Param, s.Param)
	copy(hs.ExpAvg, s.ExpAvg)
	copy(hs.ExpAvgSq, s.ExpAvgSq)
	if err := e.Load(); err != nil {
		t.Fatal(err)
	}
}
