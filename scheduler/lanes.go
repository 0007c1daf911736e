package scheduler

import (
	"time"
	"unsafe"

	"github.com/deepstates/dos/adam"
)

// The lanes: Update executes the schedule core on the device. Each issuer
// (the GPU lane on Update's goroutine; the state D2H copies, the CPU lane's
// feed and its workers on three goroutines that live from New to Close)
// walks its steps in the core's order: it waits for each step's
// dependencies as the step says, then enqueues it (a CPU update runs it).
// An issuer that needs another's step first waits until that issuer has
// issued it (issued, under progMu).
//
// Every copy of one direction goes on one stream (e.s[sH2D], e.s[sD2H]),
// in the order enqueued, and is enqueued only when it can run: on separate
// streams the H200's copy engines served a stream that always had work
// queued before another, and a CPU subgroup's 16-bit copy waited 160 ms
// behind GPU subgroups' state (BENCHMARKS.md). laneMu keeps a copy with its
// waits and events together on its stream.

// runIssuer runs issuer l's steps once per message on e.start[l] until Close.
func (e *Engine) runIssuer(l issuer) {
	for range e.start[l] {
		e.issue(l)
		e.fin <- struct{}{}
	}
	e.fin <- struct{}{}
}

// issue runs issuer l's steps of this Update in order, until the lanes are
// stopped, then says it ended.
func (e *Engine) issue(l issuer) {
	e.acquire(handPhase)
	for _, k := range e.core.lanes[l] {
		if e.abort.Load() || !e.step(k) {
			break
		}
		e.publish(k)
		e.progMu.Lock()
		e.issued[l]++
		e.progMu.Unlock()
		e.progress.Broadcast()
	}
	e.progMu.Lock()
	e.ended[l] = true
	e.progMu.Unlock()
	e.progress.Broadcast()
}

// issuedYet waits until the step ds has been issued by its issuer and
// reports whether it was (false: that issuer stopped before it).
func (e *Engine) issuedYet(ds *step) bool {
	l := ds.issuer
	e.progMu.Lock()
	for e.issued[l] <= ds.seq && !e.ended[l] {
		e.progress.Wait()
	}
	ok := e.issued[l] > ds.seq
	e.progMu.Unlock()
	return ok
}

// step waits for what step k depends on, then enqueues it (runs it, for a
// CPU update) and marks its operation done after its last step. It reports
// success; a failure is recorded (fail) and stops the lanes.
func (e *Engine) step(k int32) bool {
	st := &e.core.steps[k]
	i, op := int(st.sub), int(st.op)
	if e.pre[i]&(1<<op) != 0 {
		return true // Prefetch issued it, with its events
	}
	for _, d := range st.waits() {
		ds := &e.core.steps[d.step]
		if ds.issuer != st.issuer {
			if !e.issuedYet(ds) {
				return false // its issuer stopped: the fault is recorded
			}
			e.acquire(d.step)
		}
		// A CPU update is done once issued.
		if d.how.host() && ds.queue != qCPU {
			if w := e.slotStep(d.step); w >= 0 && e.fail(i, op, e.wait(e.endEv[w])) {
				return false
			}
		}
	}
	if e.fail(i, op, e.exec(k, int(st.slot), true)) {
		return false
	}
	if st.last {
		e.done[i] |= 1 << op
	}
	return true
}

// slotStep returns the step whose end event a wait for step k waits on:
// k itself, but for a copy that a kept speculative update skips in this
// phase, the last copy before it from the same staging slot that the
// phase enqueues (-1: none). Two copies are skipped so:
//
//   - a CPU subgroup's copy H2D, which ran in the backward from the
//     slots' 16-bit part (specCopy): a CPU update writes its new working
//     copy into the copy staging slot once the copy two before it left
//     it;
//   - a streamed subgroup's state D2H, which ran in the backward
//     (specGPU): a streamed subgroup's state moves H2D into the device
//     staging slot once the state D2H two before it left it.
//
// With that copy skipped, its end event is the backward's, and the copy
// before it from the same slot, which this phase enqueued and its lane may
// not have run yet, would read the slot as it is overwritten (another
// subgroup's weights moved into a working copy on the device, or another
// subgroup's state into the host state). It allocates nothing.
func (e *Engine) slotStep(k int32) int32 {
	for k >= 0 {
		st := &e.core.steps[k]
		if (st.op != opCopyH2D && st.op != opD2H) || e.pre[st.sub]&(1<<st.op) == 0 {
			return k
		}
		k = e.core.slotPrev[k]
	}
	return -1
}

