package trainer

import (
	"io"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/offload"
)

// TestTimelineSkippedStep: a traced iteration whose step is skipped
// (non-finite gradients: the loss scaler's overflow) has no update phase of
// its own; Optimizer.Trace still returns the previous iteration's, which
// must not be drawn (its operations fell before the iteration's start and
// the "step" span ran backwards). The step is one span, after backward.
func TestTimelineSkippedStep(t *testing.T) {
	text, c := tinySim()
	tr, err := New(c, text, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if _, err := tr.Run(); err != nil { // iteration 1: an update phase
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	// Iteration 2, traced, as Run does it, with an overflowed gradient.
	m := &timelineMarks{t0: time.Now()}
	m.forward = time.Now()
	g := tr.opt.Grad(0).Uint16()
	g[0] = adam.F32ToBF16(float32(math.Inf(1)))
	s0 := time.Now()
	res, err := tr.opt.Step(offload.StepArgs{})
	if err != nil || !res.Skipped {
		t.Fatalf("step: %+v, %v: want skipped", res, err)
	}
	s1 := time.Now()
	tr.finishTimeline(2, m, s0, s1)
	tl, ok := tr.Timeline()
	if !ok {
		t.Fatal("no timeline")
	}
	steps := 0
	for _, o := range tl.Ops {
		if o.Start < 0 || o.End < o.Start {
			t.Errorf("%s %q: [%v, %v]", o.Resource, o.What, o.Start, o.End)
		}
		if o.Resource == ResHost {
			steps++
		}
	}
	if len(tl.Ops) != 3 || steps != 1 {
		t.Errorf("ops %+v: want forward, backward and one step span", tl.Ops)
	}
}

// TestSubgroupSizesRecorded: with candidate sizes the trainer's config
// records the size the optimizer cut at (checkpoints save it; a resume
// keeps it); on the simulated device without a profile the schedule is
// forced (offload.MixedSchedule) and the first candidate is taken.
func TestSubgroupSizesRecorded(t *testing.T) {
	text, c := tinySim()
	c.SubgroupSize, c.SubgroupSizes = 3000, []int{3000, 250}
	tr, err := New(c, text, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if got, opt := tr.cfg.SubgroupSize, tr.opt.Options().SubgroupSize; got != opt || opt != 3000 {
		t.Errorf("config records subgroups of %d, the optimizer cut at %d; want both 3000", got, opt)
	}
}

// tinySim is a text and a one-iteration config of a tiny model on the
// simulated device, bf16.
func tinySim() ([]byte, TrainConfig) {
	text := []byte(strings.Repeat("Of the Reflexions, Refractions, Inflexions and Colours of Light. ", 200))
	c := DefaultTrainConfig()
	c.Model = Config{VocabSize: VocabSize, NCtx: 16, NLayer: 1, NHead: 2, NEmbd: 16}
	c.Batch, c.Steps, c.EvalEvery, c.SampleBytes, c.CkptEvery, c.LogEvery = 2, 1, 0, 0, 0, 0
	c.Device, c.WorkingDType, c.GradDType = "sim", adam.BF16, adam.BF16
	return text, c
}

// TestTimelineNextForward: the traced iteration's timeline draws the next
// iteration's forward where it ran, during the step (after the backward),
// and its own forward alone, before its backward; the last iteration has
// no next forward.
func TestTimelineNextForward(t *testing.T) {
	for _, at := range []int{2, 3} {
		text, c := tinySim()
		c.Steps, c.TimelineAt = 3, at
		tr, err := New(c, text, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tr.Run(); err != nil {
			t.Fatal(err)
		}
		tl, ok := tr.Timeline()
		tr.Close()
		if !ok {
			t.Fatal("no timeline")
		}
		var fwd, bwd, next []offload.TraceOp
		for _, o := range tl.Ops {
			switch {
			case o.Resource == ResCompute && o.What == "forward":
				fwd = append(fwd, o)
			case o.Resource == ResCompute && o.What == "backward":
				bwd = append(bwd, o)
			case o.Resource == ResCompute && o.What == NextForward:
				next = append(next, o)
			}
		}
		wantNext := 1
		if at == c.Steps {
			wantNext = 0
		}
		if len(fwd) != 1 || len(bwd) != 1 || len(next) != wantNext {
			t.Fatalf("iteration %d traced: %d forward, %d backward, %d next forward spans; want 1, 1, %d", at, len(fwd), len(bwd), len(next), wantNext)
		}
		if fwd[0].End > bwd[0].Start {
			t.Errorf("iteration %d: forward %+v ends after the backward %+v starts", at, fwd[0], bwd[0])
		}
		if wantNext == 1 && (next[0].Start < bwd[0].End || next[0].End < next[0].Start || next[0].End > tl.Total) {
			t.Errorf("iteration %d: next forward %+v, backward %+v, total %v: want it after the backward, inside the iteration", at, next[0], bwd[0], tl.Total)
		}
	}
}
