package offload

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/internal/cuda"
	"github.com/deepstates/dos/internal/kernels"
	"github.com/deepstates/dos/perfmodel"
	"github.com/deepstates/dos/scheduler"
)

// The GPU trainer's path: gradients written and the working copy read in
// the engine's device buffers (DeviceGrad, DeviceWorking), steps with
// StepArgs.GradOnDevice. Each test runs a trainer-like loop against a
// reference optimizer on the same kind of device and schedule that takes
// the host path (Grad, SetGrad, GetWorking), and compares bit for bit.

// deviceIO is how a test trainer reaches device memory through a view: put
// writes b (the view's bytes) and get reads them; both complete before
// they return, as a GPU trainer synchronizes its stream before Step.
type deviceIO interface {
	put(t *testing.T, v DeviceTensor, b []byte)
	get(t *testing.T, v DeviceTensor) []byte
}

// hostViewIO writes and reads the simulated device's memory directly
// (scheduler.Sim.HostView), as kernels would.
type hostViewIO struct{ sim *scheduler.Sim }

func (x hostViewIO) view(t *testing.T, v DeviceTensor) []byte {
	t.Helper()
	b, err := x.sim.HostView(v.Vec, int64(v.DType.Size()))
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(b)) != v.Bytes() {
		t.Fatalf("%s: %d bytes, want %d", v.Name, len(b), v.Bytes())
	}
	return b
}

func (x hostViewIO) put(t *testing.T, v DeviceTensor, b []byte) { copy(x.view(t, v), b) }
func (x hostViewIO) get(t *testing.T, v DeviceTensor) []byte    { return slices.Clone(x.view(t, v)) }

// streamIO copies through the device on a stream of the trainer's own,
// then waits for it: on the simulated device its ordering check sees the
// trainer's copies and the engine's work, so a write of a Step that was
// not complete when Step returned fails the next read with ErrOrder.
type streamIO struct {
	d  scheduler.Device
	s  scheduler.Stream
	ev scheduler.Event
	h  scheduler.Host
}

func newStreamIO(t *testing.T, d scheduler.Device, bytes int64) *streamIO {
	t.Helper()
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	ev, err := d.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	h, err := d.AllocHost(bytes)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _, _ = d.FreeHost(h), d.FreeEvent(ev), d.FreeStream(s) })
	return &streamIO{d: d, s: s, ev: ev, h: h}
}

func (x *streamIO) put(t *testing.T, v DeviceTensor, b []byte) {
	t.Helper()
	copy(x.h.Bytes(), b)
	size := int64(v.DType.Size())
	if err := errors.Join(x.d.H2D(x.s, v.Vec.Mem, v.Vec.Off*size, x.h, 0, v.Bytes()), x.d.Record(x.ev, x.s), x.d.Sync(x.ev)); err != nil {
		t.Fatalf("writing %s: %v", v.Name, err)
	}
}

func (x *streamIO) get(t *testing.T, v DeviceTensor) []byte {
	t.Helper()
	size := int64(v.DType.Size())
	if err := errors.Join(x.d.D2H(x.s, x.h, 0, v.Vec.Mem, v.Vec.Off*size, v.Bytes()), x.d.Record(x.ev, x.s), x.d.Sync(x.ev)); err != nil {
		t.Fatalf("reading %s: %v", v.Name, err)
	}
	return slices.Clone(x.h.Bytes()[:v.Bytes()])
}

// tensorBytes is a host tensor's memory.
func tensorBytes(x Tensor) []byte {
	if x.DType == adam.F32 {
		f := x.Float32()
		return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(f))), 4*len(f))
	}
	u := x.Uint16()
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(u))), 2*len(u))
}

// newWith is newTest over params: random initial weights (SetParam).
func newWith(t *testing.T, params []Param, opts Options) *Optimizer {
	t.Helper()
	o, err := New(params, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := o.Close(); err != nil {
			t.Error(err)
		}
	})
	r := rand.New(rand.NewPCG(1, 1))
	for _, p := range o.Params() {
		v := make([]float32, p.Len)
		for j := range v {
			v[j] = float32(r.NormFloat64())
		}
		if err := o.SetParam(p.Name, v); err != nil {
			t.Fatal(err)
		}
	}
	return o
}