// exec enqueues step k with staging slot slot (runs it, for a CPU update):
// after the stream waits the step names when waits is set, between its
// operation's start event (first step) and its own end event.
func (e *Engine) exec(k int32, slot int, waits bool) error {
	st := &e.core.steps[k]
	i := int(st.sub)
	n := e.sizes[i]
	grad := Vec{Mem: e.grad, Off: e.doff[i], N: n}
	switch st.op {
	case opH2D, opD2H:
		if st.op == opD2H && st.first {
			e.waitGate(i) // the state D2H writes subgroup i's host state
		}
		return e.statePiece(k, st, slot, waits)
	case opKernel:
		merr, err := e.kernel(e.s[sKernel], k, slot, e.coeffs(i), waits)
		if err == nil {
			e.fail(i, int(st.op), merr)
		}
		return err
	case opUpcast:
		s := e.s[sUpcast]
		return firstErr(e.dev.Record(e.startEv[k], s), e.dev.Widen16(s, e.o.GradDType, Vec{Mem: e.scr, Off: int64(slot) * e.maxN, N: n}, grad), e.dev.Record(e.endEv[k], s))
	case opGradD2H:
		gb := elemBytes(e.cpuGD)
		src, srcOff := e.grad, gb*e.doff[i]
		if e.core.upcast {
			src, srcOff = e.scr, 4*int64(slot)*e.maxN
		}
		s := e.s[sD2H]
		e.laneMu[sD2H].Lock()
		defer e.laneMu[sD2H].Unlock()
		if waits {
			if err := e.streamWaits(s, st); err != nil {
				return err
			}
		}
		dst, dstOff := e.gradHost(i, slot)
		return firstErr(e.dev.Record(e.startEv[k], s), e.dev.D2H(s, dst, dstOff, src, srcOff, gb*n), e.dev.Record(e.endEv[k], s))
	case opCPU:
		e.cpu(i, slot)
		return nil
	case opCopyH2D:
		s := e.s[sH2D]
		e.laneMu[sH2D].Lock()
		defer e.laneMu[sH2D].Unlock()
		if waits {
			if err := e.streamWaits(s, st); err != nil {
				return err
			}
		}
		src, srcOff := e.cst, 2*int64(slot)*e.maxN
		if h, off, ok := e.specSource(i); ok {
			src, srcOff = h, off // a kept speculative update's copy
		}
		if err := firstErr(e.dev.Record(e.startEv[k], s), e.dev.H2D(s, e.work, 2*e.doff[i], src, srcOff, 2*n)); err != nil {
			return err
		}
		e.fail(i, int(st.op), e.copyMirror(i, s, Vec{}))
		return e.dev.Record(e.endEv[k], s)
	}
	panic("scheduler: unknown operation")
}

// kernel enqueues kernel step k with scalars c on s (the kernel stream, or
// the GPU speculation's): its
// subgroup's fused AdamW on the state in staging slot slot (a streamed
// subgroup) or the resident state, reading its device gradient and
// writing its working copy in place, after the step's stream waits when
// waits is set, between its start and end events, with its part of the
// mirror after the kernel. mirror is the mirror copy's error: the update
// was enqueued all the same (the lanes record it as the phase's fault,
// fail; the GPU speculation undoes the update).
func (e *Engine) kernel(s Stream, k int32, slot int, c *adam.Coeffs, waits bool) (mirror, err error) {
	st := &e.core.steps[k]
	i := int(st.sub)
	n := e.sizes[i]
	x := e.resState(i)
	if e.plan.Roles[i] == OnGPU {
		x = e.slotState(slot, i)
	}
	if waits {
		if err := e.streamWaits(s, st); err != nil {
			return nil, err
		}
	}
	grad := Vec{Mem: e.grad, Off: e.doff[i], N: n}
	if err := firstErr(e.dev.Record(e.startEv[k], s), e.dev.AdamW(s, c, x, e.o.GradDType, grad, e.o.WorkingDType, Vec{Mem: e.work, Off: e.doff[i], N: n})); err != nil {
		return nil, err
	}
	mirror = e.copyMirror(i, s, x.Param)
	return mirror, e.dev.Record(e.endEv[k], s)
}

