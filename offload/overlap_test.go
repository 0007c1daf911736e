package offload

import (
	"errors"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/scheduler"
)

// TestGradsFinal: a trainer that writes the gradients on a stream of its
// own, parameter by parameter from the last, without waiting, and tells
// the optimizer after each (GradsFinal), gets the host path's state and
// working copy bit for bit on every schedule, through a skipped step (a
// non-finite gradient prefetched, then dropped), a step told of only some
// parameters and a SetParam between a prefetch and its Step. The
// simulated device's ordering check proves that no prefetched copy read a
// gradient before the trainer's stream wrote it.
func TestGradsFinal(t *testing.T) {
	for _, c := range gradOnDeviceCases() {
		t.Run(c.name, func(t *testing.T) {
			ropts, dopts := c.opts, c.opts
			sim := scheduler.NewSim(scheduler.SimOptions{})
			ropts.Device, ropts.Schedule = scheduler.NewSim(scheduler.SimOptions{}), &c.s
			dopts.Device, dopts.Schedule, dopts.OverlapBackward = sim, &c.s, true
			ref := newWith(t, c.params, ropts)
			o := newWith(t, c.params, dopts)
			grads, works := views(t, o)
			io := newStreamIO(t, sim, 1<<16)
			total := 0
			for _, g := range grads {
				total += int(g.Bytes())
			}
			host, err := sim.AllocHost(int64(total))
			if err != nil {
				t.Fatal(err)
			}
			defer sim.FreeHost(host)
			// The parameters from the last in the flat space to the first.
			order := make([]int, len(grads))
			for i := range order {
				order[i] = i
			}
			slices.SortFunc(order, func(a, b int) int { return o.Params()[b].Offset - o.Params()[a].Offset })
			// backward writes ref's gradients (or, with poison, a NaN in
			// the last parameter's) and tells o after each of the first
			// tell parameters.
			backward := func(tell int, poison bool) {
				t.Helper()
				at := int64(0)
				for k, i := range order {
					b := tensorBytes(ref.Grad(i))
					copy(host.Bytes()[at:], b)
					if poison && k == 0 {
						copy(host.Bytes()[at:], []byte{0xff, 0xff, 0xff, 0xff})
					}
					g := grads[i]
					if err := sim.H2D(io.s, g.Vec.Mem, g.Vec.Off*int64(g.DType.Size()), host, at, g.Bytes()); err != nil {
						t.Fatal(err)
					}
					at += g.Bytes()
					if k < tell {
						if err := o.GradsFinal(scheduler.Stream(io.s), i); err != nil {
							t.Fatal(err)
						}
					}
				}
				if err := errors.Join(sim.Record(io.ev, io.s), sim.Sync(io.ev)); err != nil {
					t.Fatal(err)
				}
			}
			if err := o.SyncDevice(); err != nil {
				t.Fatal(err)
			}
			for step := int64(1); step <= 5; step++ {
				fill(ref, step)
				tell := len(order)
				switch step {
				case 2: // a skipped step first: the prefetch is dropped
					backward(tell, true)
					if r, err := o.Step(StepArgs{GradOnDevice: true}); err != nil || !r.Skipped {
						t.Fatalf("a NaN gradient: %+v %v", r, err)
					}
				case 3:
					tell = len(order) / 2
				case 4: // SetParam between the prefetch and the Step
					backward(tell, false)
					m, err := ref.Master(0)
					if err != nil {
						t.Fatal(err)
					}
					v := slices.Clone(m)
					v[0] = float32(math.Pi)
					if err := errors.Join(ref.SetParam(ref.Params()[0].Name, v), o.SetParam(o.Params()[0].Name, v), o.SyncDevice()); err != nil {
						t.Fatal(err)
					}
				}
				if step != 4 {
					backward(tell, false)
				}
				a, err := ref.Step(StepArgs{})
				if err != nil {
					t.Fatal(err)
				}
				b, err := o.Step(StepArgs{GradOnDevice: true})
				if err != nil {
					t.Fatal(err)
				}
				if a.Step != b.Step || a.Skipped || b.Skipped || a.GradNorm != b.GradNorm {
					t.Fatalf("step %d: host path %+v, overlapped %+v", step, a, b)
				}
				sameDeviceCopy(t, io, works, ref)
			}
			sameState(t, synced(t, ref), synced(t, o.workingNow(t)))
			if err := sim.OrderErr(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestGradsFinalErrors: GradsFinal without OverlapBackward or a device,
// with a bad index, and after Close.
func TestGradsFinalErrors(t *testing.T) {
	opts, sim := deviceOpts(Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400}, gradOnDeviceCases()[0].s)
	s, _ := sim.NewStream()
	o := newTest(t, opts)
	if err := o.GradsFinal(s, 0); err == nil || !strings.Contains(err.Error(), "OverlapBackward") {
		t.Errorf("without OverlapBackward: %v", err)
	}
	if _, err := New(testParams, Options{OverlapBackward: true}); err == nil || !strings.Contains(err.Error(), "OverlapBackward and ResidentFirst need a Device") {
		t.Errorf("OverlapBackward without a device: %v", err)
	}
	opts.OverlapBackward = true
	o = newTest(t, opts)
	if err := o.GradsFinal(s, len(testParams)); err == nil || !strings.Contains(err.Error(), "parameter index") {
		t.Errorf("index out of range: %v", err)
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	if err := o.GradsFinal(s, 0); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
}

// overlapRig is a reference optimizer (the host path) and an overlapped one
// (OverlapBackward, GradOnDevice) on the simulated device, with a
// trainer's stream that writes the gradients.
type overlapRig struct {
	t      *testing.T
	ref, o *Optimizer
	sim    *scheduler.Sim
	io     *streamIO
	grads  []DeviceTensor
	works  []DeviceTensor
	host   scheduler.Host
	order  []int // the parameters from the last in the flat space
}

func newOverlapRig(t *testing.T, c gradOnDeviceCase) *overlapRig {
	ropts, dopts := c.opts, c.opts
	sim := scheduler.NewSim(scheduler.SimOptions{})
	ropts.Device, ropts.Schedule = scheduler.NewSim(scheduler.SimOptions{}), &c.s
	dopts.Device, dopts.Schedule, dopts.OverlapBackward = sim, &c.s, true
	r := &overlapRig{t: t, sim: sim}
	r.ref = newWith(t, c.params, ropts)
	r.o = newWith(t, c.params, dopts)
	r.grads, r.works = views(t, r.o)
	r.io = newStreamIO(t, sim, 1<<16)
	total := 0
	for _, g := range r.grads {
		total += int(g.Bytes())
	}
	h, err := sim.AllocHost(int64(total))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sim.FreeHost(h) })
	r.host = h
	r.order = make([]int, len(r.grads))
	for i := range r.order {
		r.order[i] = i
	}
	slices.SortFunc(r.order, func(a, b int) int { return r.o.Params()[b].Offset - r.o.Params()[a].Offset })
	if err := r.o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	return r
}

// backward writes ref's gradients into o's device gradients on the
// trainer's stream, without waiting, telling o after each parameter.
func (r *overlapRig) backward() {
	t := r.t
	t.Helper()
	at := int64(0)
	for _, i := range r.order {
		copy(r.host.Bytes()[at:], tensorBytes(r.ref.Grad(i)))
		g := r.grads[i]
		if err := r.sim.H2D(r.io.s, g.Vec.Mem, g.Vec.Off*int64(g.DType.Size()), r.host, at, g.Bytes()); err != nil {
			t.Fatal(err)
		}
		at += g.Bytes()
		if err := r.o.GradsFinal(scheduler.Stream(r.io.s), i); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(r.sim.Record(r.io.ev, r.io.s), r.sim.Sync(r.io.ev)); err != nil {
		t.Fatal(err)
	}
}

// stepBoth steps both and compares the results and then the state.
func (r *overlapRig) stepBoth() {
	t := r.t
	t.Helper()
	a, err := r.ref.Step(StepArgs{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := r.o.Step(StepArgs{GradOnDevice: true})
	if err != nil {
		t.Fatal(err)
	}
	if a.Step != b.Step || a.Skipped != b.Skipped || a.GradNorm != b.GradNorm {
		t.Fatalf("host path %+v, overlapped %+v", a, b)
	}
	sameDeviceCopy(t, r.io, r.works, r.ref)
	sameState(t, synced(t, r.ref), synced(t, r.o.workingNow(t)))
	if err := r.sim.OrderErr(); err != nil {
		t.Fatal(err)
	}
}

// TestGradsFinalRefusedStep: a Step refused before its update phase (a bad
// LossScale; the error of a failed lazy save) drops what GradsFinal
// started, so that the next backward's gradients, written over the old
// ones without ZeroGrad (as the GPU trainer does), are the ones the next
// Step uses (an adversarial review found the old ones used).
func TestGradsFinalRefusedStep(t *testing.T) {
	for _, c := range gradOnDeviceCases() {
		t.Run(c.name, func(t *testing.T) {
			r := newOverlapRig(t, c)
			fill(r.ref, 1)
			r.backward()
			if _, err := r.o.Step(StepArgs{GradOnDevice: true, LossScale: -1}); err == nil {
				t.Fatal("LossScale -1 accepted")
			}
			fill(r.ref, 2)
			r.backward()
			r.stepBoth()
		})
	}
	t.Run("failed save", func(t *testing.T) {
		r := newOverlapRig(t, gradOnDeviceCases()[0])
		fill(r.ref, 1)
		r.backward()
		r.stepBoth()
		var n atomic.Int64
		h, err := r.o.SaveAsync(smallEngine(t, fullOS{checkpoint.OS, 0, &n}, t.TempDir()), 1, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := h.Wait(); err == nil {
			t.Fatal("a save on a full disk succeeded")
		}
		fill(r.ref, 2)
		r.backward()
		if _, err := r.o.Step(StepArgs{GradOnDevice: true}); err == nil {
			t.Fatal("the failed save was not reported")
		}
		fill(r.ref, 3)
		r.backward()
		r.stepBoth()
	})
}