// views returns every parameter's device gradient and working copy.
func views(t *testing.T, o *Optimizer) (grads, works []DeviceTensor) {
	t.Helper()
	for i, p := range o.Params() {
		g, err := o.DeviceGrad(i)
		if err != nil {
			t.Fatal(err)
		}
		w, err := o.DeviceWorking(i)
		if err != nil {
			t.Fatal(err)
		}
		if g.Len != p.Len || g.Vec.Off != int64(p.Offset) || g.Vec.N != int64(p.Len) || w.Vec.Off != int64(p.Offset) || g.Name != p.Name || !slices.Equal(w.Shape, p.Shape) {
			t.Fatalf("views of %s (offset %d, %d elements): %+v, %+v", p.Name, p.Offset, p.Len, g.Vec, w.Vec)
		}
		if g.DType != o.opts.GradDType || w.DType != o.opts.WorkingDType {
			t.Fatalf("dtypes %v, %v", g.DType, w.DType)
		}
		grads, works = append(grads, g), append(works, w)
	}
	return grads, works
}

// sameDeviceCopy checks that the device working copy, read through the
// views, is want's host working copy bit for bit.
func sameDeviceCopy(t *testing.T, io deviceIO, works []DeviceTensor, want *Optimizer) {
	t.Helper()
	for i, w := range works {
		if got, exp := io.get(t, w), tensorBytes(want.Working(i)); !slices.Equal(got, exp) {
			t.Fatalf("device working copy of %s differs from the host path's", w.Name)
		}
	}
}

// writeGrads writes ref's host gradients into o's device gradients.
func writeGrads(t *testing.T, io deviceIO, grads []DeviceTensor, ref *Optimizer) {
	t.Helper()
	for i, g := range grads {
		io.put(t, g, tensorBytes(ref.Grad(i)))
	}
}

type gradOnDeviceCase struct {
	name   string
	params []Param
	opts   Options
	s      perfmodel.Schedule
}

func gradOnDeviceCases() []gradOnDeviceCase {
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 0.5, SubgroupSize: 400, Threads: 2}
	f32 := base
	f32.GradDType = adam.F32
	ams := base
	ams.Hyper = adam.DefaultHyper()
	ams.Hyper.AMSGrad = true
	ams.WorkingDType = adam.F16
	groups := base
	groups.Groups, groups.SubgroupSize = twoGroups, 300
	return []gradOnDeviceCase{
		{"mixed", testParams, base, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 1}},
		{"resident", testParams, base, perfmodel.Schedule{Resident: 5}},
		{"streamed", testParams, base, perfmodel.Schedule{GPU: 5}},
		{"cpu", testParams, base, perfmodel.Schedule{CPU: 5}},
		{"upcast", testParams, base, perfmodel.Schedule{CPU: 3, GPU: 1, Resident: 1, UpcastOnGPU: true}},
		{"f32-grad", testParams, f32, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 1}},
		{"amsgrad-f16", testParams, ams, perfmodel.Schedule{CPU: 1, GPU: 2, Resident: 2}},
		{"groups", groupParams, groups, perfmodel.Schedule{CPU: 3, GPU: 2, Resident: 2}},
	}
}

// TestGradOnDevice: a trainer that writes the gradients into the device
// views and steps with GradOnDevice gets, step after step, the master
// weights, exp_avg, exp_avg_sq (max_exp_avg_sq) and working copy of the
// host path (SetGrad, GetWorking) on the same schedule, bit for bit, with
// clipping and a loss scale, on every schedule, gradient dtype and with
// parameter groups; the device copy is current after each Step and the
// host copy once Working fetches it. On the simulated device, through its
// memory directly and through copies on a stream of the trainer's own
// (the ordering check then sees the trainer's reads of the working copy
// after Step); on a GPU through copies on a stream and through the raw
// pointers (DeviceTensor.Ptr).
func TestGradOnDevice(t *testing.T) {
	for _, c := range gradOnDeviceCases() {
		t.Run("sim/hostview/"+c.name, func(t *testing.T) {
			testGradOnDevice(t, c, func() scheduler.Device { return scheduler.NewSim(scheduler.SimOptions{}) },
				func(t *testing.T, d scheduler.Device) deviceIO { return hostViewIO{d.(*scheduler.Sim)} })
		})
		t.Run("sim/stream/"+c.name, func(t *testing.T) {
			testGradOnDevice(t, c, func() scheduler.Device { return scheduler.NewSim(scheduler.SimOptions{}) },
				func(t *testing.T, d scheduler.Device) deviceIO { return newStreamIO(t, d, 1<<16) })
		})
	}
	withCUDA(t, func(t *testing.T, d *cuda.Device, k *kernels.Kernels) {
		dev := scheduler.NewCUDA(d, k)
		for _, c := range gradOnDeviceCases() {
			t.Run("cuda/stream/"+c.name, func(t *testing.T) {
				testGradOnDevice(t, c, func() scheduler.Device { return dev },
					func(t *testing.T, d scheduler.Device) deviceIO { return newStreamIO(t, d, 1<<16) })
			})
			t.Run("cuda/ptr/"+c.name, func(t *testing.T) {
				testGradOnDevice(t, c, func() scheduler.Device { return dev },
					func(t *testing.T, _ scheduler.Device) deviceIO { return newPtrIO(t, d, 1<<16) })
			})
		}
	})
}

