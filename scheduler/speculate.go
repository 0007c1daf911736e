package scheduler

import (
	"errors"
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
//     reads its state; its working copy is updated in place;
//   - a CPU subgroup whose gradient Prefetch moved into its own pinned
//     place (Options.Prefetch, no upcast on the GPU): once that copy is
//     done; its new working copy goes to the slots' pinned 16-bit part,
//     from which it moves H2D into the device working copy at once, with
//     its mirror part (specCopy): its block's backward is over, so nothing
//     of the iteration reads those weights again, and a kept update's
//     phase has no copy left to do; an undo copies the old working copy
//     back.
//
// A speculative update is out of place (adam.Pool.StepTo): it reads the
// subgroup's state where it is and writes the new state elsewhere, so the
// old state stays as it was until the update is validated. A subgroup's
// state is in the host state (HostState, its home) or in a slot of
// Options.Speculate's host memory (14 bytes a parameter, 18 with
// amsgrad): an update from home writes into a free slot, one from a slot
// writes home. When the step's scalars are known (EndSpeculation), a
// subgroup speculated with exactly those scalars is kept: the next Update
// skips its update (and its gradient's copy), and at the Update's end
// its state is where the speculation wrote it (its old slot free again).
// Its update is the serial phase's bit for bit (adam's StepTo is Step's).
// Any other subgroup (a skipped step, clipping, another rate) is undone
// by forgetting the new state (its old state never moved; an old working
// copy is rounded again from it), and the phase updates it as before,
// where it is. So the committed bits are always the serial step's, and a
// speculative update moves what the phase's would, 28 bytes a parameter
// (a copy-and-update in place, StepSave, moved 40).
//
// The workers take the final subgroups from the last one down, as the
// backward makes them final, each that has a free slot or goes home; what
// they did not take is the phase's, wherever its state is. A reader of
// the host state (a checkpoint, the master weights) calls
// DropSpeculation first, which moves every state home. The lazy
// checkpoint's gate (Hold) is kept: a speculative update that writes
// subgroup i's host state waits for the capture of subgroup i.

// homeLoc and noSpec are values of Engine.loc and Engine.specTo: a
// subgroup's state in the host state, and no speculative update.
const (
	homeLoc int64 = -1
	noSpec  int64 = -2
)

// slotAlign is the slots' alignment in elements (64 bytes): StepTo's
// kernel takes a destination whose arrays are aligned alike.
const slotAlign = 16

// specReq is one Speculate call's news for the worker: the subgroups
// inside [ready, total) are final once event ev (recorded on the trainer's
// stream) is done. A request with stop set is EndSpeculation's barrier.
type specReq struct {
	ready int64
	ev    int // index into specEv
	stop  bool
}

// allocSpec makes the slots (Options.Speculate bytes, cut to whole
// parameters) and starts the speculation worker, when Options.Speculate >
// 0 and some subgroup may be speculated on: a host-held one, or with
// Options.Prefetch a CPU subgroup (whose gradient Prefetch brings to the
// host during the backward).
func (e *Engine) allocSpec() error {
	if e.o.Speculate < 0 {
		return fmt.Errorf("scheduler: Options.Speculate %d: want bytes >= 0", e.o.Speculate)
	}
	if e.o.Speculate == 0 || (e.heldN == 0 && e.gpre == nil && !e.o.SpeculateGPU) {
		return nil // nothing would qualify: no held subgroup, no CPU gradient moved by Prefetch, no GPU speculation
	}
	n := min(e.o.Speculate/SpeculateBytes(1, e.nArr == 4), e.total+slotAlign*int64(len(e.sizes)))
	if n < slotAlign {
		return nil
	}
	n0 := len(e.sizes)
	// One event and one request per subgroup at most per phase, and the
	// barrier.
	e.specEv = make([]Event, n0+1)
	for k := range e.specEv {
		var err error
		if e.specEv[k], err = e.eventAlloc(&e.allocs); err != nil {
			return err
		}
	}
	e.specC, e.specT = make([]adam.Coeffs, n0), make([][2]time.Time, n0)
	e.specUndo, e.specUndoLast = make([]specUndo, 0, n0), make([]specUndo, 0, n0)
	e.specCan, e.specCopied, e.specDirty, e.specLeave, e.leftLast, e.specBad = make([]bool, n0), make([]bool, n0), make([]bool, n0), make([]bool, n0), make([]bool, n0), make([]bool, n0)
	e.loc, e.specTo = make([]int64, n0), make([]int64, n0)
	for i := range e.loc {
		e.loc[i], e.specTo[i] = homeLoc, noSpec
	}
	// The slots' master weights and 16-bit part in pinned memory: the
	// mirror's H2D reads the one, a CPU subgroup's new working copy moves
	// H2D from the other; with Options.SpeculateGPU every array, which the
	// GPU lane's copies read and write. The others are the CPU's alone
	// (Device.MapHost: huge pages where the host gives them, as the host
	// state's).
	arrays := []*[]float32{&e.slots.Param, &e.slots.ExpAvg, &e.slots.ExpAvgSq, &e.slots.MaxExpAvgSq}[:e.nArr]
	for a, v := range arrays {
		pinned := a == 0 || e.o.SpeculateGPU
		alloc := e.hostAlloc
		if !pinned {
			alloc = e.mapAlloc
		}
		h, err := alloc(&e.allocs, 4*n)
		if err != nil {
			return fmt.Errorf("scheduler: Options.Speculate's slots: %w", err)
		}
		if pinned {
			e.slotsH[a] = h
		}
		*v = unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(h.Bytes()))), n)
	}
	h, err := e.hostAlloc(&e.allocs, 2*n)
	if err != nil {
		return fmt.Errorf("scheduler: Options.Speculate's slots: %w", err)
	}
	e.specOutH = h
	e.specOut = unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(h.Bytes()))), n)
	// Mapped now, on every core, not by the first speculative updates
	// (12 GiB of slots took the first iterations 0.3 to 0.7 s more on
	// the H100).
	var wg sync.WaitGroup
	for _, a := range [][]float32{e.slots.ExpAvg, e.slots.ExpAvgSq, e.slots.MaxExpAvgSq} {
		prefault(&wg, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(a))), 4*len(a)), e.pool.Threads())
	}
	wg.Wait()
	e.specReq = make(chan specReq, n0+2)
	e.specReady, e.specCovered = e.total, len(e.sizes)
	e.specAck = make(chan struct{})
	if e.o.SpeculateGPU {
		if err := e.allocSpecGPU(); err != nil {
			return err
		}
		e.specReqG = make(chan specReq, n0+2)
		go e.specWorker(e.specReqG, e.specAck, true)
	}
	go e.specWorker(e.specReq, e.specAck, false)
	e.specIdle = true
	e.specN = n // last: speculation is on once the worker runs
	return nil
}

