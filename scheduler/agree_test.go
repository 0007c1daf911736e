package scheduler

import (
	"fmt"
	"slices"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestEngineAgreesWithReplay: the engine, on the simulated device, and the
// replay issue the same operations in the same dependency order: those of
// the schedule core.
//
// The engine is watched from outside, through the simulated device's log:
// each device step records its own end event right after its copy or
// launch, so the call before that Record on its stream is the step's; a
// CPU update shows as Hold's gate, called just before it. The test checks
// that every step of the core was issued once, with the buffers, offsets
// and sizes the step names; that each issuer issued its steps in the
// core's order; that each step came after every step it depends on, with
// a host Sync of that step's end event before it where the core says
// "host" (the throttle included) and a Wait of its stream on that event
// where it says "stream"; that the device saw nothing out of order. Then
// the replay of the same core starts no step before every step it depends
// on has ended, and Simulate's operations are the engine's trace's.
func TestEngineAgreesWithReplay(t *testing.T) {
	n := testTotal()
	for _, x := range []struct {
		gd    adam.DType
		ams   bool
		chunk int64
	}{{adam.BF16, false, 1024}, {adam.F32, true, 0}, {adam.BF16, true, 3000}} {
		p := newProblem(n, x.gd, x.ams, 1, 8)
		for _, s := range schedules(len(testSizes)) {
			t.Run(fmt.Sprintf("%v/amsgrad=%v/chunk=%d/%+v", x.gd, x.ams, x.chunk, s), func(t *testing.T) {
				testAgreement(t, p, s, x.ams, x.chunk)
			})
		}
	}
}

func testAgreement(t *testing.T, p *problem, s perfmodel.Schedule, ams bool, chunk int64) {
	d := NewSim(SimOptions{})
	plan, err := NewPlan(len(testSizes), s)
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Device: d, Sizes: testSizes, GradDType: p.gd, WorkingDType: adam.BF16, AMSGrad: ams, Plan: plan, copyChunk: chunk})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	put(t, d, e.grad, 0, p.gradBytes(0))
	e.Hold(func(i int) {
		d.mu.Lock()
		d.logCall(simCall{kind: simNote, note: i})
		d.mu.Unlock()
	})
	d.mu.Lock()
	d.logging = true
	d.mu.Unlock()
	hh := adam.DefaultHyper()
	hh.AMSGrad = ams
	c := hh.Coeffs(1, 1, 1)
	if err := e.Update(&c); err != nil {
		t.Fatal(err)
	}
	d.mu.Lock()
	log := d.log
	d.logging, d.log = false, nil
	d.mu.Unlock()
	if err := d.OrderErr(); err != nil {
		t.Fatal(err)
	}

	co := e.core
	steps := co.steps
	stepOf := map[*simEvent]int32{} // each step's end event
	for k, ev := range e.endEv {
		if ev != nil {
			stepOf[ev.(*simEvent)] = int32(k)
		}
	}
	cpuStep := map[int]int32{}
	for k, st := range steps {
		if st.queue == qCPU {
			cpuStep[int(st.sub)] = int32(k)
		}
	}
	// Where each step was issued in the log.
	at := make([]int, len(steps))
	for k := range at {
		at[k] = -1
	}
	var last [maxSimStreams]int // the last copy or launch on each stream, not yet attributed
	for i := range last {
		last[i] = -1
	}
	for x, call := range log {
		switch call.kind {
		case simH2D, simD2H, simAdamW, simWiden:
			last[call.stream] = x
		case simRecord:
			k, ok := stepOf[call.ev]
			if !ok {
				continue
			}
			if at[k] >= 0 {
				t.Fatalf("step %s issued twice", co.describe(k))
			}
			if last[call.stream] < 0 {
				t.Fatalf("step %s: its end event recorded after no copy or launch", co.describe(k))
			}
			if got, want := log[last[call.stream]], e.expectCall(k); got != want {
				t.Fatalf("step %s: the device saw %+v, want %+v", co.describe(k), got, want)
			}
			at[k], last[call.stream] = last[call.stream], -1
		case simNote:
			if k, ok := cpuStep[call.note]; ok {
				at[k] = x
			}
		}
	}
	waited := func(kind uint8, stream int, ev Event, before int) bool {
		for _, call := range log[:before] {
			if call.kind == kind && call.ev == ev.(*simEvent) && (kind == simSync || int(call.stream) == stream) {
				return true
			}
		}
		return false
	}
	for k := range steps {
		st := &steps[k]
		if at[k] < 0 {
			t.Fatalf("step %s not issued", co.describe(int32(k)))
		}
		for _, dp := range st.waits() {
			what := fmt.Sprintf("step %s, after #%d (%s)", co.describe(int32(k)), dp.step, waitNames[dp.how])
			if at[dp.step] >= at[k] {
				t.Fatalf("%s: issued at %d, before it (%d)", what, at[k], at[dp.step])
			}
			if steps[dp.step].queue == qCPU {
				continue // a CPU update is done when it returns
			}
			if dp.how.host() && !waited(simSync, 0, e.endEv[dp.step], at[k]) {
				t.Errorf("%s: no host wait", what)
			}
			if dp.how.stream() && !waited(simWait, int(e.s[st.queue].(*simStream).id), e.endEv[dp.step], at[k]) {
				t.Errorf("%s: no stream wait", what)
			}
		}
	}
	for l, lane := range co.lanes {
		for j := 1; j < len(lane); j++ {
			if at[lane[j]] <= at[lane[j-1]] {
				t.Errorf("issuer %s: %s issued before %s", issuerNames[l], co.describe(lane[j]), co.describe(lane[j-1]))
			}
		}
	}

	// The replay of the same steps.
	prof := simProfile(1e6, 1e7, 12e6, perfmodel.Contention{CPU: 1.5, PCIe: 1.2})
	uc, err := prof.CPURate(1, adam.F32)
	if err != nil {
		t.Fatal(err)
	}
	times, err := replayRates(co, uc, prof.GPU)
	if err != nil {
		t.Fatal(err)
	}
	for k := range steps {
		for _, dp := range steps[k].waits() {
			if times[k].start < times[dp.step].end {
				t.Errorf("replay: step %s starts at %g s, before #%d ends at %g s", co.describe(int32(k)), times[k].start, dp.step, times[dp.step].end)
			}
		}
	}
	// Simulate's operations are the engine's (replayed with CopyChunk
	// pieces: the bytes of an operation do not depend on them).
	sizes := make([]int64, len(testSizes))
	for i, n := range testSizes {
		sizes[i] = int64(n)
	}
	sim, err := Simulate(Machine{Profile: prof, Threads: 1}, SimWorkload{Sizes: sizes, GradDType: p.gd, AMSGrad: ams}, plan)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := e.Trace()
	if err != nil {
		t.Fatal(err)
	}
	if a, b := opSet(sim), opSet(eng); !slices.Equal(a, b) {
		t.Errorf("Simulate's operations\n%v\nthe engine's\n%v", a, b)
	}
}

