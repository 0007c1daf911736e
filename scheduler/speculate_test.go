package scheduler

import (
	"fmt"
	"math"
	"reflect"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// specCase is one step of a speculation test: the bound on the norm that
// the step clips to (0: none; tiny: clipping binds) and what happens
// between the speculation and the step.
type specCase struct {
	maxNorm float64
	drop    bool // DropPrefetch after EndSpeculation kept what it could, then the phase anyway
	late    bool // another Speculate after EndSpeculation (its updates must be undone)
}

// specReference runs the steps on the host as a trainer does (the global
// checks, a non-finite step skipped, clipping per step).
func specReference(p *problem, h adam.Hyper, cases []specCase) (adam.State, []uint16) {
	s := p.state.Clone()
	out := adam.Copy16{DType: adam.BF16, Data: make([]uint16, s.Len())}
	adam.Round16(adam.BF16, out.Data, s.Param)
	t := int64(0)
	for k, sc := range cases {
		finite, sum := adam.DefaultPath.GradStats(p.grad(k), 1)
		if !finite {
			continue
		}
		t++
		c := h.Coeffs(t, 1, clipCoef(sum, sc.maxNorm))
		adam.DefaultPath.Step(&c, s, p.grad(k), out)
	}
	return s, out.Data
}

// TestEngineSpeculate: the host-held subgroups updated during the
// backward with clip 1 (Speculate), then kept when the step's scalars are
// those (EndSpeculation) and undone otherwise (clipping binds, a
// non-finite step, a drop before the phase, a Speculate after
// EndSpeculation), give the serial steps' state and working copy bit for
// bit, under every schedule of the other subgroups, with saves for every
// held subgroup and for one only; and a kept subgroup is one the phase
// did not update.
func TestEngineSpeculate(t *testing.T) { forDevices(t, testEngineSpeculate) }

func testEngineSpeculate(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	// Step 1 carries an Inf (skipped); step 2 clips; step 3 drops after
	// keeping; step 4 speculates again after EndSpeculation.
	cases := []specCase{{}, {}, {maxNorm: 1e-3}, {drop: true}, {late: true}, {maxNorm: 1e30}}
	for _, held := range [][]bool{make([]bool, len(heldSizes)), heldPatterns[1], heldPatterns[5]} {
		p := heldProblem(adam.BF16, len(cases), 41, 30000)
		want, wantCopy := specReference(p, h, cases)
		scheds := heldSchedules(len(heldSizes) - countHeld(held))
		// 100,000 parameters of slots: the GPU speculation alone keeps
		// the streamed subgroups 7, 6, 5, 3, 2 and 1 but not 4 and 0 (no
		// slot left for them), so that the phase's state H2D of subgroup
		// 4 into staging slot 0 steps over the kept 2's skipped state D2H
		// to subgroup 0's (Engine.slotStep), with no state D2H between
		// them whose throttle would wait for it.
		for _, budget := range []int64{SpeculateBytes(1<<20, false), SpeculateBytes(40000, false), SpeculateBytes(100000, false)} {
			for _, s := range scheds {
				for _, gpu := range []bool{false, true} {
					if (gpu && s.GPU == 0) || (!gpu && budget == SpeculateBytes(100000, false)) {
						continue
					}
					t.Run(fmt.Sprintf("held=%v/%+v/budget=%d/gpu=%v", held, s, budget, gpu), func(t *testing.T) {
						d := newDev()
						e := newHeld(t, d, p, held, s, Options{Prefetch: true, Speculate: budget, SpeculateGPU: gpu})
						defer e.Close()
						runSpeculate(t, d, e, p, h, cases)
						checkHeldRun(t, d, e, want, wantCopy)
						if sim, ok := d.(*Sim); ok {
							if err := sim.OrderErr(); err != nil {
								t.Fatal(err)
							}
						}
					})
				}
			}
		}
	}
}

// specEngine is setupHeld's engine with Prefetch and Options.Speculate
// budget bytes.
func specEngine(t testing.TB, d Device, p *problem, held []bool, s perfmodel.Schedule, budget int64) *Engine {
	t.Helper()
	return newHeld(t, d, p, held, s, Options{Prefetch: true, Speculate: budget})
}

// runSpeculate steps e over p's gradients as a trainer with speculation
// does: the gradients written the last subgroups first, each followed by
// Prefetch and Speculate (clip 1), then Stats, EndSpeculation with the
// step's scalars (nil for a skipped step) and Update.
func runSpeculate(t *testing.T, d Device, e *Engine, p *problem, h adam.Hyper, cases []specCase) {
	t.Helper()
	bwd, ev, host := backwardIO(t, d, 2*e.total)
	cs := make([]adam.Coeffs, len(e.sizes))
	step := int64(0)
	speculate := func(half bool) {
		for i := range cs {
			cs[i] = h.Coeffs(step+1, 1, 1)
		}
		for i := len(e.sizes) - 1; i >= 0; i-- {
			if half && i < len(e.sizes)/2 {
				break
			}
			if err := firstErr(e.Prefetch(bwd, e.off[i]), e.Speculate(bwd, e.off[i], cs)); err != nil {
				t.Fatal(err)
			}
		}
	}
	for k, sc := range cases {
		b := p.gradBytes(k)
		copy(host.Bytes(), b)
		for i := len(e.sizes) - 1; i >= 0; i-- {
			putGrad(t, d, e, bwd, host, b, i)
		}
		speculate(sc.late)
		if err := firstErr(d.Record(ev, bwd), d.Sync(ev)); err != nil {
			t.Fatal(err)
		}
		e.WaitSpeculation()
		finite, sum, err := e.Stats(1)
		if err != nil {
			t.Fatal(err)
		}
		if !finite {
			if kept, err := e.EndSpeculation(nil); err != nil || kept != 0 {
				t.Fatalf("step %d (skipped): EndSpeculation(nil) kept %d, %v", k, kept, err)
			}
			if err := e.DropPrefetch(); err != nil {
				t.Fatal(err)
			}
			continue
		}
		c := h.Coeffs(step+1, 1, clipCoef(sum, sc.maxNorm))
		for i := range cs {
			cs[i] = c
		}
		kept, err := e.EndSpeculation(cs)
		if err != nil {
			t.Fatal(err)
		}
		// What may be speculated on: the host-held subgroups and the CPU
		// subgroups whose gradients Prefetch moved (not with the upcast).
		// Less what SetSpeculateLeave left to the phase.
		// With Options.SpeculateGPU, the streamed subgroups too.
		heldN, gpuN := int64(0), int64(0)
		for i, n := range e.sizes {
			if (e.held[i] || e.specCPU(i)) && !e.specLeave[i] {
				heldN += n
			}
			if e.specGPUOn() && e.specOnGPU(i) {
				gpuN += n
			}
		}
		keptGPU := e.SpeculatedGPU()
		switch {
		case c.Clip != 1 && kept+keptGPU != 0:
			t.Fatalf("step %d: clipping binds (%g) but %d+%d parameters were kept", k, c.Clip, kept, keptGPU)
		case gpuN > 0 && heldN == 0 && c.Clip == 1 && !sc.late && e.specN >= gpuN && keptGPU != gpuN:
			// The GPU speculation alone (no other worker takes slots).
			t.Fatalf("step %d: %d of the streamed subgroups' %d parameters kept with saves for %d", k, keptGPU, gpuN, e.specN)
		case gpuN > 0 && c.Clip == 1 && !sc.late && kept+keptGPU == 0:
			t.Fatalf("step %d: nothing kept (saves for %d)", k, e.specN)
		case gpuN > 0:
			// The two workers take the slots in either order: how many
			// parameters each keeps depends on timing (the slots may be
			// cut into pieces too small for what is left).
		case c.Clip == 1 && !sc.late && e.specN >= heldN && kept != heldN:
			t.Fatalf("step %d: %d of %d parameters kept with saves for %d", k, kept, heldN, e.specN)
		case c.Clip == 1 && kept == 0 && heldN > 0 && !sc.late:
			t.Fatalf("step %d: nothing kept (saves for %d)", k, e.specN)
		}
		if sc.drop {
			if err := e.DropPrefetch(); err != nil {
				t.Fatal(err)
			}
		}
		if sc.late {
			// A Speculate after EndSpeculation of the held subgroups not
			// speculated yet (the first half), with other scalars: the
			// Update undoes them and updates them itself.
			for i := range cs {
				cs[i] = h.Coeffs(step+7, 1, 1)
			}
			if err := e.Speculate(bwd, 0, cs); err != nil {
				t.Fatal(err)
			}
			e.WaitSpeculation()
			for i := range cs {
				cs[i] = c
			}
		}
		step++
		if err := e.UpdatePer(cs); err != nil {
			t.Fatal(err)
		}
		traced, tracedGPU := kept, keptGPU
		if sc.drop {
			traced, tracedGPU = 0, 0 // undone by the drop
		}
		checkSpecTrace(t, e, k, traced, tracedGPU, c.Clip != 1)
		for i := range e.sizes {
			if e.held[i] && e.preLast[i]&(1<<opCPU) != 0 && (sc.drop || c.Clip != 1) {
				t.Fatalf("step %d: subgroup %d counted as kept after a drop or with clipping", k, i)
			}
		}
		if kept > 0 && !sc.drop {
			for i := range e.sizes {
				if e.preLast[i]&(1<<opCPU) != 0 && !e.held[i] && e.done[i]&(1<<opCopyH2D) == 0 {
					t.Fatalf("step %d: kept CPU subgroup %d's working copy did not move H2D", k, i)
				}
			}
			n := 0
			for i := range e.sizes {
				if e.preLast[i]&(1<<opCPU) != 0 {
					n++
					if e.cpuT[i][1] > 0 {
						t.Fatalf("step %d: kept subgroup %d ended at %v, after the phase's start", k, i, e.cpuT[i][1])
					}
				}
			}
			if n == 0 {
				t.Fatalf("step %d: %d parameters kept, but the phase updated every subgroup", k, kept)
			}
		}
	}
}

// TestSpeculateLeave: with SetSpeculateLeave, the speculation leaves
// every other subgroup the CPU workers update, from the last one up (the
// last stays speculable), until those left hold the parameters asked
// for; the phase updates them; and every step's state and working copy
// are still the serial steps' bit for bit (runSpeculate checks that what
// was not left was kept).
func TestSpeculateLeave(t *testing.T) { forDevices(t, testSpeculateLeave) }

func testSpeculateLeave(t *testing.T, newDev func() Device) {
	h := adam.DefaultHyper()
	cases := []specCase{{}, {}, {maxNorm: 1e-3}, {}, {maxNorm: 1e30}}
	for _, held := range [][]bool{make([]bool, len(heldSizes)), heldPatterns[1], heldPatterns[5]} {
		p := heldProblem(adam.BF16, len(cases), 43, -1)
		want, wantCopy := specReference(p, h, cases)
		for _, s := range heldSchedules(len(heldSizes) - countHeld(held)) {
			for _, leave := range []int64{1, int64(heldSizes[len(heldSizes)-1]) + 1, 1 << 40} {
				t.Run(fmt.Sprintf("held=%v/%+v/leave=%d", held, s, leave), func(t *testing.T) {
					d := newDev()
					e := specEngine(t, d, p, held, s, SpeculateBytes(1<<20, false))
					defer e.Close()
					if end, ok := e.PhaseCPUEnd(); ok || end != 0 {
						t.Fatalf("PhaseCPUEnd %d, %v before any phase", end, ok)
					}
					e.SetSpeculateLeave(leave)
					runSpeculate(t, d, e, p, h, cases)
					// The last phase (kept, no clipping): after PhaseCPUEnd
					// no CPU update ran in it but those left to it, and the
					// subgroup ending there was updated in it.
					end, ok := e.PhaseCPUEnd()
					if !ok {
						t.Fatal("PhaseCPUEnd: no phase after runSpeculate's")
					}
					for i := range e.sizes {
						cpu := e.held[i] || e.plan.Roles[i] == OnCPU
						inPhase := cpu && e.cpuT[i][1] > 0
						switch {
						case e.off[i] >= end && inPhase && !e.specLeave[i]:
							t.Fatalf("subgroup %d (at %d) updated in the phase, after PhaseCPUEnd %d", i, e.off[i], end)
						case e.off[i]+e.sizes[i] == end && !inPhase:
							t.Fatalf("PhaseCPUEnd %d ends subgroup %d, not updated in the phase", end, i)
						}
					}
					checkHeldRun(t, d, e, want, wantCopy)
					// The marks of the last phase: every other qualifying
					// subgroup from the last up, the last one not left.
					var q []int // the qualifying subgroups, last first
					for i := len(e.sizes) - 1; i >= 0; i-- {
						if e.held[i] || e.specCPU(i) {
							q = append(q, i)
						}
					}
					var left int64
					for k, i := range q {
						wantLeft := k%2 == 1 && left < leave
						if e.specLeave[i] != wantLeft {
							t.Fatalf("qualifying subgroups %v (last first): subgroup %d left %v, want %v", q, i, e.specLeave[i], wantLeft)
						}
						if wantLeft {
							left += e.sizes[i]
						}
					}
					if len(q) >= 2 && left == 0 {
						t.Fatalf("qualifying subgroups %v: none left for %d parameters", q, leave)
					}
				})
			}
		}
	}
}

// TestSpeculateNoHeld: with nothing that qualifies (no host-held
// subgroup and no CPU gradient that Prefetch moved: it was not called) or
// without saves, Speculate and EndSpeculation do nothing, and a negative
// budget is refused.
func TestSpeculateNoHeld(t *testing.T) {
	d := NewSim(SimOptions{})
	p := heldProblem(adam.BF16, 1, 3, -1)
	for _, tc := range []struct {
		held   []bool
		budget int64
	}{{make([]bool, len(heldSizes)), 1 << 30}, {heldPatterns[1], 0}} {
		e := specEngine(t, d, p, tc.held, perfmodel.Schedule{CPU: len(heldSizes) - countHeld(tc.held)}, tc.budget)
		s, _ := d.NewStream()
		cs := make([]adam.Coeffs, len(heldSizes))
		for i := range cs {
			cs[i] = adam.DefaultHyper().Coeffs(1, 1, 1)
		}
		if err := e.Speculate(s, 0, cs); err != nil {
			t.Fatal(err)
		}
		if kept, err := e.EndSpeculation(cs); kept != 0 || err != nil {
			t.Fatalf("held %v budget %d: kept %d, %v", tc.held, tc.budget, kept, err)
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
	}
	plan, _ := NewHeldPlan(heldPatterns[1], perfmodel.Schedule{CPU: 4})
	if _, err := New(Options{Device: d, Sizes: heldSizes, GradDType: adam.BF16, WorkingDType: adam.BF16, Plan: plan,
		HostHeld: heldPatterns[1], Speculate: -1}); err == nil {
		t.Fatal("Options.Speculate -1 accepted")
	}
}

// checkSpecTrace: the phase's Trace shows the kept speculative updates
// (before the phase: negative times), and after a step that clipped the
// undone ones, each with its restore after it.
func checkSpecTrace(t *testing.T, e *Engine, k int, kept, keptGPU int64, undone bool) {
	t.Helper()
	ops, err := e.Trace()
	if err != nil {
		t.Fatal(err)
	}
	var keptN, keptGPUN, undoneN, restores int64
	for _, o := range ops {
		switch o.What {
		case SpeculativeKept, SpeculativeKeptGPU:
			if o.What == SpeculativeKept {
				keptN += o.Bytes
			} else {
				keptGPUN += o.Bytes
			}
			if o.Start >= 0 || o.End > 0 {
				t.Errorf("step %d: kept speculative update (%s) of subgroup %d at [%v, %v], not before the phase", k, o.What, o.Subgroup, o.Start, o.End)
			}
		case SpeculativeUndone, SpeculativeUndoneGPU:
			undoneN++
		case SpeculativeRestore:
			restores++
		}
	}
	if keptN != kept || keptGPUN != keptGPU {
		t.Errorf("step %d: Trace shows %d+%d kept speculative parameters, EndSpeculation kept %d+%d", k, keptN, keptGPUN, kept, keptGPU)
	}
	some := false // anything to speculate on
	for i := range e.sizes {
		some = some || e.held[i] || e.specCPU(i) || (e.specGPUOn() && e.specOnGPU(i))
	}
	if undoneN != restores || (undone && e.specN > 0 && some && undoneN == 0) {
		t.Errorf("step %d: Trace shows %d undone speculative updates and %d restores (clipping: %v)", k, undoneN, restores, undone)
	}
}

// TestSameCoeffsFields: sameCoeffs compares every field of adam.Coeffs (a
// field added there and not here would let a speculation with other
// scalars be kept), and tells -0 from +0.
func TestSameCoeffsFields(t *testing.T) {
	if n := reflect.TypeOf(adam.Coeffs{}).NumField(); n != 13 {
		t.Fatalf("adam.Coeffs has %d fields; sameCoeffs compares 13: compare the new ones too", n)
	}
	a := adam.DefaultHyper().Coeffs(3, 1, 1)
	b := a
	if !sameCoeffs(&a, &b) {
		t.Fatal("the same scalars differ")
	}
	b.NegStepSize = float32(math.Copysign(0, -1))
	a.NegStepSize = 0
	if sameCoeffs(&a, &b) {
		t.Fatal("-0 and +0 counted the same")
	}
}

// backwardIO returns a stream and an event on d for a test's backward and
// bytes of pinned host memory to copy its gradients from, all freed when
// the test ends.
func backwardIO(t testing.TB, d Device, bytes int64) (Stream, Event, Host) {
	t.Helper()
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.FreeStream(s) })
	ev, err := d.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.FreeEvent(ev) })
	h, err := d.AllocHost(bytes)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.FreeHost(h) })
	return s, ev, h
}