// copyMirror enqueues on s the copies of subgroup i's updated master
// weights into the mirror (Options.Mirror): device to device from master
// (its N elements, on the device), or H2D from the host when master.Mem is
// nil, from where its state is (Engine.where: the host state, or a slot
// of the speculation's). It stops at the first copy that fails. In the lanes
// the subgroup's operation has been applied and must not run again, so
// they record that error as the phase's fault (fail) without failing the
// step, and complete refreshes the whole mirror.
func (e *Engine) copyMirror(i int, s Stream, master Vec) error {
	h, hOff := e.arrayHost(0, i, e.where(i)) // the master weights
	for _, p := range e.mpieces[i] {
		var err error
		if master.Mem != nil {
			err = e.dev.D2D(s, e.mirror, 4*p.at, master.Mem, 4*(master.Off+p.sub), 4*p.n)
		} else {
			err = e.dev.H2D(s, e.mirror, 4*p.at, h, hOff+4*p.sub, 4*p.n)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// streamWaits makes stream s wait for the steps st waits for on the
// device.
func (e *Engine) streamWaits(s Stream, st *step) error {
	for _, d := range st.waits() {
		if d.how.stream() {
			if w := e.slotStep(d.step); w >= 0 {
				if err := e.dev.Wait(s, e.endEv[w]); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// statePiece enqueues one piece of a state copy (step k) between the host
// state and staging slot slot, on its lane's stream under the lane's lock:
// after its stream waits, after the operation's start event when first,
// then its end event.
func (e *Engine) statePiece(k int32, st *step, slot int, waits bool) error {
	l := int(st.queue)
	s := e.s[l]
	e.laneMu[l].Lock()
	defer e.laneMu[l].Unlock()
	if waits {
		if err := e.streamWaits(s, st); err != nil {
			return err
		}
	}
	return e.pieceOn(s, k, st, slot)
}

// pieceOn enqueues state copy step k on s with staging slot slot, after
// the operation's start event when first, then its end event. The host
// side is where the subgroup's state is (Engine.loc) for an H2D, and
// where its update writes it (Engine.where) for a D2H: the same place in
// the phase, which updates a streamed subgroup in place; a speculative
// update's new place in the GPU speculation (specGPU).
func (e *Engine) pieceOn(s Stream, k int32, st *step, slot int) error {
	a, i := int(st.array), int(st.sub)
	at := e.where(i)
	if st.op == opH2D && e.loc != nil {
		at = e.loc[i]
	}
	h, off := e.arrayHost(a, i, at)
	off += st.off
	dev := 4*int64(slot)*e.maxN + st.off
	if st.first {
		if err := e.dev.Record(e.startEv[k], s); err != nil {
			return err
		}
	}
	var err error
	if st.op == opH2D {
		err = e.dev.H2D(s, e.stage[a], dev, h, off, st.amount)
	} else {
		err = e.dev.D2H(s, h, off, e.stage[a], dev, st.amount)
	}
	return firstErr(err, e.dev.Record(e.endEv[k], s))
}

// cpu updates CPU subgroup i on the host from gradient slot slot, writing
// its copy into copy slot slot; a host-held subgroup from its own gradient
// into its own working copy (HostGrad, HostWorking).
func (e *Engine) cpu(i, slot int) {
	n := e.sizes[i]
	var g adam.Grad
	var out adam.Copy16
	if e.held[i] {
		g = e.heldGrad(e.hoff[i], n)
		out = adam.Copy16{DType: e.o.WorkingDType, Data: e.heldWork(e.hoff[i], n)}
	} else {
		h, off := e.gradHost(i, slot)
		g = hostGrad(h, e.cpuGD, off/elemBytes(e.cpuGD), n)
		if e.hostCheck != nil { // the simulated device's ordering check
			e.hostCheck.HostAccess(h, off, elemBytes(e.cpuGD)*n, false)
			e.hostCheck.HostAccess(e.cst, 2*int64(slot)*e.maxN, 2*n, true)
		}
		cs := e.cst.Bytes()
		out = adam.Copy16{DType: e.o.WorkingDType, Data: unsafe.Slice((*uint16)(unsafe.Pointer(&cs[2*int64(slot)*e.maxN])), n)}
	}
	e.waitGate(i) // the update writes subgroup i's state in place (in the host state, or its slot: StateOf)
	e.cpuT[i][0] = time.Since(e.t0)
	e.pool.Step(e.coeffs(i), e.stateAt(i, e.where(i)), g, out)
	e.cpuT[i][1] = time.Since(e.t0)
}

// gradHost returns where CPU subgroup i's gradient is on the host: its own
// place in the prefetch memory when Prefetch moves it (Options.Prefetch),
// else host staging slot slot.
func (e *Engine) gradHost(i, slot int) (Host, int64) {
	if e.pre[i]&(1<<opGradD2H) != 0 {
		return e.gpre, e.gpOff[i]
	}
	return e.gst, elemBytes(e.cpuGD) * int64(slot) * e.maxN
}
