package scheduler

import (
	"fmt"
	"math"
	"sync"
	"time"
	"unsafe"

	"github.com/deepstates/dos/adam"
)

// Speculation: updates started during the trainer's backward, before the
// global checks, with the scalars the step will most likely have (no
// clipping, the last step's loss scale), then kept or undone when the
// step's real scalars are known (DeepSpeed's SuperOffload calls this
// speculation-then-validation). Two kinds of subgroup qualify, those the
// CPU workers update from a gradient already on the host:
//
//   - a host-held subgroup (Options.HostHeld): its gradient lands in pinned
//     host memory as its block's backward ends, and nothing on the device
//     reads its state; its working copy is updated in place, the old one
//     saved;
//   - a CPU subgroup whose gradient Prefetch moved into its own pinned
//     place (Options.Prefetch, no upcast on the GPU): once that copy is
//     done; its new working copy goes to the saves' pinned 16-bit part,
//     from which it moves H2D into the device working copy at once, with
//     its mirror part (specCopy): its block's backward is over, so nothing
//     of the iteration reads those weights again, and a kept update's
//     phase has no copy left to do; a restore copies the old working copy
//     back.
//
// Before updating, the workers copy the state the update overwrites (and a
// held subgroup's working copy) into the saves (Options.Speculate bytes of
// host memory, 14 bytes a parameter, 18 with amsgrad). When the step's
// scalars are known (EndSpeculation), a subgroup speculated with exactly
// those scalars is kept: the next Update skips its update (and its
// gradient's copy), and its update is the serial phase's bit for bit (the
// same kernel on the same operands). Any other subgroup (a skipped step,
// clipping, another rate) gets its saved state back, bit for bit, and the
// phase updates it as before. So the committed bits are always the serial
// step's.
//
// The workers take the final subgroups from the last one down, as the
// backward makes them final, each that still fits in the saves; what they
// did not take is the phase's. The lazy checkpoint's gate (Hold) is kept: a
// speculative update of subgroup i waits for the capture of subgroup i.

// specReq is one Speculate call's news for the worker: the subgroups
// inside [ready, total) are final once event ev (recorded on the trainer's
// stream) is done. A request with stop set is EndSpeculation's barrier.
type specReq struct {
	ready int64
	ev    int // index into specEv
	stop  bool
}

// allocSpec makes the saves (Options.Speculate bytes, cut to whole
// parameters) and starts the speculation worker, when Options.Speculate >
// 0 and some subgroup may be speculated on: a host-held one, or with
// Options.Prefetch a CPU subgroup (whose gradient Prefetch brings to the
// host during the backward).
func (e *Engine) allocSpec() error {
	if e.o.Speculate < 0 {
		return fmt.Errorf("scheduler: Options.Speculate %d: want bytes >= 0", e.o.Speculate)
	}
	if e.o.Speculate == 0 || (e.heldN == 0 && e.gpre == nil) {
		return nil // nothing would qualify: no held subgroup, no CPU gradient moved by Prefetch
	}
	n := min(e.o.Speculate/SpeculateBytes(1, e.nArr == 4), e.total)
	if n == 0 {
		return nil
	}
	n0 := len(e.sizes)
	// One event and one request per subgroup at most per phase, and the
	// barrier.
	e.specEv = make([]Event, n0+1)
	for k := range e.specEv {
		ev, err := e.dev.NewEvent()
		if err != nil {
			return err
		}
		e.specEv[k] = ev
		e.allocs = append(e.allocs, ev)
	}
	e.specAt, e.specC, e.specT = make([]int64, n0), make([]adam.Coeffs, n0), make([][2]time.Time, n0)
	e.specUndo, e.specUndoLast = make([]specUndo, 0, n0), make([]specUndo, 0, n0)
	e.specCan, e.specCopied = make([]bool, n0), make([]bool, n0)
	for i := range e.specAt {
		e.specAt[i] = -1
	}
	e.specSave = adam.State{Param: make([]float32, n), ExpAvg: make([]float32, n), ExpAvgSq: make([]float32, n)}
	if e.nArr == 4 {
		e.specSave.MaxExpAvgSq = make([]float32, n)
	}
	// The 16-bit part in pinned memory: a CPU subgroup's new working copy
	// moves H2D from it in the phase (a host-held one's old copy is saved
	// there).
	h, err := e.dev.AllocHost(2 * n)
	if err != nil {
		return fmt.Errorf("scheduler: Options.Speculate's %d bytes of pinned memory: %w", 2*n, err)
	}
	e.allocs = append(e.allocs, h)
	e.specOutH = h
	e.specOut = unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(h.Bytes()))), n)
	// Mapped now, on every core, not by the first speculative updates
	// (12 GiB of saves took the first iterations 0.3 to 0.7 s more on
	// the H100).
	var wg sync.WaitGroup
	for _, a := range [][]float32{e.specSave.Param, e.specSave.ExpAvg, e.specSave.ExpAvgSq, e.specSave.MaxExpAvgSq} {
		prefault(&wg, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(a))), 4*len(a)), e.pool.Threads())
	}
	wg.Wait()
	e.specReq = make(chan specReq, n0+2)
	e.specReady, e.specCovered = e.total, len(e.sizes)
	e.specAck = make(chan struct{})
	go e.specWorker(e.specReq)
	e.specIdle = true
	e.specN = n // last: speculation is on once the worker runs
	return nil
}