func testGradOnDevice(t *testing.T, c gradOnDeviceCase, newDev func() scheduler.Device, newIO func(*testing.T, scheduler.Device) deviceIO) {
	ropts, dopts := c.opts, c.opts
	ropts.Device, ropts.Schedule = newDev(), &c.s
	dopts.Device, dopts.Schedule = newDev(), &c.s
	for i, p := range c.params { // every other parameter, as a trainer's LayerNorms
		if i%2 == 1 {
			dopts.DeviceMasters = append(dopts.DeviceMasters, p.Name)
		}
	}
	ref := newWith(t, c.params, ropts)
	o := newWith(t, c.params, dopts)
	io := newIO(t, dopts.Device)
	grads, works := views(t, o)
	masters := map[int]DeviceTensor{}
	for _, name := range dopts.DeviceMasters {
		i, _ := o.Index(name)
		m, err := o.DeviceMaster(i)
		if err != nil {
			t.Fatal(err)
		}
		if m.DType != adam.F32 || m.Len != o.Params()[i].Len || m.Name != name {
			t.Fatalf("DeviceMaster(%s): %v %d elements", name, m.DType, m.Len)
		}
		masters[i] = m
	}
	if _, err := o.DeviceMaster(0); err == nil || !strings.Contains(err.Error(), "DeviceMasters") {
		t.Fatalf("DeviceMaster of a parameter not in DeviceMasters: %v", err)
	}
	// sameMasters checks the device fp32 masters against ref's, bitwise.
	sameMasters := func(when string) {
		t.Helper()
		for i, m := range masters {
			want, err := ref.Master(i)
			if err != nil {
				t.Fatal(err)
			}
			if got := io.get(t, m); !slices.Equal(got, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(want))), 4*len(want))) {
				t.Fatalf("%s: the device master weights of %s differ from the host path's", when, m.Name)
			}
		}
	}
	// The forward of step 1 needs the initial weights on the device.
	fill(ref, 1)
	writeGrads(t, io, grads, ref)
	if _, err := o.Step(StepArgs{GradOnDevice: true}); err == nil || !strings.Contains(err.Error(), "SyncDevice") || o.StepCount() != 0 {
		t.Fatalf("Step with GradOnDevice before SyncDevice: %v, step %d", err, o.StepCount())
	}
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	sameDeviceCopy(t, io, works, ref)
	sameMasters("after SyncDevice")
	for step := int64(1); step <= 4; step++ {
		fill(ref, step)
		writeGrads(t, io, grads, ref)
		fill(o, step+100) // the host buffers, which GradOnDevice must not read
		a, err := ref.Step(StepArgs{LossScale: 8})
		if err != nil {
			t.Fatal(err)
		}
		b, err := o.Step(StepArgs{LossScale: 8, GradOnDevice: true})
		if err != nil {
			t.Fatal(err)
		}
		if a.Step != b.Step || a.Skipped || b.Skipped || a.GradNorm != b.GradNorm || a.ClipCoef != b.ClipCoef {
			t.Fatalf("step %d: host path %v, device path %v", step, a, b)
		}
		if a.ClipCoef == 1 {
			t.Fatalf("step %d: not clipped; the test wants clipping", step)
		}
		if !o.workStale.Load() {
			t.Fatal("the host working copy is not marked stale after a Step with GradOnDevice")
		}
		// The next forward reads the new weights on the device.
		sameDeviceCopy(t, io, works, ref)
		sameMasters(fmt.Sprintf("step %d", step))
		if step%2 == 0 {
			// The host copy, fetched by Working, and the state.
			sameState(t, synced(t, ref), synced(t, o.workingNow(t)))
		}
	}
	if sim, ok := dopts.Device.(*scheduler.Sim); ok {
		if err := sim.OrderErr(); err != nil {
			t.Fatal(err)
		}
	}
}

