package offload

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// mixParams is testParams with the biases and norms in group 1 (with
// Options.Groups).
func mixParams(groups bool) []Param {
	ps := slices.Clone(testParams)
	if groups {
		for i := range ps {
			if ps[i].Name != "wte.weight" && ps[i].Name != "h.0.attn.c_attn.weight" {
				ps[i].Group = 1
			}
		}
	}
	return ps
}

// mixRig is a specRig over any params.
type mixRig struct{ specRig }

func newMixRig(t *testing.T, ps []Param, base Options, s perfmodel.Schedule, budget int64) *mixRig {
	t.Helper()
	return &mixRig{*newRig(t, ps, base, specHeld, s, budget)}
}

// backwardAll is specRig.backward that also fills b's host gradients
// (for a Step without GradOnDevice), with a NaN in ln_f.bias's.
func (r *mixRig) backwardAll(t *testing.T, k int64, scale float32, nan bool) {
	t.Helper()
	fill(r.ref, k)
	scaleGrads(r.ref, scale)
	if nan {
		i, _ := r.ref.Index("ln_f.bias")
		r.ref.Grad(i).Uint16()[1] = 0x7fc0
	}
	r.send(t, true, true)
}

// TestSpeculateMix: every call a user may make between the backward
// and the Step, against the host optimizer, bitwise after every step,
// with and without amsgrad and parameter groups.
func TestSpeculateMix(t *testing.T) {
	type act struct {
		name  string
		scale float32
		nan   bool
		loss  float64
		noDev bool // Step without GradOnDevice
		mid   func(t *testing.T, o *Optimizer, root string)
	}
	acts := []act{
		{name: "plain", scale: 0.01},
		{name: "plain", scale: 0.01},
		{name: "SetLR between", scale: 0.01, mid: func(t *testing.T, o *Optimizer, _ string) { mustOK(t, o.SetLR(3e-3)) }},
		{name: "plain", scale: 0.01},
		{name: "SetGroupLR between", scale: 0.01, mid: func(t *testing.T, o *Optimizer, _ string) { mustOK(t, o.SetGroupLR(len(o.opts.groups())-1, 7e-4)) }},
		{name: "SetLR back and forth", scale: 0.01, mid: func(t *testing.T, o *Optimizer, _ string) {
			lr := o.opts.Hyper.LR
			mustOK(t, o.SetLR(lr*2))
			mustOK(t, o.SetLR(lr))
		}},
		{name: "loss scale 8", scale: 0.01, loss: 8},
		{name: "loss scale 8 again", scale: 0.01, loss: 8},
		{name: "GradOnDevice false", scale: 0.01, loss: 8, noDev: true},
		{name: "loss scale back to 1", scale: 0.01},
		{name: "plain", scale: 0.01},
		{name: "clip", scale: 1},
		{name: "paused", scale: 0.01},
		{name: "plain", scale: 0.01},
		{name: "nan", scale: 0.01, nan: true},
		{name: "paused", scale: 0.01},
		{name: "plain", scale: 0.01},
		{name: "Master between", scale: 0.01, mid: func(t *testing.T, o *Optimizer, _ string) { _, err := o.Master(2); mustOK(t, err) }},
		{name: "plain", scale: 0.01},
		{name: "SetStepCount between", scale: 0.01, mid: func(t *testing.T, o *Optimizer, _ string) { mustOK(t, o.SetStepCount(o.step+3)) }},
		{name: "plain", scale: 0.01},
		{name: "SetParam between", scale: 0.01, noDev: true, mid: func(t *testing.T, o *Optimizer, _ string) {
			v := make([]float32, 48)
			for j := range v {
				v[j] = float32(j) / 100
			}
			mustOK(t, o.SetParam("h.0.attn.c_attn.bias", v))
		}},
		{name: "plain", scale: 0.01, noDev: true},
		{name: "plain", scale: 0.01},
		{name: "LoadCheckpoint between", scale: 0.01, noDev: true, mid: func(t *testing.T, o *Optimizer, root string) {
			_, _, err := o.LoadCheckpoint(checkpoint.OS, root)
			mustOK(t, err)
		}},
		{name: "plain", scale: 0.01, noDev: true},
		{name: "plain", scale: 0.01},
		{name: "plain", scale: 0.01},
	}
	for _, ams := range []bool{false, true} {
		for _, groups := range []bool{false, true} {
			for _, s := range []perfmodel.Schedule{{CPU: 2, GPU: 1, Resident: 1}, {CPU: 4}} {
				t.Run(fmt.Sprintf("amsgrad=%v/groups=%v/%+v", ams, groups, s), func(t *testing.T) {
					base := specBase()
					base.Hyper = adam.DefaultHyper()
					base.Hyper.AMSGrad = ams
					if groups {
						base.Groups = append([]Group(nil), twoGroups...)
					}
					ps := mixParams(groups)
					r := newMixRig(t, ps, base, s, 1<<20)
					root := filepath.Join(t.TempDir(), "ckpt")
					for k, a := range acts {
						if k == 4 {
							if _, err := r.ref.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
								t.Fatal(err)
							}
						}
						r.backwardAll(t, int64(k+1), a.scale, a.nan)
						if a.mid != nil {
							a.mid(t, r.ref, root)
							a.mid(t, r.b, root)
						}
						args := StepArgs{LossScale: a.loss}
						rr, err := r.ref.Step(args)
						if err != nil {
							t.Fatal(err)
						}
						args.GradOnDevice = !a.noDev
						rb, err := r.b.Step(args)
						if err != nil {
							t.Fatalf("step %d (%s): %v", k, a.name, err)
						}
						if rr.Skipped != rb.Skipped || rr.ClipCoef != rb.ClipCoef || rr.Step != rb.Step {
							t.Fatalf("step %d (%s): reference %+v, speculating %+v", k, a.name, rr, rb)
						}
						t.Logf("step %d (%s): kept %d", k, a.name, rb.Speculated)
						sameState(t, synced(t, r.ref), synced(t, r.b.workingNow(t)))
					}
				})
			}
		}
	}
}