// specCPU reports whether subgroup i, not host-held, may be speculated on:
// a CPU subgroup of the plan whose gradient Prefetch moves to the host
// (Options.Prefetch, no upcast on the GPU).
func (e *Engine) specCPU(i int) bool {
	return !e.held[i] && e.gpre != nil && e.plan.Roles[i] == OnCPU
}

// SpeculateBytes is the host memory Options.Speculate needs to speculate on
// n parameters: what their update overwrites, 14 bytes a parameter (p,
// exp_avg, exp_avg_sq in fp32 and the 16-bit working copy), 18 with
// amsgrad.
func SpeculateBytes(n int64, amsgrad bool) int64 {
	if amsgrad {
		return 18 * n
	}
	return 14 * n
}

// Speculate starts, in the background on the CPU workers, the updates of
// the host-held subgroups, and of the CPU subgroups whose gradient copy an
// earlier Prefetch issued (each once that copy is done; call Prefetch
// first: a CPU subgroup this call covers without it is left to the
// phase), that lie inside [ready, total) and are not started yet, given
// that their gradients are final once the work
// enqueued on s so far is done, with cs[i] as subgroup i's scalars (the
// scalars the caller expects the step to have: clip factor 1, the last
// step's unscale). The first call after an Update, a drop or
// EndSpeculation fixes cs for the phase; later calls only add subgroups.
// It waits for nothing and allocates nothing: the workers wait for s's
// work, copy what each update overwrites into the saves
// (Options.Speculate) and update the subgroup in place, the last
// subgroups first, skipping any that no longer fits in the saves. Call
// EndSpeculation before the next Update, with that step's scalars. The
// gradients in [ready, total) must not change until then. Without
// Options.Speculate, or with nothing to speculate on, it does nothing.
//
// Errors: ErrBroken; ErrEngineClosed; ready outside [0, total]; len(cs)
// other than the subgroup count; an event that could not be recorded.
func (e *Engine) Speculate(s Stream, ready int64, cs []adam.Coeffs) error {
	switch {
	case e.broken:
		return ErrBroken
	case !e.running:
		return ErrEngineClosed
	case ready < 0 || ready > e.total:
		return fmt.Errorf("scheduler: Speculate: ready %d is outside [0, %d]", ready, e.total)
	case len(cs) != len(e.sizes):
		return fmt.Errorf("scheduler: Speculate with %d coefficients for %d subgroups", len(cs), len(e.sizes))
	case e.specN == 0 || e.specHalted || ready >= e.specReady:
		return nil
	}
	if !e.specOn {
		copy(e.specC, cs)
		e.specOn = true
	}
	e.specReady = ready
	// A request only for a suffix with a qualifying subgroup not asked for
	// yet (at most one per subgroup and phase: the channel never fills).
	// Which of them qualify is decided here, on the caller's goroutine,
	// after its Prefetch: a CPU subgroup only once its gradient's copy was
	// issued (and its end event recorded), never what a later Prefetch
	// issues (the worker would read the gradient before it lands).
	news := false
	for e.specCovered > 0 && e.off[e.specCovered-1] >= ready {
		e.specCovered--
		c := e.specCovered
		e.specCan[c] = e.held[c] || (e.specCPU(c) && e.pre[c]&(1<<opGradD2H) != 0)
		news = news || e.specCan[c]
	}
	if !news {
		return nil
	}
	ev := e.specEv[e.specNext]
	if err := e.dev.Record(ev, s); err != nil {
		return err
	}
	e.specReq <- specReq{ready: ready, ev: e.specNext}
	e.specIdle = false
	e.specNext = (e.specNext + 1) % len(e.specEv)
	return nil
}