// workingNow calls Working, which fetches the working copy, and checks
// that it did.
func (o *Optimizer) workingNow(t *testing.T) *Optimizer {
	t.Helper()
	_ = o.Working(0)
	if o.workStale.Load() {
		t.Fatal("Working left the host working copy stale")
	}
	return o
}

// TestGradOnDeviceMixed: Steps with and without GradOnDevice alternate on
// one optimizer and equal the host path: a Step without it overwrites the
// device gradients with the host buffers' and brings the copy back.
func TestGradOnDeviceMixed(t *testing.T) {
	c := gradOnDeviceCases()[0]
	ropts, dopts := c.opts, c.opts
	ropts.Device, ropts.Schedule = scheduler.NewSim(scheduler.SimOptions{}), &c.s
	dopts.Device, dopts.Schedule = scheduler.NewSim(scheduler.SimOptions{}), &c.s
	ref := newTest(t, ropts)
	o := newTest(t, dopts)
	io := hostViewIO{dopts.Device.(*scheduler.Sim)}
	grads, works := views(t, o)
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	for step := int64(1); step <= 4; step++ {
		fill(ref, step)
		onDevice := step%2 == 1
		if onDevice {
			writeGrads(t, io, grads, ref)
		} else {
			fill(o, step)
		}
		if _, err := ref.Step(StepArgs{}); err != nil {
			t.Fatal(err)
		}
		if _, err := o.Step(StepArgs{GradOnDevice: onDevice}); err != nil {
			t.Fatal(err)
		}
		if o.workStale.Load() != onDevice {
			t.Fatalf("step %d (on device %v): host copy stale %v", step, onDevice, o.workStale.Load())
		}
		sameDeviceCopy(t, io, works, ref)
	}
	sameState(t, synced(t, ref), synced(t, o))
}