// stateAt returns subgroup i's state arrays at where: homeLoc (the host
// state) or a slot's first element.
func (e *Engine) stateAt(i int, where int64) adam.State {
	n := e.sizes[i]
	if where == homeLoc {
		return e.state.Slice(int(e.off[i]), int(e.off[i]+n))
	}
	return e.slots.Slice(int(where), int(where+n))
}

// arrayHost returns the pinned memory and byte offset of state array a
// (p, m, v, vmax) of subgroup i at where (stateAt): the host state's, or a
// slot's (pinned with Options.SpeculateGPU; Param's always).
func (e *Engine) arrayHost(a, i int, where int64) (Host, int64) {
	if where == homeLoc {
		return e.host[a], 4 * e.off[i]
	}
	return e.slotsH[a], 4 * where
}

// where returns where subgroup i's state is for the phase: where a kept
// speculative update wrote it, else where it was (homeLoc without
// Options.Speculate).
func (e *Engine) where(i int) int64 {
	if e.specN == 0 {
		return homeLoc
	}
	if t := e.specTo[i]; t != noSpec {
		return t
	}
	return e.loc[i]
}

// allocSlot returns the first element, a multiple of slotAlign, of the
// first n free elements in a row of the slots (ok false when there are
// none). A slot is in use while a subgroup's state is there or a
// speculative update wrote there. It allocates nothing; its cost, a pass
// over the subgroups per run in use it steps over, is small beside an
// update of n elements.
func (e *Engine) allocSlot(n int64) (at int64, ok bool) {
	for at+n <= e.specN {
		end := int64(-1) // the end of the last run in use that overlaps [at, at+n)
		for i, l := range e.loc {
			for _, u := range [2]int64{l, e.specTo[i]} {
				if u >= 0 && u < at+n && at < u+e.sizes[i] {
					end = max(end, u+e.sizes[i])
				}
			}
		}
		if end < 0 {
			return at, true
		}
		at = (end + slotAlign - 1) / slotAlign * slotAlign
	}
	return 0, false
}