// specWorker runs the requests of Speculate on reqs until Close closes
// it (a parameter: Close sets the field to nil).
func (e *Engine) specWorker(reqs <-chan specReq) {
	for r := range reqs {
		if r.stop {
			e.specAck <- struct{}{}
			continue
		}
		if e.specStop.Load() {
			continue
		}
		if e.dev.Sync(e.specEv[r.ev]) != nil {
			// The device faulted: the phase finds it (nothing of this
			// subgroup changed).
			e.specStop.Store(true)
			continue
		}
		for i := len(e.sizes) - 1; i >= 0 && e.off[i] >= r.ready; i-- {
			if e.specStop.Load() {
				break
			}
			n := e.sizes[i]
			if e.specAt[i] >= 0 || e.specUsed+n > e.specN {
				continue
			}
			if !e.specCan[i] {
				continue
			}
			var g adam.Grad
			at, lo := e.specUsed, e.off[i]
			out := adam.Copy16{DType: e.o.WorkingDType, Data: e.specOut[at : at+n]}
			var saveOut []uint16
			switch {
			case e.held[i]:
				// In place: the new working copy over the old, saved.
				g, out.Data, saveOut = e.heldGrad(e.hoff[i], n), e.heldWork(e.hoff[i], n), e.specOut[at:at+n]
			default: // a CPU subgroup whose gradient's copy Prefetch issued
				// From the gradient Prefetch moved into the subgroup's own
				// place, once that copy is done; the new working copy into
				// the saves' pinned 16-bit part, which the phase copies H2D.
				if e.dev.Sync(e.endEv[e.core.opSteps[i][opGradD2H][1]]) != nil {
					e.specStop.Store(true)
					continue
				}
				g = hostGrad(e.gpre, e.cpuGD, e.gpOff[i]/elemBytes(e.cpuGD), n)
			}
			e.waitGate(i) // the update writes subgroup i's host state in place
			e.specT[i][0] = time.Now()
			e.pool.StepSave(&e.specC[i], e.state.Slice(int(lo), int(lo+n)), g, out, e.specSave.Slice(int(at), int(at+n)), saveOut)
			e.specT[i][1] = time.Now()
			e.specAt[i], e.specUsed = at, at+n
			if !e.held[i] {
				// Its working copy H2D now, during the backward: the
				// phase then skips the copy if it keeps the update.
				if e.specCopy(i, at) != nil {
					e.specStop.Store(true) // the phase copies it (specSource), or restoreSpec
					continue
				}
				e.specCopied[i] = true
			}
		}
	}
}

// specCopy enqueues speculated CPU subgroup i's new working copy (the
// saves' 16-bit part from element at) H2D into the device working copy,
// and its mirror part from the host state, on the H2D lane between the
// copy step's start and end events, as Prefetch issues a step: its
// gradient's copy is done, which the trainer ordered after its block's
// backward, so nothing of this iteration reads those weights again. A
// phase that keeps the update skips its copy (EndSpeculation sets the
// step's done bit; WaitReady waits for the end event recorded here); a
// restore copies the old working copy back (restoreSpec).
func (e *Engine) specCopy(i int, at int64) error {
	k := e.core.opSteps[i][opCopyH2D]
	s := e.s[sH2D]
	e.laneMu[sH2D].Lock()
	defer e.laneMu[sH2D].Unlock()
	return firstErr(e.dev.Record(e.startEv[k[0]], s), e.dev.H2D(s, e.work, 2*e.doff[i], e.specOutH, 2*at, 2*e.sizes[i]),
		e.copyMirror(i, s, Vec{}), e.dev.Record(e.endEv[k[1]], s))
}

// WaitSpeculation waits until the CPU workers have run what every
// Speculate so far asked (each final subgroup updated, while the saves
// lasted), so that what EndSpeculation keeps does not depend on timing
// (tests). Without Options.Speculate it does nothing.
func (e *Engine) WaitSpeculation() {
	if e.specN > 0 && e.specReq != nil && !e.specIdle {
		e.specReq <- specReq{stop: true}
		<-e.specAck
	}
}

// stopSpec stops the worker after the subgroup it is updating, if any,
// and waits for it; the worker then takes requests again. After Close
// (no worker) it does nothing.
func (e *Engine) stopSpec() {
	e.haltSpec()
	e.specOn, e.specHalted, e.specReady, e.specCovered = false, false, e.total, len(e.sizes)
	clear(e.specCan)
}

// haltSpec stops the worker after the subgroup it is updating and waits
// for it, changing nothing else. It does nothing when the worker has had
// no request since it last stopped (it idles) or after Close.
func (e *Engine) haltSpec() {
	if e.specReq == nil || e.specIdle {
		return
	}
	e.specStop.Store(true)
	e.specReq <- specReq{stop: true}
	<-e.specAck
	e.specStop.Store(false)
	e.specIdle = true
}