// TestStopThenSpeculate: after StopSpeculation a Speculate with other
// scalars starts nothing, and the subgroups already updated with the first
// ones are not taken for the second's: EndSpeculation with the second
// keeps nothing, and the step is the serial one.
func TestStopThenSpeculate(t *testing.T) {
	d := NewSim(SimOptions{})
	h := adam.DefaultHyper()
	p := heldProblem(adam.BF16, 1, 13, -1)
	want, wantCopy := specReference(p, h, []specCase{{}})
	held := heldPatterns[1]
	e := specEngine(t, d, p, held, perfmodel.Schedule{CPU: len(heldSizes) - countHeld(held)}, SpeculateBytes(1<<20, false))
	defer e.Close()
	bwd, ev, host := backwardIO(t, d, 2*e.total)
	b := p.gradBytes(0)
	copy(host.Bytes(), b)
	for i := len(e.sizes) - 1; i >= 0; i-- {
		putGrad(t, d, e, bwd, host, b, i)
	}
	cs1, cs2 := make([]adam.Coeffs, len(e.sizes)), make([]adam.Coeffs, len(e.sizes))
	h2 := h
	h2.LR *= 10
	for i := range cs1 {
		cs1[i], cs2[i] = h2.Coeffs(1, 1, 1), h.Coeffs(1, 1, 1)
	}
	if err := firstErr(e.Prefetch(bwd, 0), e.Speculate(bwd, 0, cs1), d.Record(ev, bwd), d.Sync(ev)); err != nil {
		t.Fatal(err)
	}
	e.WaitSpeculation()
	e.StopSpeculation()
	if err := e.Speculate(bwd, 0, cs2); err != nil {
		t.Fatal(err)
	}
	e.WaitSpeculation()
	if kept, err := e.EndSpeculation(cs2); err != nil || kept != 0 {
		t.Fatalf("EndSpeculation with the second scalars kept %d parameters updated with the first (%v)", kept, err)
	}
	if err := e.UpdatePer(cs2); err != nil {
		t.Fatal(err)
	}
	checkHeldRun(t, d, e, want, wantCopy)
}