// home moves every state a kept speculative update left in a slot back
// into the host state (after the gate: it writes there), on the pool's
// workers. No speculative update may be pending (dropSpec first).
func (e *Engine) home() {
	if !e.running {
		return // closed: the slots are freed, and nothing reads the state again
	}
	for i, l := range e.loc { // nil without Options.Speculate
		if l == homeLoc {
			continue
		}
		e.waitGate(i)
		e.pool.Restore(e.stateAt(i, homeLoc), nil, e.stateAt(i, l), nil)
		e.loc[i] = homeLoc
	}
}

// specCPU reports whether subgroup i, not host-held, may be speculated on:
// a CPU subgroup of the plan whose gradient Prefetch moves to the host
// (Options.Prefetch, no upcast on the GPU).
func (e *Engine) specCPU(i int) bool {
	return !e.held[i] && e.gpre != nil && e.plan.Roles[i] == OnCPU
}

// SpeculateBytes is the host memory Options.Speculate needs to speculate on
// n parameters: the slots their new state goes to, 14 bytes a parameter
// (p, exp_avg, exp_avg_sq in fp32 and the 16-bit working copy), 18 with
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
// phase), and with Options.SpeculateGPU on the GPU those of the streamed
// subgroups (speculate_gpu.go), that lie inside [ready, total) and are
// not started yet, given
// that their gradients are final once the work
// enqueued on s so far is done, with cs[i] as subgroup i's scalars (the
// scalars the caller expects the step to have: clip factor 1, the last
// step's unscale). The first call after an Update, a drop or
// EndSpeculation fixes cs for the phase; later calls only add subgroups.
// It waits for nothing and allocates nothing: the workers wait for s's
// work and update each subgroup out of place (from home into a free slot
// of Options.Speculate's, or from its slot home), the last subgroups
// first, skipping any that finds no free slot. Call
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
	if e.specGPUOn() && !e.preOn {
		// The GPU speculation's steps are timed from preBase (Trace), as
		// Prefetch's: a caller may speculate without prefetching.
		if err := e.dev.Record(e.preBase, s); err != nil {
			return err
		}
		e.preOn = true
	}
	if !e.specOn {
		copy(e.specC, cs)
		e.specOn = true
		e.markLeave()
		e.markCPUNeed()
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
		e.specCan[c] = !e.specLeave[c] && (e.held[c] || (e.specCPU(c) && e.pre[c]&(1<<opGradD2H) != 0) || e.specGPUOK(c))
		news = news || e.specCan[c]
	}
	if !news {
		return nil
	}
	ev := e.specEv[e.specNext]
	if err := e.dev.Record(ev, s); err != nil {
		return err
	}
	// Each request its own key: what the caller learns after sending it
	// (a Sync of the backward) is not the worker's when it takes it.
	e.publish(specKey(e.specNext))
	e.specReq <- specReq{ready: ready, ev: e.specNext}
	if e.specReqG != nil {
		e.specReqG <- specReq{ready: ready, ev: e.specNext}
	}
	e.specIdle = false
	e.specNext = (e.specNext + 1) % len(e.specEv)
	return nil
}