// StopSpeculation stops the CPU workers' speculation after the subgroup
// they are updating, if any, and keeps what they did for EndSpeculation:
// a caller whose backward has ended calls it, so that what is left is the
// phase's; Speculate then starts nothing more until EndSpeculation, a drop
// or the Update (it would fix other scalars for what was already
// updated). A speculative update moves about 1.4 times the memory of the
// phase's (it saves what it overwrites: 40 bytes a parameter against 28,
// adam.Pool.StepSave; 2.8 against 4.6 Gparam/s on an H100 host), so it
// pays only while the CPU would otherwise wait for the backward. Without a speculation it does
// nothing.
func (e *Engine) StopSpeculation() {
	if e.specN > 0 {
		e.haltSpec()
		e.specHalted = true
	}
}

// EndSpeculation ends the speculation of the coming step: the worker
// stops (the subgroup it is updating finishes), then each speculated
// subgroup whose scalars were cs[i], bit for bit, is kept for the next
// Update, which skips it (its update is done), and every other one gets
// its saved state and working copy back. cs nil keeps none (a skipped
// step). It returns how many parameters were kept. Without a speculation
// it does nothing. A drop (DropPrefetch, ZeroGrad, SetGrad, Load, Replan,
// Close) before the next Update undoes the kept ones too.
//
// Errors: len(cs) other than the subgroup count (nothing is kept then:
// every speculated subgroup is restored).
func (e *Engine) EndSpeculation(cs []adam.Coeffs) (kept int64, err error) {
	if e.specN == 0 {
		return 0, nil
	}
	e.stopSpec()
	if cs != nil && len(cs) != len(e.sizes) {
		err = fmt.Errorf("scheduler: EndSpeculation with %d coefficients for %d subgroups", len(cs), len(e.sizes))
		cs = nil
	}
	for i, at := range e.specAt {
		if at < 0 || e.pre[i]&(1<<opCPU) != 0 {
			continue
		}
		if cs != nil && sameCoeffs(&cs[i], &e.specC[i]) {
			e.pre[i] |= 1 << opCPU // done: the phase skips it (a drop undoes it: dropSpec)
			if e.specCopied[i] {
				e.pre[i] |= 1 << opCopyH2D // and its copy, enqueued during the backward
			}
			kept += e.sizes[i]
			continue
		}
		e.restoreSpec(i)
	}
	e.syncRecopies()
	if kept == 0 {
		e.specUsed = 0 // every save is free again
	}
	return kept, err
}

// sameCoeffs reports whether a and b are the same scalars bit for bit (a
// float == would take -0 for +0, which a step multiplies differently).
func sameCoeffs(a, b *adam.Coeffs) bool {
	f := func(x, y float32) bool { return math.Float32bits(x) == math.Float32bits(y) }
	return a.Step == b.Step && a.AMSGrad == b.AMSGrad && a.Maximize == b.Maximize &&
		f(a.Unscale, b.Unscale) && f(a.Clip, b.Clip) && f(a.Decay, b.Decay) && f(a.L2, b.L2) &&
		f(a.Beta1Weight, b.Beta1Weight) && f(a.Beta2, b.Beta2) && f(a.OneMinusB2, b.OneMinusB2) &&
		f(a.BC2Sqrt, b.BC2Sqrt) && f(a.Eps, b.Eps) && f(a.NegStepSize, b.NegStepSize)
}

// restoreSpec gives speculated subgroup i its saved state and working
// copy back and forgets its speculation.
func (e *Engine) restoreSpec(i int) {
	at, n, lo := e.specAt[i], e.sizes[i], e.off[i]
	var out, saveOut []uint16
	if e.held[i] {
		out, saveOut = e.heldWork(e.hoff[i], n), e.specOut[at:at+n]
	}
	t := time.Now()
	e.pool.Restore(e.state.Slice(int(lo), int(lo+n)), out, e.specSave.Slice(int(at), int(at+n)), saveOut)
	if e.specCopied[i] {
		// The device has the speculative working copy (specCopy): the
		// old one back, rounded from the restored master weights, as
		// the phase or the last Load wrote it, and the mirror's part.
		// Its caller waits for the copies once (syncRecopies).
		adam.Round16(e.o.WorkingDType, e.specOut[at:at+n], e.state.Param[lo:lo+n])
		if e.specCopy(i, at) != nil {
			e.broken = true // the device's copy is neither: restore from a checkpoint
		}
		e.specCopied[i], e.specRecopied = false, true
	}
	if len(e.specUndo) < cap(e.specUndo) { // for Trace: never allocates
		e.specUndo = append(e.specUndo, specUndo{sub: i, spec: e.specT[i], restore: [2]time.Time{t, time.Now()}})
	}
	e.specAt[i] = -1
	e.pre[i] &^= 1<<opCPU | 1<<opCopyH2D
}

