package scheduler

import "fmt"

// Faults. A copy or launch that cannot be enqueued stops the lanes
// (fail); Update drains what was enqueued and completes every subgroup
// from where it stood, one operation at a time (complete), and returns a
// *FaultError: the state is fully advanced. A fault inside the device
// (a failed wait) or during the completion leaves the state unknown:
// ErrBroken.

// FaultError is Update's error when enqueueing a copy or a launch failed.
// The step was then finished subgroup by subgroup, each from where it
// stood, so the state is fully advanced (Recovered); had that failed too,
// Update returns ErrBroken instead. A failed copy into the fp32 mirror
// (Options.Mirror) is reported as a fault of the operation it follows
// ("AdamW" or "copy H2D"), whose update itself was applied; the completion
// refreshes the whole mirror.
type FaultError struct {
	Subgroup int    // the subgroup whose operation failed
	Op       string // "state H2D", "AdamW", "state D2H", "upcast", "grad D2H", "copy H2D"
	Err      error
}

func (e *FaultError) Error() string {
	return fmt.Sprintf("scheduler: %s of subgroup %d failed (the step was then completed subgroup by subgroup): %v", e.Op, e.Subgroup, e.Err)
}

func (e *FaultError) Unwrap() error { return e.Err }

// wait blocks until ev is done. A failure there is a fault inside the
// device (a CUDA fault poisons the context): Update then reports
// ErrBroken instead of completing the step.
func (e *Engine) wait(ev Event) error {
	err := e.dev.Sync(ev)
	if err != nil {
		e.deviceFault.Store(true)
	}
	return err
}

// fail records err (when not nil) as the step's first fault, stops the
// lanes, and reports whether there was one.
func (e *Engine) fail(i, op int, err error) bool {
	if err == nil {
		return false
	}
	e.firstMu <- struct{}{}
	if e.first == nil {
		e.first = &FaultError{Subgroup: i, Op: opNames[op], Err: err}
	}
	<-e.firstMu
	e.abort.Store(true)
	return true
}

// complete finishes every subgroup's operations that the lanes did not,
// one at a time, each waited for, after the fault e.first: a copy into a
// staging slot starts over in slot 0 (every slot is free now), what
// follows it uses the slot its data is in. It returns e.first, or
// ErrBroken when a step fails again.
func (e *Engine) complete() error {
	for i := range e.sizes {
		ops := e.core.ops(i)
		slot := max(0, int(e.core.steps[e.core.opSteps[i][ops[0]][0]].slot))
		for _, op := range ops {
			if e.done[i]&(1<<op) != 0 {
				continue
			}
			if op == opH2D || op == opUpcast || (op == opGradD2H && e.done[i]&(1<<opUpcast) == 0) {
				slot = 0
			}
			r := e.core.opSteps[i][op]
			for k := r[0]; k <= r[1]; k++ {
				if err := e.exec(k, slot, false); err != nil {
					e.broken = true
					return fmt.Errorf("%w: %v (after %v)", ErrBroken, err, e.first)
				}
			}
			if op != opCPU {
				if err := e.dev.Sync(e.endEv[r[1]]); err != nil {
					e.broken = true
					return fmt.Errorf("%w: %v (after %v)", ErrBroken, err, e.first)
				}
			}
			e.done[i] |= 1 << op
		}
	}
	// The mirror, whole, from where each subgroup's master weights are
	// now: a copy into it may have been the fault.
	if e.mirrorN > 0 {
		s := e.s[sKernel]
		for i := range e.sizes {
			var m Vec
			if e.plan.Roles[i] == Resident {
				m = e.resState(i).Param
			}
			if err := e.copyMirror(i, s, m); err != nil {
				e.broken = true
				return fmt.Errorf("%w: the fp32 mirror: %v (after %v)", ErrBroken, err, e.first)
			}
		}
		if err := firstErr(e.dev.Record(e.tail[sKernel], s), e.dev.Sync(e.tail[sKernel])); err != nil {
			e.broken = true
			return fmt.Errorf("%w: %v (after %v)", ErrBroken, err, e.first)
		}
	}
	return e.first
}