// SetSpeculateLeave has the speculation leave about n parameters of the
// model's last subgroups to the phase: of the subgroups the CPU workers
// update (host-held, and the plan's CPU subgroups), every other one from
// the last up (the last itself stays speculable, so the workers have work
// as soon as the backward's first gradients are final), until those left
// hold n parameters. The first Speculate after an Update or a drop marks
// them, under the plan of that moment. The phase updates them as it
// updates any subgroup the speculation did not reach: the CPU subgroups
// in the CPU lane's order (after the host-held ones, so a left CPU
// subgroup of the last blocks is among the phase's last CPU work), the
// host-held ones first. The next forward, which waits for each block's
// weights, then runs through the blocks before them while the CPU works,
// where it would otherwise run the blocks after the phase's last CPU
// update with the CPU idle until the next backward's first gradients
// (issue 31, item 2). Which subgroups are updated when changes no bit: a
// subgroup left to the phase is updated there as if it had never been
// speculated on. n <= 0 (the default) leaves none. Without
// Options.Speculate it does nothing.
func (e *Engine) SetSpeculateLeave(n int64) {
	e.specLeaveN = max(n, 0)
}

// PhaseCPUEnd returns the element of the flat space where the last update
// phase's own CPU work ended: the end of the last subgroup the CPU workers
// updated in that phase (a host-held or a CPU subgroup), leaving out those
// a kept speculative update had done before it and those
// SetSpeculateLeave left to it; 0 when it updated none so. The next
// forward runs the blocks after it once that work is done. ok is false
// when no phase ran since New or the last Replan.
func (e *Engine) PhaseCPUEnd() (end int64, ok bool) {
	if !e.updated {
		return 0, false
	}
	for i := len(e.sizes) - 1; i >= 0; i-- {
		if (e.held[i] || e.plan.Roles[i] == OnCPU) && e.preLast[i]&(1<<opCPU) == 0 && (e.leftLast == nil || !e.leftLast[i]) {
			return e.off[i] + e.sizes[i], true
		}
	}
	return 0, true
}

// markLeave marks the subgroups SetSpeculateLeave leaves to the phase
// under the current plan (specLeave). It allocates nothing.
func (e *Engine) markLeave() {
	clear(e.specLeave)
	e.specMarked = true
	left, k := int64(0), 0
	for i := len(e.sizes) - 1; i >= 0 && left < e.specLeaveN; i-- {
		if !e.held[i] && !e.specCPU(i) {
			continue
		}
		if k%2 == 1 {
			e.specLeave[i] = true
			left += e.sizes[i]
		}
		k++
	}
}

// specWorker runs the requests of Speculate on reqs until Close closes
// it (a parameter: Close sets the field to nil), answering a stop request
// on ack: the CPU workers' subgroups, or with gpu the GPU speculation's
// (specOnGPU), each worker its own, the last first. The two share the
// slots (reserve).
func (e *Engine) specWorker(reqs <-chan specReq, ack chan<- struct{}, gpu bool) {
	for r := range reqs {
		if r.stop {
			e.acquire(handSpec)
			if gpu {
				e.drainGPUSpec()
			}
			e.publish(handAck)
			ack <- struct{}{}
			continue
		}
		e.acquire(specKey(r.ev))
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
			if !e.specCan[i] || e.specOnGPU(i) != gpu || e.specTo[i] != noSpec {
				continue
			}
			from, to, ok := e.reserve(i)
			if !ok {
				continue // the slots are full: the phase's
			}
			if gpu {
				e.specGPU(i, from, to)
			} else {
				e.specStep(i, from, to)
			}
		}
	}
}

