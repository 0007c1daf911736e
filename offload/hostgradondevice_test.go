package offload

import (
	"errors"
	"slices"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// TestHostGradOnDevice: an optimizer told where its host-held gradients
// also are on the device (HostGradOnDevice, each step, as a streaming
// trainer does) steps bit for bit as one that sums them on the host, with
// clipping that binds and a loss scale (the first step's sums, taken with
// the last step's scale of 1, are not used; the others are); one told of a
// device copy of zeros reports another norm, so the sums are the device's;
// a parameter that is not host-held, a range outside the buffer and an
// index out of range are refused or panic as documented.
func TestHostGradOnDevice(t *testing.T) {
	params := []Param{
		{Name: "h.0.attn.c_attn.weight", Shape: []int{3, 40000}},
		{Name: "h.0.ln_2.weight", Shape: []int{100}},
		{Name: "h.0.mlp.c_fc.weight", Shape: []int{70000}},
	}
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 0.5, Threads: 2,
		OffloadParam: []string{"h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight"}, Schedule: &perfmodel.Schedule{CPU: 1}}
	mk := func() (*Optimizer, *scheduler.Sim) {
		d := scheduler.NewSim(scheduler.SimOptions{})
		o := base
		o.Device = d
		return newWith(t, params, o), d
	}
	ref, _ := mk()
	dev, d := mk()
	zero, dz := mk()
	defer ref.Close()
	defer dev.Close()
	defer zero.Close()
	// The device copies: the gradients of the held parameters, flat.
	n := int64(3*40000 + 70000)
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	sz, err := dz.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	mem, err := d.Alloc(2 * n)
	if err != nil {
		t.Fatal(err)
	}
	memZ, err := dz.Alloc(2 * n)
	if err != nil {
		t.Fatal(err)
	}
	at := map[int]int64{0: 0, 2: 3 * 40000}
	for _, o := range []*Optimizer{dev, zero} {
		if err := o.SyncDevice(); err != nil {
			t.Fatal(err)
		}
	}
	for step := int64(1); step <= 3; step++ {
		fill(ref, step)
		for _, o := range []*Optimizer{dev, zero} {
			for i := range params {
				g := tensorBytes(ref.Grad(i))
				if i == 1 {
					dv, err := o.DeviceGrad(i)
					if err != nil {
						t.Fatal(err)
					}
					b, err := o.opts.Device.(*scheduler.Sim).HostView(dv.Vec, 2)
					if err != nil {
						t.Fatal(err)
					}
					copy(b, g)
					continue
				}
				hg, err := o.HostGrad(i)
				if err != nil {
					t.Fatal(err)
				}
				copy(hg.Bytes, g)
				if o == dev {
					b, err := d.HostView(scheduler.Vec{Mem: mem, Off: at[i], N: int64(len(g) / 2)}, 2)
					if err != nil {
						t.Fatal(err)
					}
					copy(b, g)
					if err := o.HostGradOnDevice(s, i, mem, at[i]); err != nil {
						t.Fatal(err)
					}
				} else if err := o.HostGradOnDevice(sz, i, memZ, at[i]); err != nil {
					t.Fatal(err)
				}
			}
		}
		a, err := ref.Step(StepArgs{LossScale: 8})
		if err != nil {
			t.Fatal(err)
		}
		b, err := dev.Step(StepArgs{LossScale: 8, GradOnDevice: true})
		if err != nil {
			t.Fatal(err)
		}
		z, err := zero.Step(StepArgs{LossScale: 8, GradOnDevice: true})
		if err != nil {
			t.Fatal(err)
		}
		if a.GradNorm != b.GradNorm || a.ClipCoef != b.ClipCoef || a.ClipCoef >= 1 {
			t.Fatalf("step %d: reference %+v, sums on the device %+v", step, a, b)
		}
		// Step 1's sums were taken with the scale of 1, not 8: unused.
		if (step == 1) != (z.GradNorm == a.GradNorm) {
			t.Fatalf("step %d: zero device copy: norm %v, reference %v", step, z.GradNorm, a.GradNorm)
		}
		for i := range params {
			if !slices.Equal(tensorBytes(ref.Working(i)), tensorBytes(dev.Working(i))) {
				t.Fatalf("step %d: working copy of %s differs", step, params[i].Name)
			}
		}
	}
	sameState(t, synced(t, ref), synced(t, dev))
	if err := d.OrderErr(); err != nil {
		t.Fatal(err)
	}
	if err := dev.HostGradOnDevice(s, 1, mem, 0); err == nil {
		t.Error("a parameter that is not host-held: no error")
	}
	if err := dev.HostGradOnDevice(s, 2, mem, n-10); err == nil {
		t.Error("a range past the buffer's end: no error")
	}
	if err := dev.HostGradOnDevice(s, 2, nil, 0); err == nil {
		t.Error("no buffer: no error")
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("index 3 of 3: no panic")
			}
		}()
		_ = dev.HostGradOnDevice(s, 3, mem, 0)
	}()
	_ = dev.Close()
	if err := dev.HostGradOnDevice(s, 0, mem, 0); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: %v, want ErrClosed", err)
	}
}