// putGrad writes subgroup i's part of the flat bf16 gradient b (also in
// host, pinned, at the same offsets) where a trainer's backward would: a
// host-held subgroup's into HostGrad, another's H2D on bwd into the device
// gradients.
// speculateBackward is a backward with speculation over the flat
// gradient bytes b: each subgroup's gradient written, the last first, then
// Prefetch (with prefetch) and Speculate with cs; then it waits for bwd's
// work (ev).
func speculateBackward(t testing.TB, d Device, e *Engine, bwd Stream, ev Event, host Host, b []byte, cs []adam.Coeffs, prefetch bool) {
	t.Helper()
	copy(host.Bytes(), b)
	for i := len(e.sizes) - 1; i >= 0; i-- {
		putGrad(t, d, e, bwd, host, b, i)
		var err error
		if prefetch {
			err = e.Prefetch(bwd, e.off[i])
		}
		if err = firstErr(err, e.Speculate(bwd, e.off[i], cs)); err != nil {
			t.Fatal(err)
		}
	}
	if err := firstErr(d.Record(ev, bwd), d.Sync(ev)); err != nil {
		t.Fatal(err)
	}
}

func putGrad(t testing.TB, d Device, e *Engine, bwd Stream, host Host, b []byte, i int) {
	t.Helper()
	off, n := e.off[i], e.sizes[i]
	if e.HostHeld(i) {
		at, _ := e.HostOffset(off)
		copy(e.HostGrad().Bytes()[2*at:], b[2*off:2*(off+n)])
		return
	}
	at, _ := e.DeviceOffset(off)
	if err := d.H2D(bwd, e.grad, 2*at, host, 2*off, 2*n); err != nil {
		t.Fatal(err)
	}
}