// reserve takes subgroup i's speculative update's destination: a free
// slot when its state is at home, home when it is in a slot (ok false
// when no slot is free). specTo[i] holds it from here on, under specMu
// with the slots' allocation, which both workers use. The CPU workers'
// subgroups come first: a streamed subgroup of the GPU speculation takes
// a slot only where what stays free holds what the CPU workers may still
// speculate on (cpuNeed), since the CPU, not the copy engines, bounds
// the update phase where both speculate.
func (e *Engine) reserve(i int) (from, to int64, ok bool) {
	e.specMu.Lock()
	defer e.specMu.Unlock()
	n := e.sizes[i]
	from, to = e.loc[i], homeLoc
	if from == homeLoc { // a slot taken (a move home takes none)
		gpu := e.specOnGPU(i)
		if gpu && e.slotsFree() < roundSlot(n)+e.cpuNeed {
			return 0, 0, false
		}
		if to, ok = e.allocSlot(n); !ok {
			return 0, 0, false
		}
		if !gpu {
			e.cpuNeed = max(0, e.cpuNeed-roundSlot(n))
			e.cpuSpecN += roundSlot(n)
		}
	}
	e.specTo[i] = to
	return from, to, true
}

// roundSlot is n elements rounded up to the slots' alignment.
func roundSlot(n int64) int64 { return (n + slotAlign - 1) / slotAlign * slotAlign }

// slotsFree returns the slots' elements in no subgroup's use (the sum of
// the gaps, which may be too small for one subgroup). specMu is held.
func (e *Engine) slotsFree() int64 {
	used := int64(0)
	for i, l := range e.loc {
		for _, u := range [2]int64{l, e.specTo[i]} {
			if u >= 0 {
				used += roundSlot(e.sizes[i])
			}
		}
	}
	return e.specN - used
}

// markCPUNeed sets cpuNeed, at a phase's first Speculate: the slots the
// CPU workers' subgroups at home would take (host-held ones, and CPU ones
// whose gradient Prefetch may move), not left to the phase, but after the
// first mark no more than an eighth over what they speculated on since
// the last one, plus their largest subgroup (the backward's length and
// the CPU's rate bound what they take: on an H100 at 4.24B the CPU took
// 1.39B parameters of 3.19B speculable in a 415 ms backward; the eighth
// and the subgroup let a CPU that found no slot, or took none, grow back,
// and a CPU with nothing it can take leaves the slots to the GPU).
func (e *Engine) markCPUNeed() {
	e.specMu.Lock()
	defer e.specMu.Unlock()
	need, largest := int64(0), int64(0)
	for i := range e.sizes {
		if (e.held[i] || e.specCPU(i)) && !e.specLeave[i] {
			largest = max(largest, roundSlot(e.sizes[i]))
			if e.loc[i] == homeLoc {
				need += roundSlot(e.sizes[i])
			}
		}
	}
	if e.cpuMarked {
		need = min(need, e.cpuSpecN+e.cpuSpecN/8+largest)
	}
	e.cpuNeed, e.cpuSpecN, e.cpuMarked = need, 0, true
}

// unreserve gives subgroup i's reserved destination back: its update was
// not made.
func (e *Engine) unreserve(i int) {
	e.specMu.Lock()
	e.specTo[i] = noSpec
	e.specMu.Unlock()
}