// TestGradOnDeviceLazyHost: after Steps with GradOnDevice, the host views
// of the working copy handed out before them hold the post-step values
// once Working (or SyncHost) fetched them, and after Close without either;
// SetParam keeps every other parameter's host copy current and, after
// SyncDevice, the device's.
func TestGradOnDeviceLazyHost(t *testing.T) {
	c := gradOnDeviceCases()[0]
	ropts, dopts := c.opts, c.opts
	ropts.Device, ropts.Schedule = scheduler.NewSim(scheduler.SimOptions{}), &c.s
	dopts.Device, dopts.Schedule = scheduler.NewSim(scheduler.SimOptions{}), &c.s
	ref := newTest(t, ropts)
	o := newTest(t, dopts)
	io := hostViewIO{dopts.Device.(*scheduler.Sim)}
	grads, works := views(t, o)
	before := make([]Tensor, len(testParams))
	for i := range before {
		before[i] = o.Working(i)
	}
	step := func(n int64) {
		t.Helper()
		fill(ref, n)
		writeGrads(t, io, grads, ref)
		if _, err := ref.Step(StepArgs{}); err != nil {
			t.Fatal(err)
		}
		if _, err := o.Step(StepArgs{GradOnDevice: true}); err != nil {
			t.Fatal(err)
		}
	}
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	step(1)
	step(2)
	if slices.Equal(o.work.Data, ref.work.Data) {
		t.Fatal("the host copy is current without a fetch: the test proves nothing")
	}
	// Working fetches; the views from before see it.
	_ = o.Working(3)
	for i, w := range before {
		if !slices.Equal(w.Uint16(), ref.Working(i).Uint16()) {
			t.Fatalf("%s: a view from before the steps does not hold the fetched copy", w.Name)
		}
	}
	// SyncHost too, and it reports nothing to do.
	step(3)
	if err := o.SyncHost(); err != nil || o.workStale.Load() {
		t.Fatalf("SyncHost: %v (stale %v)", err, o.workStale.Load())
	}
	sameState(t, synced(t, ref), synced(t, o))
	// SetParam after a device step: the rest of the host copy is current,
	// and SyncDevice makes the device's the same.
	step(4)
	vals := make([]float32, testParams[1].Shape[0])
	for j := range vals {
		vals[j] = float32(j) / 7
	}
	for _, x := range []*Optimizer{ref, o} {
		if err := x.SetParam(testParams[1].Name, vals); err != nil {
			t.Fatal(err)
		}
	}
	if o.workStale.Load() {
		t.Fatal("SetParam left the host copy stale")
	}
	sameState(t, synced(t, ref), synced(t, o))
	if _, err := o.Step(StepArgs{GradOnDevice: true}); err == nil {
		t.Fatal("Step with GradOnDevice after SetParam without SyncDevice: no error")
	}
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	sameDeviceCopy(t, io, works, ref)
	// Close brings the copy back for the views that outlive it.
	step(5)
	want := make([][]uint16, len(before))
	for i := range want {
		want[i] = slices.Clone(ref.Working(i).Uint16())
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	for i, w := range before {
		if !slices.Equal(w.Uint16(), want[i]) {
			t.Fatalf("%s: after Close the host view does not hold the last step's copy", w.Name)
		}
	}
}

// TestGradOnDeviceSkip: a non-finite gradient written into the device
// buffers, in a subgroup of any role, skips the step: the state, the step
// counter and both working copies stay as they were.
func TestGradOnDeviceSkip(t *testing.T) {
	params := []Param{{Name: "a", Shape: []int{4}}, {Name: "b", Shape: []int{4}}, {Name: "c", Shape: []int{4}}}
	opts, sim := deviceOpts(Options{GradDType: adam.BF16, WorkingDType: adam.BF16, MaxGradNorm: 1, SubgroupSize: 4, Threads: 1}, perfmodel.Schedule{CPU: 1, GPU: 1, Resident: 1})
	o := newWith(t, params, opts)
	io := hostViewIO{sim}
	grads, works := views(t, o)
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	one := make([]byte, 8)
	for j := 0; j < 4; j++ {
		u := adam.F32ToBF16(0.5)
		one[2*j], one[2*j+1] = byte(u), byte(u>>8)
	}
	for _, g := range grads {
		io.put(t, g, one)
	}
	if _, err := o.Step(StepArgs{GradOnDevice: true}); err != nil {
		t.Fatal(err)
	}
	roles := o.eng.Plan().Roles
	for bad := range params {
		for _, v := range []float32{float32(math.Inf(-1)), float32(math.NaN())} {
			var state [3][]float32
			synced(t, o)
			for k, s := range [][]float32{o.state.Param, o.state.ExpAvg, o.state.ExpAvgSq} {
				state[k] = slices.Clone(s)
			}
			stale := o.workStale.Load()
			copies := make([][]byte, len(works))
			for i, w := range works {
				copies[i] = io.get(t, w)
			}
			b := slices.Clone(one)
			u := adam.F32ToBF16(v)
			b[4], b[5] = byte(u), byte(u>>8)
			io.put(t, grads[bad], b)
			res, err := o.Step(StepArgs{GradOnDevice: true})
			if err != nil || !res.Skipped || res.Step != 1 || o.StepCount() != 1 {
				t.Fatalf("%v in the %v subgroup: %+v, %v", v, roles[bad], res, err)
			}
			if o.workStale.Load() != stale {
				t.Fatal("a skipped step changed the host copy's staleness")
			}
			for i, w := range works {
				if !slices.Equal(io.get(t, w), copies[i]) {
					t.Fatalf("%v in the %v subgroup: the device working copy of %s changed", v, roles[bad], w.Name)
				}
			}
			synced(t, o)
			for k, s := range [][]float32{o.state.Param, o.state.ExpAvg, o.state.ExpAvgSq} {
				if !slices.Equal(s, state[k]) {
					t.Fatalf("%v in the %v subgroup: state array %d changed", v, roles[bad], k)
				}
			}
			io.put(t, grads[bad], one)
		}
	}
}

// TestGradOnDeviceCheckpoint: a checkpoint saved after Steps with
// GradOnDevice (resident subgroups ahead on the device, the host copy
// stale) holds the host path's state; loading it back into the device
// optimizer asks for SyncDevice, and the run goes on as the host path's.
func TestGradOnDeviceCheckpoint(t *testing.T) {
	c := gradOnDeviceCases()[0]
	ropts, dopts := c.opts, c.opts
	ropts.Device, ropts.Schedule = scheduler.NewSim(scheduler.SimOptions{}), &c.s
	dopts.Device, dopts.Schedule = scheduler.NewSim(scheduler.SimOptions{}), &c.s
	ref := newTest(t, ropts)
	o := newTest(t, dopts)
	io := hostViewIO{dopts.Device.(*scheduler.Sim)}
	grads, works := views(t, o)
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	step := func(x *Optimizer, n int64) {
		t.Helper()
		fill(ref, n)
		if x == o {
			writeGrads(t, io, grads, ref)
		}
		if _, err := x.Step(StepArgs{LossScale: 4, GradOnDevice: x == o}); err != nil {
			t.Fatal(err)
		}
	}
	for n := int64(1); n <= 2; n++ {
		step(ref, n)
		step(o, n)
	}
	if o.dev != devDeviceAhead || !o.workStale.Load() {
		t.Fatalf("state %v, host copy stale %v: the test wants both behind", o.dev, o.workStale.Load())
	}
	root := t.TempDir()
	if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
		t.Fatal(err)
	}
	loaded := newTest(t, Options{GradDType: c.opts.GradDType, WorkingDType: c.opts.WorkingDType, MaxGradNorm: c.opts.MaxGradNorm, SubgroupSize: c.opts.SubgroupSize})
	if _, _, err := loaded.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	sameState(t, synced(t, ref), loaded)
	// Past the checkpoint, then back to it.
	step(o, 3)
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	if o.workStale.Load() {
		t.Fatal("LoadCheckpoint left the host copy stale")
	}
	sameState(t, synced(t, ref), synced(t, o))
	if _, err := o.Step(StepArgs{GradOnDevice: true}); err == nil {
		t.Fatal("Step with GradOnDevice after LoadCheckpoint without SyncDevice: no error")
	}
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	sameDeviceCopy(t, io, works, ref)
	for n := int64(3); n <= 4; n++ {
		step(ref, n)
		step(o, n)
	}
	sameDeviceCopy(t, io, works, ref)
	sameState(t, synced(t, ref), synced(t, o.workingNow(t)))
}