// expectCall is the call the simulated device logs for step k.
func (e *Engine) expectCall(k int32) simCall {
	st := &e.core.steps[k]
	i, slot := int(st.sub), int64(st.slot)
	n := e.sizes[i]
	id := e.s[st.queue].(*simStream).id
	switch st.op {
	case opH2D:
		return simCall{kind: simH2D, stream: id, dst: e.stage[st.array], src: e.host[st.array], dstOff: 4*slot*e.maxN + st.off, srcOff: 4*e.off[i] + st.off, n: st.amount}
	case opD2H:
		return simCall{kind: simD2H, stream: id, dst: e.host[st.array], src: e.stage[st.array], dstOff: 4*e.off[i] + st.off, srcOff: 4*slot*e.maxN + st.off, n: st.amount}
	case opKernel:
		if st.slot < 0 {
			return simCall{kind: simAdamW, stream: id, dst: e.res[0], src: e.grad, dstOff: e.resOff[i], srcOff: e.off[i], n: n}
		}
		return simCall{kind: simAdamW, stream: id, dst: e.stage[0], src: e.grad, dstOff: slot * e.maxN, srcOff: e.off[i], n: n}
	case opUpcast:
		return simCall{kind: simWiden, stream: id, dst: e.scr, src: e.grad, dstOff: slot * e.maxN, srcOff: e.off[i], n: n}
	case opGradD2H:
		gb := e.core.cpuGradB
		if e.core.upcast {
			return simCall{kind: simD2H, stream: id, dst: e.gst, src: e.scr, dstOff: gb * slot * e.maxN, srcOff: 4 * slot * e.maxN, n: gb * n}
		}
		return simCall{kind: simD2H, stream: id, dst: e.gst, src: e.grad, dstOff: gb * slot * e.maxN, srcOff: gb * e.off[i], n: gb * n}
	case opCopyH2D:
		return simCall{kind: simH2D, stream: id, dst: e.work, src: e.cst, dstOff: 2 * e.off[i], srcOff: 2 * slot * e.maxN, n: 2 * n}
	}
	panic("no device call")
}

// opSet lists ops without their times, sorted.
func opSet(ops []Op) []string {
	var s []string
	for _, o := range ops {
		s = append(s, fmt.Sprintf("%d %s %s %d", o.Subgroup, o.What, o.Resource, o.Bytes))
	}
	slices.Sort(s)
	return s
}