// specStep is the CPU workers' speculative update of subgroup i, from its
// state at from into to (reserve): a host-held one from its own gradient
// into its own working copy, a CPU one from the gradient Prefetch moved
// into the slots' 16-bit part, which then moves H2D (specCopy).
func (e *Engine) specStep(i int, from, to int64) {
	n := e.sizes[i]
	slot := max(from, to) // its specOut part: a CPU subgroup's new working copy
	var g adam.Grad
	out := adam.Copy16{DType: e.o.WorkingDType, Data: e.specOut[slot : slot+n]}
	if e.held[i] {
		// The new working copy over the old, which an undo
		// rounds again from the old master weights.
		g, out.Data = e.heldGrad(e.hoff[i], n), e.heldWork(e.hoff[i], n)
	} else { // a CPU subgroup whose gradient's copy Prefetch issued
		// From the gradient Prefetch moved into the subgroup's own
		// place, once that copy is done; the new working copy into
		// the slots' pinned 16-bit part, which moves H2D at once.
		if e.dev.Sync(e.endEv[e.core.opSteps[i][opGradD2H][1]]) != nil {
			e.unreserve(i)
			e.specStop.Store(true)
			return
		}
		g = hostGrad(e.gpre, e.cpuGD, e.gpOff[i]/elemBytes(e.cpuGD), n)
	}
	if to == homeLoc {
		e.waitGate(i) // the update writes subgroup i's host state
	}
	e.specT[i][0] = time.Now()
	e.pool.StepTo(&e.specC[i], e.stateAt(i, from), g, out, e.stateAt(i, to))
	e.specT[i][1] = time.Now()
	if !e.held[i] {
		// Its working copy H2D now, during the backward: the
		// phase then skips the copy if it keeps the update. A
		// copy that failed may have changed the device's copies
		// all the same: an undo copies the old ones back.
		e.specDirty[i] = true
		if e.specCopy(i, slot) != nil {
			e.specStop.Store(true) // the phase copies it (specSource), or restoreSpec
			return
		}
		e.specCopied[i] = true
	}
}

// specCopy enqueues speculated CPU subgroup i's working copy (the slots'
// 16-bit part from element slot) H2D into the device working copy, and
// its mirror part from its master weights where they are (Engine.where:
// the speculation's new ones, or after an undo the old ones), on the H2D
// lane between the copy step's start and end events, as Prefetch issues a
// step: its gradient's copy is done, which the trainer ordered after its
// block's backward, so nothing of this iteration reads those weights
// again. A phase that keeps the update skips its copy (EndSpeculation
// sets the step's done bit; WaitReady waits for the end event recorded
// here); an undo copies the old working copy back (restoreSpec).
func (e *Engine) specCopy(i int, slot int64) error {
	k := e.core.opSteps[i][opCopyH2D] // none for a streamed subgroup (an undo of specGPU's kernel)
	s := e.s[sH2D]
	e.laneMu[sH2D].Lock()
	defer e.laneMu[sH2D].Unlock()
	if k[0] >= 0 {
		if err := e.dev.Record(e.startEv[k[0]], s); err != nil {
			return err
		}
	}
	if err := e.dev.H2D(s, e.work, 2*e.doff[i], e.specOutH, 2*slot, 2*e.sizes[i]); err != nil {
		return err
	}
	if err := e.copyMirror(i, s, Vec{}); err != nil {
		return err
	}
	if k[1] < 0 {
		return nil
	}
	return e.dev.Record(e.endEv[k[1]], s)
}

