package offload

import (
	"fmt"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// specStep is one step of TestSpeculate: the gradients' scale (0.01: the
// norm stays under MaxGradNorm; 1: clipping binds), a NaN in a host-held
// gradient, the loss scale, a Snapshot between the backward and the Step,
// and how many parameters the Step must say it kept from the speculation
// (-1: some, > 0).
type specStep struct {
	scale     float32
	nan       bool
	lossScale float64
	snapshot  bool
	kept      int64
}

// TestSpeculate: with Options.Speculate the OffloadParam subgroups are
// updated during the backward and the Step keeps or restores them; the
// state and working copy equal the host optimizer's bit for bit after
// every mix: steps that do not clip, one that clips (restored, and the
// next backward does not speculate), a NaN (skipped, restored, paused), a
// changed loss scale (restored), a Snapshot before the Step (it reads the
// last step's state: restored), under several schedules of the other
// subgroups and saves for every held parameter or for a part.
func TestSpeculate(t *testing.T) {
	held := []string{"h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"}
	steps := []specStep{
		{scale: 0.01, kept: 0}, // the first backward does not speculate
		{scale: 0.01, kept: -1}, {scale: 0.01, kept: -1},
		{scale: 1, kept: 0},                                       // clips: restored
		{scale: 0.01, kept: 0},                                    // paused after a clip
		{scale: 0.01, kept: -1},                                   //
		{scale: 0.01, nan: true, kept: 0}, {scale: 0.01, kept: 0}, // skipped, then paused
		{scale: 0.01, kept: -1},
		{scale: 0.01, lossScale: 4, kept: 0}, // another unscale: restored
		{scale: 0.01, lossScale: 4, kept: -1},
		{scale: 0.01, lossScale: 4, snapshot: true, kept: 0},
		{scale: 0.01, lossScale: 4, kept: -1},
	}
	type variant struct {
		held []string
		s    perfmodel.Schedule
	}
	var variants []variant
	for _, s := range []perfmodel.Schedule{{CPU: 2, GPU: 1, Resident: 1}, {CPU: 4}, {GPU: 4}, {Resident: 4}} {
		variants = append(variants, variant{held, s})
	}
	// Without OffloadParam: the CPU subgroups, from their prefetched
	// gradients (not with the upcast on the GPU: nothing to speculate on).
	for _, s := range []perfmodel.Schedule{{CPU: 5}, {CPU: 3, GPU: 1, Resident: 1}} {
		variants = append(variants, variant{nil, s})
	}
	for _, v := range variants {
		held, s := v.held, v.s
		for _, budget := range []int64{1 << 20, scheduler.SpeculateBytes(400, false)} {
			t.Run(fmt.Sprintf("held=%v/%+v/budget=%d", held, s, budget), func(t *testing.T) {
				r := newRig(t, testParams, specBase(), held, s, budget)
				ref, b, sim := r.ref, r.b, r.sim
				for k, st := range steps {
					fill(ref, int64(k+1))
					scaleGrads(ref, st.scale)
					if st.nan {
						hi, _ := ref.Index("h.0.attn.c_attn.weight")
						ref.Grad(hi).Uint16()[3] = 0x7fc0
					}
					r.send(t, false, true)
					if st.snapshot {
						if _, err := b.Snapshot(nil); err != nil {
							t.Fatal(err)
						}
					}
					args := StepArgs{LossScale: st.lossScale}
					rr, err := ref.Step(args)
					if err != nil {
						t.Fatal(err)
					}
					args.GradOnDevice = true
					rb, err := b.Step(args)
					if err != nil {
						t.Fatal(err)
					}
					if rr.Skipped != rb.Skipped || rr.ClipCoef != rb.ClipCoef || rr.Skipped != st.nan || (rr.ClipCoef < 1) != (st.scale == 1) {
						t.Fatalf("step %d: skipped %v/%v, clip %g/%g (reference/speculating), want skipped %v and clipping %v", k, rr.Skipped, rb.Skipped, rr.ClipCoef, rb.ClipCoef, st.nan, st.scale == 1)
					}
					if (st.kept < 0) != (rb.Speculated > 0) || (st.kept >= 0 && rb.Speculated != st.kept) {
						t.Fatalf("step %d: %d parameters kept from the speculation, want %d (-1: some)", k, rb.Speculated, st.kept)
					}
					sameState(t, synced(t, ref), synced(t, b.workingNow(t)))
				}
				if err := sim.OrderErr(); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

// scaleGrads multiplies every bf16 gradient of o by f (rounded back to
// bf16).
func scaleGrads(o *Optimizer, f float32) {
	for i := range o.Params() {
		u := o.Grad(i).Uint16()
		for j := range u {
			u[j] = adam.F32ToBF16(adam.BF16ToF32(u[j]) * f)
		}
	}
}