// syncRecopies waits for the old working copies restoreSpec put back on
// the device, if any: the next reader may be the trainer's forward, which
// waits for no phase after a skipped step or a drop.
func (e *Engine) syncRecopies() {
	if !e.specRecopied {
		return
	}
	e.specRecopied = false
	e.laneMu[sH2D].Lock()
	defer e.laneMu[sH2D].Unlock()
	if firstErr(e.dev.Record(e.tail[sH2D], e.s[sH2D]), e.dev.Sync(e.tail[sH2D])) != nil {
		e.broken = true // the device's copy is neither: restore from a checkpoint
	}
}

// specUndo is a speculative update undone, for Trace: subgroup sub, when
// its update ran and when it was restored.
type specUndo struct {
	sub           int
	spec, restore [2]time.Time
}

// dropSpec undoes every speculated subgroup, kept ones too (a drop before
// the Update that would take them).
func (e *Engine) dropSpec() {
	if e.specN == 0 {
		return
	}
	e.stopSpec()
	e.restoreSpecs(true)
	e.specUsed = 0
	e.specUndo = e.specUndo[:0] // dropped, not validated: no phase of theirs to trace
}

// restoreSpecs gives every speculated subgroup its saved state back: only
// those EndSpeculation did not keep, or, with kept, those too.
func (e *Engine) restoreSpecs(kept bool) {
	for i, at := range e.specAt {
		if at >= 0 && (kept || e.pre[i]&(1<<opCPU) == 0) {
			e.restoreSpec(i)
		}
	}
	e.syncRecopies()
}

// DropSpeculation undoes every speculated subgroup, kept ones too: a
// caller about to read or write the host state before the next Update
// (a checkpoint, the master weights) calls it, so that it sees the last
// step's state. The prefetched copies stay. Without a speculation it does
// nothing.
func (e *Engine) DropSpeculation() { e.dropSpec() }

// settleSpec, at an Update's start, stops the worker and undoes what was
// speculated but not kept (a Speculate after EndSpeculation), so that only
// the kept subgroups carry their done bit into the phase.
func (e *Engine) settleSpec() {
	if e.specN == 0 {
		return
	}
	e.stopSpec()
	e.restoreSpecs(false)
}

// takeSpec is the Update's, once its phase runs: the kept subgroups are
// this phase's, their times before its start (negative); what was undone
// since the last phase is this one's too (Trace).
func (e *Engine) takeSpec() {
	if e.specN == 0 {
		return
	}
	e.specUndoLast = append(e.specUndoLast[:0], e.specUndo...)
	e.specUndo = e.specUndo[:0]
	for i, at := range e.specAt {
		if at >= 0 {
			e.cpuT[i] = [2]time.Duration{e.specT[i][0].Sub(e.t0), e.specT[i][1].Sub(e.t0)}
		}
	}
}

// endSpec is the end of an Update that took the kept subgroups: their
// saves are free again (the phase copied a CPU subgroup's new working
// copy from them).
func (e *Engine) endSpec() {
	if e.specN == 0 {
		return
	}
	for i := range e.specAt {
		e.specAt[i] = -1
	}
	clear(e.specCopied)
	e.specUsed = 0
}

// specSource returns where kept CPU subgroup i's new working copy is for
// its copy H2D: the saves' pinned 16-bit part (ok false when i was not
// kept: the copy staging then).
func (e *Engine) specSource(i int) (Host, int64, bool) {
	if e.specN == 0 || e.held[i] || e.specAt[i] < 0 || e.pre[i]&(1<<opCPU) == 0 {
		return nil, 0, false
	}
	return e.specOutH, 2 * e.specAt[i], true
}

// prefault writes a zero into every 4 KiB page of b (fresh, all-zero
// memory) on threads goroutines added to wg: the kernel maps the pages
// now instead of at their first write on the hot path.
func prefault(wg *sync.WaitGroup, b []byte, threads int) {
	const page = 4096
	pages := (len(b) + page - 1) / page
	per := max(1, (pages+threads-1)/max(threads, 1))
	for lo := 0; lo < pages; lo += per {
		hi := min(lo+per, pages)
		wg.Go(func() {
			for p := lo; p < hi; p++ {
				b[p*page] = 0
			}
		})
	}
}

// closeSpec stops the worker for good.
func (e *Engine) closeSpec() {
	if e.specReq != nil {
		close(e.specReq)
		e.specReq = nil
	}
}
