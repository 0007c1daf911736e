package offload

import (
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
)

// TestHostGradOnFirstUse: with Options.Device the host gradient buffers
// (Grad's) are made at their first use, so a trainer whose gradients stay
// on the device (StepArgs.GradOnDevice) never holds them; the first Grad
// gives zeros, and a Step without GradOnDevice then reads what was
// written, as the host optimizer does. Without a device they are made by
// New.
func TestHostGradOnFirstUse(t *testing.T) {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 300, MaxGradNorm: 1, Threads: 2}
	if host := newTest(t, base); host.grad.U16 == nil {
		t.Fatal("without a device, New did not make the host gradients")
	}
	opts, _ := deviceOpts(base, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 2})
	o := newTest(t, opts)
	if o.grad.U16 != nil || o.grad.F32 != nil {
		t.Fatal("New made the host gradients with a device")
	}
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	for range 2 { // the device gradients New zeroed
		if _, err := o.Step(StepArgs{LossScale: 2, GradOnDevice: true}); err != nil {
			t.Fatal(err)
		}
	}
	if err := o.ZeroGrad(); err != nil {
		t.Fatal(err)
	}
	if o.grad.U16 != nil {
		t.Fatal("Step with GradOnDevice, or ZeroGrad, made the host gradients")
	}
	g := o.Grad(0).Uint16()
	if len(g) != o.Params()[0].Len {
		t.Fatalf("Grad(0) has %d elements, want %d", len(g), o.Params()[0].Len)
	}
	for j, v := range g {
		if v != 0 {
			t.Fatalf("Grad(0)[%d] = %#x on first use, want zero", j, v)
		}
	}
	// From here on it is the host optimizer's: the same steps, the same
	// state, against one that took the two zero-gradient steps too.
	ref := newTest(t, base)
	for range 2 {
		if _, err := ref.Step(StepArgs{LossScale: 2}); err != nil {
			t.Fatal(err)
		}
	}
	for step := int64(3); step <= 4; step++ {
		fill(o, step)
		fill(ref, step)
		a, err := ref.Step(StepArgs{LossScale: 2})
		if err != nil {
			t.Fatal(err)
		}
		b, err := o.Step(StepArgs{LossScale: 2})
		if err != nil {
			t.Fatal(err)
		}
		if a.GradNorm != b.GradNorm || a.Step != b.Step {
			t.Fatalf("step %d: host %+v, device %+v", step, a, b)
		}
		sameState(t, ref, synced(t, o))
	}
}