// TestDeviceZeroGrad: ZeroGrad clears the device gradients as well as the
// host ones.
func TestDeviceZeroGrad(t *testing.T) {
	for _, gd := range []adam.DType{adam.F32, adam.BF16} {
		opts, sim := deviceOpts(Options{GradDType: gd, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 2}, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 1})
		ref := newTest(t, Options{GradDType: gd, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 2})
		o := newTest(t, opts)
		io := hostViewIO{sim}
		grads, _ := views(t, o)
		fill(ref, 1)
		writeGrads(t, io, grads, ref)
		fill(o, 1)
		if err := o.ZeroGrad(); err != nil {
			t.Fatal(err)
		}
		for i, g := range grads {
			for j, b := range io.get(t, g) {
				if b != 0 {
					t.Fatalf("%v: device gradient of %s, byte %d: %#x after ZeroGrad", gd, g.Name, j, b)
				}
			}
			for j, b := range tensorBytes(o.Grad(i)) {
				if b != 0 {
					t.Fatalf("%v: host gradient of %s, byte %d: %#x after ZeroGrad", gd, g.Name, j, b)
				}
			}
		}
	}
}

// TestDeviceViewsErrors: the device views, SyncDevice and GradOnDevice
// without a device, after Close, with a broken optimizer and across the
// LoadCheckpoint that replaces the engine say so.
func TestDeviceViewsErrors(t *testing.T) {
	host := newTest(t, Options{WorkingDType: adam.BF16})
	if _, err := host.DeviceGrad(0); !errors.Is(err, ErrNoDevice) {
		t.Errorf("DeviceGrad without a device: %v", err)
	}
	if _, err := host.DeviceWorkingOf("wte.weight"); !errors.Is(err, ErrNoDevice) {
		t.Errorf("DeviceWorkingOf without a device: %v", err)
	}
	if err := host.SyncDevice(); !errors.Is(err, ErrNoDevice) {
		t.Errorf("SyncDevice without a device: %v", err)
	}
	if _, err := host.Step(StepArgs{GradOnDevice: true}); !errors.Is(err, ErrNoDevice) || host.StepCount() != 0 {
		t.Errorf("GradOnDevice without a device: %v", err)
	}
	if err := host.SyncHost(); err != nil {
		t.Errorf("SyncHost without a device: %v", err)
	}
	if err := (DeviceTensor{}).Valid(); err == nil {
		t.Error("a zero DeviceTensor is valid")
	}

	opts, sim := deviceOpts(Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 2}, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 1})
	o, err := New(testParams, opts)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := o.DeviceGradOf("nope"); err == nil || !strings.Contains(err.Error(), `"nope"`) {
		t.Errorf("DeviceGradOf of no parameter: %v", err)
	}
	g, err := o.DeviceGradOf("h.0.attn.c_attn.weight")
	if err != nil || g.Ptr != 0 || g.Bytes() != 2*16*48 || g.Valid() != nil {
		t.Fatalf("%+v, %v (valid: %v)", g, err, g.Valid())
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.Valid(); !errors.Is(err, ErrClosed) {
		t.Errorf("a view after Close: %v", err)
	}
	if _, err := o.DeviceGrad(0); !errors.Is(err, ErrClosed) {
		t.Errorf("DeviceGrad after Close: %v", err)
	}
	if err := o.SyncDevice(); !errors.Is(err, ErrClosed) {
		t.Errorf("SyncDevice after Close: %v", err)
	}
	if _, err := sim.HostView(g.Vec, 2); err == nil || !strings.Contains(err.Error(), "freed") {
		t.Errorf("the simulated memory of a view after Close: %v", err)
	}

	// A device fault: no views until LoadCheckpoint, which replaces the
	// engine and so the views.
	opts, sim = deviceOpts(Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Threads: 2}, perfmodel.Schedule{CPU: 2, GPU: 2, Resident: 1})
	o = newTest(t, opts)
	root := t.TempDir()
	if _, err := o.SaveCheckpoint(checkpoint.OS, root, nil); err != nil {
		t.Fatal(err)
	}
	w, err := o.DeviceWorking(2)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.SyncDevice(); err != nil {
		t.Fatal(err)
	}
	sim.FailSync(3)
	if _, err := o.Step(StepArgs{GradOnDevice: true}); !errors.Is(err, scheduler.ErrBroken) {
		t.Fatalf("Step with a device fault: %v", err)
	}
	if err := w.Valid(); !errors.Is(err, scheduler.ErrBroken) {
		t.Errorf("a view of a broken optimizer: %v", err)
	}
	if _, err := o.DeviceWorking(2); !errors.Is(err, scheduler.ErrBroken) {
		t.Errorf("DeviceWorking of a broken optimizer: %v", err)
	}
	if err := o.SyncDevice(); !errors.Is(err, scheduler.ErrBroken) {
		t.Errorf("SyncDevice of a broken optimizer: %v", err)
	}
	if err := o.ZeroGrad(); !errors.Is(err, scheduler.ErrBroken) {
		t.Errorf("ZeroGrad of a broken optimizer: %v", err)
	}
	if _, _, err := o.LoadCheckpoint(checkpoint.OS, root); err != nil {
		t.Fatal(err)
	}
	if err := w.Valid(); !errors.Is(err, ErrStaleView) {
		t.Errorf("a view across the LoadCheckpoint that replaced the engine: %v", err)
	}
	w2, err := o.DeviceWorking(2)
	if err != nil || w2.Valid() != nil || w2.Vec.Mem == w.Vec.Mem {
		t.Fatalf("a view after the reload: %v, %v (same memory: %v)", err, w2.Valid(), w2.Vec.Mem == w.Vec.Mem)
	}
}