// current returns a copy of the master state as HostState would hold it
// after DropSpeculation, each subgroup's from where it is (its home or a
// slot), leaving the engine as it is: a test compares it every step
// without moving the states home, so that the next steps speculate from
// the slots too.
func (e *Engine) current() adam.State {
	s := e.state.Clone()
	for i := range e.sizes {
		if w := e.where(i); w != homeLoc {
			lo, n := int(e.off[i]), int(e.sizes[i])
			dst := s.Slice(lo, lo+n)
			src := e.stateAt(i, w)
			copy(dst.Param, src.Param)
			copy(dst.ExpAvg, src.ExpAvg)
			copy(dst.ExpAvgSq, src.ExpAvgSq)
			copy(dst.MaxExpAvgSq, src.MaxExpAvgSq)
		}
	}
	return s
}

// TestSpeculateGPUShare: with the GPU speculation, CPU subgroups that
// never qualify (no Prefetch moved their gradients) do not keep the slots
// from the streamed subgroups step after step (markCPUNeed's claim
// follows what the CPU workers took), and every step is the serial one's
// (the engine against its own serial reference: checkHeldRun).
func TestSpeculateGPUShare(t *testing.T) {
	h := adam.DefaultHyper()
	cases := []specCase{{}, {}, {}, {}}
	p := heldProblem(adam.BF16, len(cases), 5, -1)
	want, wantCopy := specReference(p, h, cases)
	d := NewSim(SimOptions{})
	e := newHeld(t, d, p, nil, perfmodel.Schedule{CPU: 4, GPU: 4}, Options{Prefetch: true, Speculate: SpeculateBytes(100000, false), SpeculateGPU: true})
	defer e.Close()
	bwd, ev, host := backwardIO(t, d, 2*e.total)
	cs := make([]adam.Coeffs, len(e.sizes))
	for k := range cases {
		for i := range cs {
			cs[i] = h.Coeffs(int64(k+1), 1, 1)
		}
		speculateBackward(t, d, e, bwd, ev, host, p.gradBytes(k), cs, false) // no Prefetch: no CPU subgroup qualifies
		e.WaitSpeculation()
		kept, err := e.EndSpeculation(cs)
		if err != nil {
			t.Fatal(err)
		}
		if kept != 0 {
			t.Fatalf("step %d: the CPU workers kept %d parameters without a Prefetch", k, kept)
		}
		if k > 0 && e.SpeculatedGPU() == 0 {
			t.Errorf("step %d: the GPU speculation kept nothing, with %d elements of slots and cpuNeed %d", k, e.specN, e.cpuNeed)
		}
		if err := e.UpdatePer(cs); err != nil {
			t.Fatal(err)
		}
	}
	checkHeldRun(t, d, e, want, wantCopy)
	if err := d.OrderErr(); err != nil {
		t.Fatal(err)
	}
}
