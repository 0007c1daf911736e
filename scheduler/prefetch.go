package scheduler

import (
	"fmt"
	"time"
)

// Prefetch: the part of the next update phase that needs neither the
// global checks nor the clip coefficient, started during the trainer's
// backward, where the gradients of the last layers are final first (Deep
// Optimizer States' artifact moves gradients then). What moves out of the
// phase:
//
//   - every CPU subgroup's gradient D2H, once the subgroup's gradients are
//     final, into pinned host memory of its own (Options.Prefetch; the
//     phase's two host staging slots could hold only two), so that the
//     CPU workers start the phase with their gradients on the host;
//   - the state H2D of the first two streamed subgroups (one per staging
//     slot): state does not depend on the gradients at all (not with
//     Options.SpeculateGPU, whose speculation uses the staging during the
//     backward).
//
// What cannot move: every AdamW update (CPU, streamed or resident), since
// no parameter may change before the non-finite check and the global norm
// over every gradient are known (a skipped step, and clipping, stay exact
// and global); the upcast of CPU subgroups' 16-bit gradients on the GPU
// (UpcastOnGPU: its scratch has two slots; those gradients move in the
// phase as before); and the copies of a streamed subgroup after its first
// two, whose slots its predecessors' updates free.
//
// The prefetched steps are the schedule core's own steps, issued early
// with their events: in the phase their issuers skip them and the steps
// after them wait for their events as before, so the phase computes
// exactly what it computes without them.

// Prefetch issues, before the next Update, the work of that phase that
// needs no global value (see above), given that the device gradients of
// the flat elements [ready, total) are final once the work enqueued on s
// so far (the trainer's backward) is done: the gradient D2H of every CPU
// subgroup inside [ready, total) not yet issued (Options.Prefetch), after
// an event recorded on s, and at the first call the state H2D of the first
// two streamed subgroups (which need nothing of s; not with
// Options.SpeculateGPU). It blocks on nothing
// unless a copy cannot be enqueued (the drop waits for what was). A
// trainer calls it as its backward finishes each block, with ready
// decreasing; a call with a larger ready than before issues nothing new.
// The gradients in [ready, total) must not change until the next Update
// (ZeroGrad, SetGrad and Load drop the prefetch, as DropPrefetch). It
// re-records the events of the steps it issues: read the last phase's Trace
// and Measure before it. s is a stream
// of this engine's device (CUDAStream for a CUDA device's).
//
// Errors: ErrBroken; ErrEngineClosed after Close; ready outside [0,
// total]; a copy or event that could not be enqueued (the prefetch is
// dropped: the phase does that work). An Update that fails before its
// phase starts leaves the prefetch pending.
func (e *Engine) Prefetch(s Stream, ready int64) error {
	if e.broken {
		return ErrBroken
	}
	if !e.running {
		return ErrEngineClosed
	}
	if ready < 0 || ready > e.total {
		return fmt.Errorf("scheduler: Prefetch: ready %d is outside [0, %d]", ready, e.total)
	}
	if err := e.prefetch(s, ready); err != nil {
		return firstErr(err, e.DropPrefetch())
	}
	return nil
}

func (e *Engine) prefetch(s Stream, ready int64) error {
	first := !e.preOn
	if first {
		if err := e.dev.Record(e.preBase, s); err != nil {
			return err
		}
		e.preOn = true
	}
	// With the GPU speculation the staging is its own until the phase
	// (specGPU): no state moves early.
	if first && e.plan.Schedule.GPU > 0 && !e.specGPUOn() {
		streamed := 0
		for _, i := range e.plan.GPUOrder {
			if e.plan.Roles[i] != OnGPU {
				continue
			}
			r := e.core.opSteps[i][opH2D]
			for k := r[0]; k <= r[1]; k++ {
				if err := e.exec(k, int(e.core.steps[k].slot), false); err != nil {
					return err
				}
			}
			e.pre[i] |= 1 << opH2D
			if streamed++; streamed == 2 {
				break
			}
		}
	}
	if e.gpre == nil {
		return nil
	}
	waited := false
	for _, i := range e.plan.CPUOrder {
		if e.pre[i]&(1<<opGradD2H) != 0 || e.off[i] < ready {
			continue
		}
		if !waited {
			if err := firstErr(e.dev.Record(e.preEv, s), e.dev.Wait(e.s[sD2H], e.preEv)); err != nil {
				return err
			}
			waited = true
		}
		// Marked first: the step's copy then lands in the subgroup's
		// own place (gradHost); a failure drops the mark with the rest.
		e.pre[i] |= 1 << opGradD2H
		r := e.core.opSteps[i][opGradD2H]
		for k := r[0]; k <= r[1]; k++ { // one step today; its last one's end event is what Speculate waits for
			if err := e.exec(k, int(e.core.steps[k].slot), false); err != nil {
				return err
			}
		}
	}
	return nil
}

// DropPrefetch forgets what Prefetch issued for the next Update: it waits
// for those copies (so that nothing reuses the memory they use) and the
// next Update does that work itself. It first undoes what Speculate
// updated (DropSpeculation), whether or not anything was prefetched. A
// skipped step (non-finite gradients) calls it; so do ZeroGrad, SetGrad,
// Load, Replan and Close. It forgets HeldPartials' sums too. Without a
// prefetch, a speculation or such sums it does nothing.
//
// Errors: a failed wait (the engine is then broken).
func (e *Engine) DropPrefetch() error {
	e.dropSpec() // its kept subgroups are marked in pre
	herr := e.dropHeldParts()
	if !e.preOn {
		return herr
	}
	e.preOn = false
	clear(e.pre)
	err := herr
	for _, l := range []int{sH2D, sD2H} {
		e.laneMu[l].Lock()
		if werr := firstErr(e.dev.Record(e.tail[l], e.s[l]), e.dev.Sync(e.tail[l])); werr != nil {
			e.broken = true
			err = firstErr(err, werr)
		}
		e.laneMu[l].Unlock()
	}
	return err
}

// preTime returns when Prefetch's event ev of the last phase happened,
// from the phase's base: before it (negative) during the backward. The
// device's clock gives the time between two events only forwards, so both
// are measured from preBase, recorded before everything Prefetch issued.
func (e *Engine) preTime(ev Event) (time.Duration, error) {
	a, err := e.dev.Elapsed(e.preBase, ev)
	if err != nil {
		return 0, err
	}
	b, err := e.dev.Elapsed(e.preBase, e.base)
	if err != nil {
		return 0, err
	}
	return a - b, nil
}