// WaitSpeculation waits until the CPU workers have run what every
// Speculate so far asked (each final subgroup updated, while free slots
// lasted), so that what EndSpeculation keeps does not depend on timing
// (tests). Without Options.Speculate it does nothing.
func (e *Engine) WaitSpeculation() {
	if e.specN > 0 && e.specReq != nil && !e.specIdle {
		e.stopWorkers()
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
	e.stopWorkers()
	e.specStop.Store(false)
	e.specIdle = true
}

// StopSpeculation stops the CPU workers' speculation after the subgroup
// they are updating, if any (and the GPU speculation after what it
// enqueued, which it waits for on the host), and keeps what they did for
// EndSpeculation:
// a caller whose backward has ended calls it, so that what is left is the
// phase's; Speculate then starts nothing more until EndSpeculation, a drop
// or the Update (it would fix other scalars for what was already
// updated). Without a speculation it does nothing.
func (e *Engine) StopSpeculation() {
	if e.specN > 0 {
		e.haltSpec()
		e.specHalted = true
	}
}

// EndSpeculation ends the speculation of the coming step: the worker
// stops (the subgroup it is updating finishes), then each speculated
// subgroup whose scalars were cs[i], bit for bit, is kept for the next
// Update, which skips it (its update is done), and every other one is
// undone (its state never moved; its working copy gets the old one back).
// cs nil keeps none (a skipped step). It returns how many parameters were
// kept by the CPU workers (SpeculatedGPU: by the GPU speculation). Without
// a speculation it does nothing. A drop (DropPrefetch,
// ZeroGrad, SetGrad, Load, Replan, DropSpeculation, Close) before the
// next Update undoes the kept ones too.
//
// Errors: len(cs) other than the subgroup count (nothing is kept then:
// every speculated subgroup is undone); ErrBroken when an undo could not
// copy the old working copy back to the device (restore from a
// checkpoint).
func (e *Engine) EndSpeculation(cs []adam.Coeffs) (kept int64, err error) {
	if e.specN == 0 {
		return 0, nil
	}
	e.stopSpec()
	if cs != nil && len(cs) != len(e.sizes) {
		err = fmt.Errorf("scheduler: EndSpeculation with %d coefficients for %d subgroups", len(cs), len(e.sizes))
		cs = nil
	}
	e.keptGPU = 0
	for i, to := range e.specTo {
		if to == noSpec || e.specKept(i) {
			continue
		}
		if cs != nil && !e.specBad[i] && sameCoeffs(&cs[i], &e.specC[i]) {
			if e.specOnGPU(i) {
				e.pre[i] |= gpuSpecBits // its copies and kernel are done: the phase skips them
				e.keptGPU += e.sizes[i]
				continue
			}
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
	if e.broken {
		err = errors.Join(err, fmt.Errorf("%w: an undone speculative update's old working copy could not be copied back to the device", ErrBroken))
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

// restoreSpec undoes speculated subgroup i: its state is where it was
// (the new one is forgotten, its slot free again), and its working copy,
// on the host (host-held) or on the device (specCopy), the old one again,
// rounded from the old master weights, as the phase or the last Load
// wrote it.
func (e *Engine) restoreSpec(i int) {
	n, slot := e.sizes[i], e.specSlot(i)
	e.specTo[i] = noSpec // forgotten: where(i) is the old state's place again
	t := time.Now()
	old := e.stateAt(i, e.loc[i]).Param
	if e.held[i] {
		e.pool.Round16(e.o.WorkingDType, e.heldWork(e.hoff[i], n), old)
	}
	if e.specDirty[i] {
		// Its caller waits for the copies once (syncRecopies).
		e.pool.Round16(e.o.WorkingDType, e.specOut[slot:slot+n], old)
		if e.specCopy(i, slot) != nil {
			e.broken = true // the device's copy is neither: restore from a checkpoint
		}
		e.specCopied[i], e.specDirty[i], e.specRecopied = false, false, true
	}
	if len(e.specUndo) < cap(e.specUndo) { // for Trace: never allocates
		e.specUndo = append(e.specUndo, specUndo{sub: i, gpu: e.specOnGPU(i), spec: e.specT[i], restore: [2]time.Time{t, time.Now()}})
	}
	if e.specOnGPU(i) {
		e.pre[i] &^= gpuSpecBits
		e.specBad[i] = false
	} else {
		e.pre[i] &^= 1<<opCPU | 1<<opCopyH2D
	}
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
	gpu           bool // the GPU speculation's (specGPU)
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
	e.specUndo = e.specUndo[:0] // dropped, not validated: no phase of theirs to trace
	e.keptGPU = 0
}

// restoreSpecs undoes every speculated subgroup: only those EndSpeculation
// did not keep, or, with kept, those too.
func (e *Engine) restoreSpecs(kept bool) {
	for i, to := range e.specTo {
		if to != noSpec && (kept || !e.specKept(i)) {
			e.restoreSpec(i)
		}
	}
	e.syncRecopies()
}

// DropSpeculation undoes every speculated subgroup, kept ones too, and
// moves every state that kept speculative updates left in the slots back
// into the host state (HostState): a caller about to read or write the
// host state (a checkpoint, the master weights) calls it, so that it sees
// the last step's state there. The prefetched copies stay. Without a
// speculation it does nothing.
func (e *Engine) DropSpeculation() {
	e.dropSpec()
	e.home()
}

// UndoSpeculation undoes every speculated subgroup, kept ones too, and
// leaves every state where it is: a lazy checkpoint reads each subgroup's
// from StateOf, without DropSpeculation's copies home. The prefetched
// copies stay. Without a speculation it does nothing.
func (e *Engine) UndoSpeculation() { e.dropSpec() }

// StateOf returns subgroup i's master state (i in [0, subgroups)): its
// part of HostState, or the slot a kept speculative update left it in.
// After UndoSpeculation or DropSpeculation, and with no Speculate or
// Update since, it holds the last step's state (for a resident subgroup,
// once Download or DownloadAsync is done). A caller that reads it in the
// background makes Hold's gate wait for its reading of subgroup i: every
// later write of subgroup i's state calls the gate first (its update in
// place, a speculative update or a move into the host state), and a slot
// is reused only after its subgroup's state has left it, past the gate.
// Panics on i out of range.
func (e *Engine) StateOf(i int) adam.State { return e.stateAt(i, e.where(i)) }

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
	for i, to := range e.specTo {
		if to != noSpec {
			e.cpuT[i] = [2]time.Duration{e.specT[i][0].Sub(e.t0), e.specT[i][1].Sub(e.t0)}
		}
	}
}

// endSpec is the end of an Update that took the kept subgroups: each
// one's state is where its speculative update wrote it (its old slot, if
// any, free again).
func (e *Engine) endSpec() {
	if e.specN == 0 {
		return
	}
	for i, to := range e.specTo {
		if to != noSpec {
			e.loc[i], e.specTo[i] = to, noSpec
		}
	}
	clear(e.specCopied)
	clear(e.specDirty)
	clear(e.specBad)
}

// specSource returns where kept CPU subgroup i's new working copy is for
// its copy H2D: the slots' pinned 16-bit part (ok false when i was not
// kept: the copy staging then).
func (e *Engine) specSource(i int) (Host, int64, bool) {
	if e.specN == 0 || e.held[i] || e.specTo[i] == noSpec || e.pre[i]&(1<<opCPU) == 0 {
		return nil, 0, false
	}
	return e.specOutH, 2 * e.specSlot(i), true
}

// specSlot returns the slot speculated subgroup i's update involves, the
// one it wrote or the one it read (its specOut part holds a CPU
// subgroup's new working copy).
func (e *Engine) specSlot(i int) int64 { return max(e.loc[i], e.specTo[i]) }

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

// stopWorkers sends each worker a stop request and waits for their
// answers: each has run what it was asked before it (the GPU
// speculation's copies done, drainGPUSpec).
func (e *Engine) stopWorkers() {
	e.publish(handSpec)
	e.specReq <- specReq{stop: true}
	<-e.specAck
	e.acquire(handAck)
	if e.specReqG != nil {
		e.specReqG <- specReq{stop: true}
		<-e.specAck
		e.acquire(handAck)
	}
}

// closeSpec stops the workers for good.
func (e *Engine) closeSpec() {
	if e.specReq != nil {
		close(e.specReq)
		e.specReq = nil
	}
	if e.specReqG != nil {
		close(e.specReqG)
		e.specReqG = nil
	}
}
