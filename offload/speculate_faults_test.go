package offload

import (
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// TestSpeculateGradsFinalFault: CPU subgroups only (no OffloadParam),
// with a mirror (DeviceMasters) and groups; a copy fails at each of the
// first operations of the backward's GradsFinal calls (Prefetch fails
// midway: dropped), the trainer goes on and steps; then a fault in the
// phase after a kept speculation. Bitwise the host optimizer after each.
func TestSpeculateGradsFinalFault(t *testing.T) {
	for _, s := range []perfmodel.Schedule{{CPU: 5}, {CPU: 3, GPU: 1, Resident: 1}} {
		for k := 1; k <= 12; k++ {
			t.Run(fmt.Sprintf("%+v/%d", s, k), func(t *testing.T) {
				base := specBase()
				base.Hyper = adam.DefaultHyper()
				base.Hyper.AMSGrad = k%2 == 0
				base.Groups = append([]Group(nil), twoGroups...)
				ps := mixParams(true)
				ref := newWith(t, ps, base)
				sim := scheduler.NewSim(scheduler.SimOptions{})
				o := base
				o.Device, o.Schedule, o.OverlapBackward, o.Speculate = sim, &s, true, 1<<20
				o.DeviceMasters = []string{"wte.weight", "ln_f.bias"}
				b := newWith(t, ps, o)
				io := newStreamIO(t, sim, 1<<16)
				host, err := sim.AllocHost(1 << 16)
				if err != nil {
					t.Fatal(err)
				}
				defer sim.FreeHost(host)
				if err := b.SyncDevice(); err != nil {
					t.Fatal(err)
				}
				for step := int64(1); step <= 4; step++ {
					fill(ref, step)
					scaleGrads(ref, 0.01)
					at := int64(0)
					for i := len(ps) - 1; i >= 0; i-- {
						src := tensorBytes(ref.Grad(i))
						g, err := b.DeviceGrad(i)
						if err != nil {
							t.Fatal(err)
						}
						copy(host.Bytes()[at:], src)
						if err := sim.H2D(io.s, g.Vec.Mem, g.Vec.Off*int64(g.DType.Size()), host, at, g.Bytes()); err != nil {
							t.Fatal(err)
						}
						at += g.Bytes()
						if step == 2 && i == len(ps)-1-(k%4) {
							sim.FailAfter(1 + k/4)
						}
						gerr := b.GradsFinal(scheduler.Stream(io.s), i)
						sim.FailAfter(0)
						if gerr != nil {
							t.Logf("step %d GradsFinal(%d): %v", step, i, gerr)
						}
					}
					sim.FailAfter(0)
					if err := errors.Join(sim.Record(io.ev, io.s), sim.Sync(io.ev)); err != nil {
						t.Fatal(err)
					}
					b.eng.WaitSpeculation()
					if _, err := ref.Step(StepArgs{}); err != nil {
						t.Fatal(err)
					}
					if step == 3 {
						sim.FailAfter(k)
					}
					rb, err := b.Step(StepArgs{GradOnDevice: true})
					sim.FailAfter(0)
					var fe *scheduler.FaultError
					if err != nil && !errors.As(err, &fe) {
						t.Fatalf("step %d: %v", step, err)
					}
					t.Logf("step %d: kept %d, %v", step, rb.Speculated, err)
					sameState(t, synced(t, ref), synced(t, b.workingNow(t)))
					for _, name := range o.DeviceMasters {
						i, _ := b.Index(name)
						dm, err := b.DeviceMaster(i)
						if err != nil {
							t.Fatal(err)
						}
						want, _ := ref.Master(i)
						buf, err := sim.AllocHost(4 * int64(len(want)))
						if err != nil {
							t.Fatal(err)
						}
						if err := errors.Join(sim.D2H(io.s, buf, 0, dm.Vec.Mem, 4*dm.Vec.Off, 4*int64(len(want))), sim.Record(io.ev, io.s), sim.Sync(io.ev)); err != nil {
							t.Fatal(err)
						}
						got := adam.State{}.Param
						_ = got
						bb := buf.Bytes()
						for j := range want {
							u := uint32(bb[4*j]) | uint32(bb[4*j+1])<<8 | uint32(bb[4*j+2])<<16 | uint32(bb[4*j+3])<<24
							if u != mathBits(want[j]) {
								t.Fatalf("step %d: DeviceMaster %s[%d] differs", step, name, j)
							}
						}
						sim.FreeHost(buf)
					}
				}
				if err := sim.OrderErr(); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

func mathBits(f float32) uint32 { return math.Float32bits(f) }
