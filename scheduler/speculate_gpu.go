package scheduler

import "time"

// The GPU speculation (Options.SpeculateGPU): the streamed subgroups
// (OnGPU, not host-held) speculated on during the trainer's backward, as
// the CPU workers speculate on theirs (speculate.go), on the copy engines
// and the kernel stream, which the backward leaves mostly idle. A streamed
// subgroup whose gradients are final is updated out of place, exactly as
// the phase would with the speculative scalars: its state moves H2D from
// where it is (Engine.loc) into a device staging slot, the fused kernel
// updates it there and writes the new working copy in place (its block's
// backward is over: nothing of this iteration reads those weights again),
// and the new state moves D2H into the destination reserve gave it (a
// free slot, or home; the CPU workers' subgroups have the slots first).
// The copies and the kernel run on three streams of their own, not on
// the phase's lanes, so that a CPU subgroup's gradient D2H, which the CPU
// workers wait for, never queues behind 12 bytes a parameter of state.
//
// EndSpeculation keeps it as it keeps a CPU one: the phase skips its
// state H2D, kernel and state D2H (their steps' events are the
// speculation's: Trace shows them in the backward), and its state is
// where the speculation wrote it from then on. An undo forgets the new
// state (the old one never moved) and copies the old working copy back,
// rounded from the old master weights (restoreSpec), with its mirror
// part. A kept subgroup's skipped state D2H leaves a hole in the staging
// slot's chain, which the phase's next state H2D into that slot steps
// over (Engine.slotStep).
//
// The staging is the phase's: Prefetch moves no state with the GPU
// speculation (the worker owns the two slots from the first Speculate to
// the stop), and every stop waits for all the worker enqueued
// (drainGPUSpec), so the phase finds the staging and the slots' copies
// done.

// gpuSpecBits are a kept speculated streamed subgroup's operations in
// pre: the phase skips them.
const gpuSpecBits = 1<<opH2D | 1<<opKernel | 1<<opD2H

// specGPUOn reports whether the GPU speculation is on: Options.Speculate
// made slots and Options.SpeculateGPU asked for it.
func (e *Engine) specGPUOn() bool { return e.specN > 0 && e.specReqG != nil }

// specOnGPU reports whether subgroup i is the GPU speculation's: a
// streamed subgroup of the plan (not host-held).
func (e *Engine) specOnGPU(i int) bool { return !e.held[i] && e.plan.Roles[i] == OnGPU }

// specGPUOK reports whether subgroup i may be speculated on by the GPU
// speculation: it is on and i is a streamed subgroup whose state Prefetch
// did not move.
func (e *Engine) specGPUOK(i int) bool {
	return e.specGPUOn() && e.specOnGPU(i) && e.pre[i]&(1<<opH2D) == 0
}

// specKept reports whether speculated subgroup i is kept for the next
// Update (EndSpeculation marked its operations done).
func (e *Engine) specKept(i int) bool {
	if e.specOnGPU(i) {
		return e.pre[i]&(1<<opKernel) != 0
	}
	return e.pre[i]&(1<<opCPU) != 0
}

// SpeculatedGPU returns how many parameters of streamed subgroups the last
// EndSpeculation kept (Options.SpeculateGPU): updated during the backward
// on the GPU, so that the phase skips them. EndSpeculation's own count is
// the CPU workers'.
func (e *Engine) SpeculatedGPU() int64 { return e.keptGPU }

// allocSpecGPU makes the GPU speculation's streams and events.
func (e *Engine) allocSpecGPU() error {
	for k := range e.specS {
		var err error
		if e.specS[k], err = e.streamAlloc(&e.allocs); err != nil {
			return err
		}
		if e.specTail[k], err = e.eventAlloc(&e.allocs); err != nil {
			return err
		}
	}
	e.specStage = [2]int32{-1, -1}
	return nil
}

// specGPU is the GPU speculation's update of streamed subgroup i from its
// state at from into to (reserve), on the next device staging slot, once
// that slot's last state D2H is done (its worker waited for the request's
// event, after which i's gradients are final). It waits for nothing else: the
// copies and the kernel are enqueued, and a stop waits for them
// (drainGPUSpec). A failure marks the subgroup bad (EndSpeculation undoes
// it) and stops the speculation.
func (e *Engine) specGPU(i int, from, to int64) {
	slot := e.specNextStage
	e.specNextStage ^= 1
	if k := e.specStage[slot]; k >= 0 {
		e.specStage[slot] = -1
		if e.dev.Sync(e.endEv[k]) != nil {
			e.specBad[e.core.steps[k].sub] = true
			e.unreserve(i)
			e.specStop.Store(true)
			return
		}
	}
	if to == homeLoc {
		e.waitGate(i) // the state D2H writes subgroup i's host state
	}
	e.specDirty[i] = true // the kernel writes the working copy: an undo copies the old one back
	e.specT[i][0] = time.Now()
	err := e.specGPUEnqueue(i, slot)
	e.specT[i][1] = time.Now()
	if err != nil {
		e.specBad[i] = true
		e.specStop.Store(true)
		return
	}
	e.specStage[slot] = e.core.opSteps[i][opD2H][1]
}

// specGPUEnqueue enqueues subgroup i's speculative update on staging slot
// slot: the state H2D pieces on specS[0], the kernel with its speculative
// scalars on specS[1] after them (not on the engine's kernel stream,
// which HeldPartials makes wait for the trainer's backward: on an H100 a
// kernel waited 183 ms there), the state D2H pieces on specS[2] after the
// kernel, each step between its own events.
func (e *Engine) specGPUEnqueue(i, slot int) error {
	r := e.core.opSteps[i]
	for k := r[opH2D][0]; k <= r[opH2D][1]; k++ {
		if err := e.pieceOn(e.specS[0], k, &e.core.steps[k], slot); err != nil {
			return err
		}
	}
	if err := e.dev.Wait(e.specS[1], e.endEv[r[opH2D][1]]); err != nil {
		return err
	}
	mirror, err := e.kernel(e.specS[1], r[opKernel][0], slot, &e.specC[i], false)
	if err = firstErr(err, mirror); err != nil {
		return err
	}
	if err := e.dev.Wait(e.specS[2], e.endEv[r[opKernel][1]]); err != nil {
		return err
	}
	for k := r[opD2H][0]; k <= r[opD2H][1]; k++ {
		if err := e.pieceOn(e.specS[2], k, &e.core.steps[k], slot); err != nil {
			return err
		}
	}
	return nil
}

// drainGPUSpec waits for everything the GPU speculation enqueued (at a
// stop request, on its worker): its three streams.
// A failure marks every subgroup it reserved bad (its new state is not
// known to be written), stops the speculation and breaks the engine: what
// it enqueued may still run, under the undo's copies and the phase's.
func (e *Engine) drainGPUSpec() {
	e.specStage = [2]int32{-1, -1}
	ok := true
	for k, s := range e.specS {
		if firstErr(e.dev.Record(e.specTail[k], s), e.dev.Sync(e.specTail[k])) != nil {
			ok = false
		}
	}
	if ok {
		return
	}
	e.specStop.Store(true)
	e.broken = true // read by the caller after the stop's answer
	for i, to := range e.specTo {
		if to != noSpec && e.specOnGPU(i) {
			e.specBad[i] = true
		}
	}
}