// withCUDA runs f on GPU 0; without one it logs why and returns, or fails
// with DOS_REQUIRE_GPU=1 (or when a driver is there but the device is
// not).
func withCUDA(t *testing.T, f func(t *testing.T, d *cuda.Device, k *kernels.Kernels)) {
	d, k, release, err := kernels.Open(0)
	if err != nil {
		if cuda.Available() == nil || os.Getenv("DOS_REQUIRE_GPU") == "1" {
			t.Fatalf("GPU 0: %v", err)
		}
		t.Logf("cuda: skipped (%v)", err)
		return
	}
	defer release()
	f(t, d, k)
}

// ptrIO is a GPU trainer's access to the views: the driver's copies to
// and from the raw addresses (DeviceTensor.Ptr) on a stream of its own,
// which it synchronizes.
type ptrIO struct {
	s          *cuda.Stream
	h          *cuda.HostBuffer
	htod, dtoh uintptr
}

func newPtrIO(t *testing.T, d *cuda.Device, bytes int64) *ptrIO {
	t.Helper()
	lib, err := purego.Dlopen("libcuda.so.1", purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		t.Fatal(err)
	}
	x := &ptrIO{}
	if x.htod, err = purego.Dlsym(lib, "cuMemcpyHtoDAsync_v2"); err != nil {
		t.Fatal(err)
	}
	if x.dtoh, err = purego.Dlsym(lib, "cuMemcpyDtoHAsync_v2"); err != nil {
		t.Fatal(err)
	}
	if x.s, err = d.NewStream(); err != nil {
		t.Fatal(err)
	}
	if x.h, err = d.HostAlloc(bytes); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = x.h.Free(), x.s.Free() })
	return x
}

