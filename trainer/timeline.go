package trainer

import (
	"slices"
	"time"

	"github.com/deepstates/dos/offload"
)

// The rows an iteration's timeline adds to the update phase's resources
// (offload.Resource: perfmodel.ResCPU, ResH2D, ResD2H, ResGPU).
const (
	// ResCompute is forward and backward: the GPU's compute stream with
	// Device "cuda", the host's goroutines otherwise.
	ResCompute offload.Resource = "compute"
	// ResHost is the optimizer's step outside its update phase: the
	// gradients' non-finite check and norm, clipping, the working copy's
	// return, re-planning, and with no device the whole CPU update.
	ResHost offload.Resource = "step"
)

// NextForward is the What of the next iteration's forward on ResCompute
// when it ran during the traced iteration's update phase (TrainConfig.
// NoOverlapForward off): from its first block's enqueue, each block
// waiting for its weights, to its end.
const NextForward = "next forward"

// IterationTimeline is one training iteration as it ran (issue 17's
// timeline; TrainConfig.TimelineAt): forward, backward, the optimizer's
// step and its update phase's operations, with their times from the
// iteration's start, and the GPU memory in use along it.
type IterationTimeline struct {
	Iteration int
	Total     time.Duration // the iteration's wall time, forward to the step's return
	// Ops: "forward" and "backward" (ResCompute), and NextForward when
	// the next iteration's forward ran during the step; "step" (ResHost), the
	// step's time outside the update phase, before and after it; the
	// update phase's operations (offload.Optimizer.Trace, shifted by when
	// the phase began). Forward and backward are timed by the host after
	// the device finished each (the traced iteration waits for the GPU
	// between them, which other iterations do not).
	Ops []offload.TraceOp
	// Memory is the device memory in use (bytes; under --gpu-memory what
	// dos allocated) at the iteration's start, after forward, after
	// backward and after the step; empty without Device "cuda".
	Memory []offload.TraceCounter
}

// timelineMarks collects the traced iteration's times (Run).
type timelineMarks struct {
	t0      time.Time
	forward time.Time    // forward's end (the device synchronised)
	next    [2]time.Time // NextForward's start and end (the device synchronised), when it ran
	mem     []offload.TraceCounter
}

// markMemory records the GPU memory in use at at (nothing without a GPU).
func (t *Trainer) markMemory(m *timelineMarks, at time.Time) {
	used, total := t.w.memory()
	if total == 0 { // the host's
		return
	}
	m.mem = append(m.mem, offload.TraceCounter{Name: "GPU memory (GiB)", At: at.Sub(m.t0), Value: float64(used) / (1 << 30)})
}

// finishTimeline builds the IterationTimeline of the iteration that m
// traced, whose optimizer step ran from s0 (backward's end: the device
// was synchronised for the loss) to s1. A step that ran no update phase (skipped for a non-finite
// gradient; Trace then still has the previous one) is one span.
func (t *Trainer) finishTimeline(it int, m *timelineMarks, s0, s1 time.Time) {
	tl := &IterationTimeline{Iteration: it, Total: s1.Sub(m.t0)}
	tl.Ops = append(tl.Ops,
		offload.TraceOp{Resource: ResCompute, What: "forward", Start: 0, End: m.forward.Sub(m.t0)},
		offload.TraceOp{Resource: ResCompute, What: "backward", Start: m.forward.Sub(m.t0), End: s0.Sub(m.t0)})
	if !m.next[0].IsZero() {
		tl.Ops = append(tl.Ops, offload.TraceOp{Resource: ResCompute, What: NextForward, Start: m.next[0].Sub(m.t0), End: m.next[1].Sub(m.t0)})
	}
	start, ops, err := t.opt.Trace()
	if err != nil || len(ops) == 0 || start.Before(s0) { // no device, a re-plan, or no phase in this step: one span
		tl.Ops = append(tl.Ops, offload.TraceOp{Resource: ResHost, What: "step", Start: s0.Sub(m.t0), End: s1.Sub(m.t0)})
	} else {
		off := start.Sub(m.t0)
		end := off
		for _, o := range ops {
			o.Start += off
			o.End += off
			end = max(end, o.End)
			tl.Ops = append(tl.Ops, o)
		}
		tl.Ops = append(tl.Ops,
			offload.TraceOp{Resource: ResHost, What: "step", Start: s0.Sub(m.t0), End: off},
			offload.TraceOp{Resource: ResHost, What: "step", Start: min(end, s1.Sub(m.t0)), End: s1.Sub(m.t0)})
	}
	slices.SortStableFunc(tl.Ops, func(a, b offload.TraceOp) int { return int(a.Start - b.Start) })
	tl.Memory = m.mem
	t.timeline = tl
}

// Timeline returns the iteration TrainConfig.TimelineAt traced, once Run
// has passed it; false before, or when none was asked for.
func (t *Trainer) Timeline() (IterationTimeline, bool) {
	if t.timeline == nil {
		return IterationTimeline{}, false
	}
	return *t.timeline, true
}