func mustOK(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestSpeculateFault: a copy or launch that fails in the phase of a
// step that kept speculative updates: the step is completed subgroup by
// subgroup (FaultError) and must be the serial step, bit for bit.
func TestSpeculateFault(t *testing.T) {
	for k := 1; k <= 40; k++ {
		t.Run(fmt.Sprint(k), func(t *testing.T) {
			base := specBase()
			r := newMixRig(t, mixParams(false), base, perfmodel.Schedule{CPU: 2, GPU: 1, Resident: 1}, 1<<20)
			r.backwardAll(t, 1, 0.01, false)
			if _, err := r.ref.Step(StepArgs{}); err != nil {
				t.Fatal(err)
			}
			if _, err := r.b.Step(StepArgs{GradOnDevice: true}); err != nil {
				t.Fatal(err)
			}
			r.backwardAll(t, 2, 0.01, false)
			if _, err := r.ref.Step(StepArgs{}); err != nil {
				t.Fatal(err)
			}
			r.sim.FailAfter(k)
			rb, err := r.b.Step(StepArgs{GradOnDevice: true})
			r.sim.FailAfter(0)
			var fe *scheduler.FaultError
			switch {
			case err == nil:
			case errors.As(err, &fe):
			case errors.Is(err, scheduler.ErrBroken):
				t.Skipf("broken: %v", err)
			default:
				t.Logf("step not taken: %v (step %d, kept %d)", err, rb.Step, rb.Speculated)
				if r.b.StepCount() == 1 {
					// Not taken: take it again.
					if _, err := r.b.Step(StepArgs{GradOnDevice: true}); err != nil {
						t.Fatal(err)
					}
				}
			}
			sameState(t, synced(t, r.ref), synced(t, r.b.workingNow(t)))
		})
	}
}