// check compares the view's address with its buffer's: Ptr is the
// buffer's plus the offset in bytes.
func (x *ptrIO) check(t *testing.T, v DeviceTensor) {
	t.Helper()
	b, ok := v.Vec.Mem.(*cuda.Buffer)
	if !ok || v.Ptr == 0 || v.Ptr != b.Ptr()+uint64(v.Vec.Off)*uint64(v.DType.Size()) {
		t.Fatalf("%s: Ptr %#x, buffer %T at offset %d", v.Name, v.Ptr, v.Vec.Mem, v.Vec.Off)
	}
}

func (x *ptrIO) copy(t *testing.T, fn uintptr, dst, src uintptr, n int64) {
	t.Helper()
	if err := x.s.Lock(); err != nil {
		t.Fatal(err)
	}
	r := cuda.Call(fn, dst, src, uintptr(n), x.s.Handle())
	cuda.Unlock()
	if r != 0 {
		t.Fatalf("cuMemcpy: CUresult %d", r)
	}
	if err := x.s.Sync(); err != nil {
		t.Fatal(err)
	}
}

func (x *ptrIO) put(t *testing.T, v DeviceTensor, b []byte) {
	t.Helper()
	x.check(t, v)
	copy(x.h.Bytes(), b)
	x.copy(t, x.htod, uintptr(v.Ptr), uintptr(unsafe.Pointer(&x.h.Bytes()[0])), v.Bytes())
}

func (x *ptrIO) get(t *testing.T, v DeviceTensor) []byte {
	t.Helper()
	x.check(t, v)
	x.copy(t, x.dtoh, uintptr(unsafe.Pointer(&x.h.Bytes()[0])), uintptr(v.Ptr), v.Bytes())
	return slices.Clone(x.h.Bytes()[:v.Bytes()])
}

// TestDeviceMastersRefused: DeviceMasters naming no parameter, one twice,
// or without a Device is refused, naming the option.
func TestDeviceMastersRefused(t *testing.T) {
	sim := scheduler.NewSim(scheduler.SimOptions{})
	base := Options{GradDType: adam.BF16, WorkingDType: adam.BF16, SubgroupSize: 400, Device: sim}
	for _, tc := range []struct {
		masters []string
		device  bool
		want    string
	}{
		{[]string{"nope"}, true, `no parameter named "nope"`},
		{[]string{testParams[1].Name, testParams[1].Name}, true, "named twice"},
		{[]string{testParams[1].Name}, false, "DeviceMasters, Replan, OverlapBackward and ResidentFirst need a Device"},
	} {
		o := base
		o.DeviceMasters = tc.masters
		if !tc.device {
			o.Device = nil
		}
		opt, err := New(testParams, o)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("DeviceMasters %q (device %v): %v, want an error containing %q", tc.masters, tc.device, err, tc.want)
		}
		if opt != nil {
			opt.Close()
		}
	}
}
