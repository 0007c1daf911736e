package offload

import (
	"errors"
	"fmt"

	"github.com/deepstates/dos/adam"
	"github.com/deepstates/dos/scheduler"
)

// ErrNoDevice is the error of the device views, SyncDevice and
// StepArgs.GradOnDevice on an optimizer without Options.Device: its
// gradients and working copy are host memory only (Grad, Working).
var ErrNoDevice = errors.New("offload: no device buffers: Options.Device is not set (the gradients and working copy are in host memory: Grad, Working)")

// ErrStaleView is DeviceTensor.Valid's error for a view of an engine the
// optimizer no longer has: LoadCheckpoint replaced it after a device
// fault. Ask DeviceGrad, DeviceWorking or DeviceMaster again.
var ErrStaleView = errors.New("offload: a stale device view: LoadCheckpoint replaced the engine after a device fault (ask DeviceGrad, DeviceWorking or DeviceMaster again)")

// DeviceTensor is one parameter's buffer in the device memory of
// Options.Device, the one the update phase reads or writes: its gradient,
// which a GPU trainer's backward writes (DeviceGrad), its 16-bit working
// copy, which its forward and backward read (DeviceWorking), or the fp32
// copy of its master weights (DeviceMaster). Len elements
// of DType, contiguous, row-major in Shape, as Grad and Working on the
// host.
//
// A view stays valid, at the same address, from the call that returned it
// until Close, or until a LoadCheckpoint that replaces the engine (the one
// that follows a device fault, scheduler.ErrBroken); Valid says which.
// Nothing else moves it: Step, SetParam, SaveCheckpoint, SaveAsync and a
// LoadCheckpoint of a working optimizer keep it. Its contents follow the
// rules of Optimizer.DeviceGrad and DeviceWorking.
type DeviceTensor struct {
	Name  string
	Shape []int
	DType adam.DType // Options.GradDType for a gradient, Options.WorkingDType for the working copy, F32 for DeviceMaster
	Len   int        // elements, the product of Shape
	// Ptr is the device address of the first element (a CUdeviceptr) on
	// a CUDA device; 0 on a device without addresses (the simulated
	// one). The gradients and the working copy lie end to end in one flat
	// buffer each (ParamInfo's Offset), so their Ptr is aligned to DType's
	// size only, and to 16 bytes when the elements before it in the flat
	// space are a multiple of 16 bytes; a DeviceMaster's is 16-byte
	// aligned (scheduler.MirrorLayout).
	Ptr uint64
	// Vec is the same memory as the engine addresses it: elements
	// [Vec.Off, Vec.Off+Vec.N) of DType in the flat buffer Vec.Mem (on
	// the simulated device, scheduler.Sim.HostView reads and writes
	// them).
	Vec scheduler.Vec

	o   *Optimizer
	eng *scheduler.Engine
}

// Bytes returns the view's size in bytes: Len times DType's size.
func (t DeviceTensor) Bytes() int64 { return int64(t.Len) * int64(t.DType.Size()) }

// Valid reports whether t still addresses the optimizer's device memory
// and may be used.
//
// Errors: ErrClosed after Close; ErrStaleView after a LoadCheckpoint
// replaced the engine; scheduler.ErrBroken (wrapped) while a device fault
// left the optimizer broken (the LoadCheckpoint that repairs it replaces
// the engine); an error for a DeviceTensor no optimizer returned.
func (t DeviceTensor) Valid() error {
	if t.o == nil {
		return errors.New("offload: a DeviceTensor that no optimizer returned")
	}
	o := t.o
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case o.pool == nil:
		return ErrClosed
	case o.eng != t.eng:
		return ErrStaleView
	case o.dev == devBroken:
		return fmt.Errorf("offload: %w (the LoadCheckpoint that restores one replaces the device buffers)", scheduler.ErrBroken)
	}
	return nil
}

// DeviceGrad returns the device gradient of parameter i (in New's order),
// of Options.GradDType: where a GPU trainer's backward writes it for a
// Step with StepArgs.GradOnDevice. A Step without GradOnDevice overwrites
// it with the host gradient (Grad); ZeroGrad zeroes it; nothing else
// writes it. See DeviceTensor for how long the view holds, and StepArgs.
// GradOnDevice for the order of the trainer's device work and the
// optimizer's calls. Panics if i is out of range.
//
// Errors: ErrNoDevice without Options.Device; ErrClosed; scheduler.
// ErrBroken (wrapped) while a device fault left the optimizer broken.
func (o *Optimizer) DeviceGrad(i int) (DeviceTensor, error) {
	lo, hi := o.span(i)
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.deviceViews(); err != nil {
		return DeviceTensor{}, err
	}
	if err := o.notHeld(i, "DeviceGrad", "HostGrad"); err != nil {
		return DeviceTensor{}, err
	}
	return o.deviceTensor(i, o.opts.GradDType, o.eng.Grad(), o.devOff(lo), o.devOff(lo)+hi-lo), nil
}

// DeviceWorking returns the device working copy of parameter i (in New's
// order), of Options.WorkingDType: what a GPU trainer's forward and
// backward read. Step writes it (every update, with or without
// StepArgs.GradOnDevice), and so does SyncDevice; after New, SetParam
// and LoadCheckpoint it is behind the master weights until SyncDevice
// (or a Step without GradOnDevice) moves them there: call SyncDevice
// before the first forward that reads it. See DeviceTensor for how long
// the view holds. Panics if i is out of range.
//
// Errors: those of DeviceGrad.
func (o *Optimizer) DeviceWorking(i int) (DeviceTensor, error) {
	lo, hi := o.span(i)
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.deviceViews(); err != nil {
		return DeviceTensor{}, err
	}
	if err := o.notHeld(i, "DeviceWorking", "HostWorking"); err != nil {
		return DeviceTensor{}, err
	}
	return o.deviceTensor(i, o.opts.WorkingDType, o.eng.Working(), o.devOff(lo), o.devOff(lo)+hi-lo), nil
}

// notHeld refuses a device view of an Options.OffloadParam parameter.
func (o *Optimizer) notHeld(i int, view, instead string) error {
	if o.offloaded[i] {
		return fmt.Errorf("offload: %s(%q): the parameter is in Options.OffloadParam, its buffer is in host memory (%s)", view, o.params[i].Name, instead)
	}
	return nil
}

// devOff returns where flat element lo (of a parameter that is not
// host-held) is in the engine's device buffers; 0 for an empty
// parameter's lo, which may be no device element. The caller holds o.mu.
func (o *Optimizer) devOff(lo int) int {
	at, _ := o.eng.DeviceOffset(int64(lo))
	return int(at)
}

// HostTensor is one Options.OffloadParam parameter's buffer in the
// engine's pinned host memory: its gradient, which a trainer that streams
// the parameter copies D2H after the backward wrote it on the device
// (HostGrad), or its 16-bit working copy, which it copies H2D before a
// forward or backward reads it (HostWorking). Len elements of DType,
// contiguous, row-major in Shape: Bytes, which is bytes [Off, Off+len)
// of Host (a CUDA device's host memory is a *cuda.HostBuffer, which the
// trainer's copies name). It stays valid as a DeviceTensor does.
type HostTensor struct {
	Name  string
	Shape []int
	DType adam.DType
	Len   int
	Bytes []byte
	Host  scheduler.Host
	Off   int64
}

// HostGrad returns the pinned host gradient of Options.OffloadParam
// parameter i (in New's order), of Options.GradDType: where a trainer
// that streams it puts its gradient (the D2H copy of what its backward
// wrote) before a Step with StepArgs.GradOnDevice, complete before the
// Step is called (Step reads it on the host). With Options.Speculate it
// must be complete earlier, once the work enqueued on the stream given to
// GradsFinal for i is done (a copy enqueued there before that call, or
// written before it): the CPU workers read it then. A Step without
// GradOnDevice overwrites it with Grad's (and so drops what was
// speculated); ZeroGrad zeroes it. Panics if i is out of range.
//
// Errors: those of DeviceGrad; a parameter not in OffloadParam.
func (o *Optimizer) HostGrad(i int) (HostTensor, error) {
	return o.hostTensor(i, "HostGrad", true)
}

// HostGradOnDevice tells the optimizer that the gradient of
// Options.OffloadParam parameter i, which the caller copies into HostGrad(i)
// on s after this call (or copied before it), is also in device memory at
// mem's elements [off, off+Len) of Options.GradDType, complete once the work
// enqueued on s so far is done, and unchanged until the work this call
// enqueues on s is (work enqueued on s after it, such as the copy, comes after
// that): the GPU takes the global gradient checks' partial sums there, on s,
// beside the backward, and the next Step reads them instead of passing over
// HostGrad on the CPU workers after the backward
// (scheduler.Engine.HeldPartials; the same sums bit for bit). A GPU trainer
// that streams a block's weights calls it for each of the block's streamed
// tensors as its backward ends, before its gradients' D2H. The sums are taken
// with the last Step's loss scale; a Step with another passes over HostGrad as
// before. ZeroGrad and a Step that does not take them (one without
// StepArgs.GradOnDevice) forget them. It waits for nothing. mem is memory of
// Options.Device (a *cuda.Buffer on a CUDA device). Panics if i is out of
// range.
//
// Errors: those of HostGrad; off or Len outside mem; a device error
// (scheduler.ErrBroken after it).
func (o *Optimizer) HostGradOnDevice(s Stream, i int, mem scheduler.Mem, off int64) error {
	lo, hi := o.span(i)
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.deviceViews(); err != nil {
		return err
	}
	if !o.offloaded[i] {
		return fmt.Errorf("offload: HostGradOnDevice(%q): the parameter is not in Options.OffloadParam (its gradient is the device's, DeviceGrad)", o.params[i].Name)
	}
	n := int64(hi - lo)
	if es := int64(o.opts.GradDType.Size()); mem == nil || off < 0 || es*(off+n) > mem.Len() {
		return fmt.Errorf("offload: HostGradOnDevice(%q): elements [%d, %d) of %d bytes each outside the device buffer", o.params[i].Name, off, off+n, es)
	}
	if err := o.eng.HeldPartials(s, int64(lo), scheduler.Vec{Mem: mem, Off: off, N: n}, o.lastUnscale); err != nil {
		return o.engineErr(err)
	}
	return nil
}

// HostWorking returns the pinned host 16-bit working copy of
// Options.OffloadParam parameter i (in New's order), of
// Options.WorkingDType: what a trainer that streams it copies to the
// device before each forward and backward that reads it. Step writes it
// (complete when Step returns), and so does SyncDevice, as DeviceWorking;
// with Options.Speculate the CPU workers also write it during the
// backward, after GradsFinal for i, and a restore writes it back before
// the Step returns (or before a read of the state): it is the step's
// again whenever the Step has returned. Panics if i is out of range.
//
// Errors: those of HostGrad.
func (o *Optimizer) HostWorking(i int) (HostTensor, error) {
	return o.hostTensor(i, "HostWorking", false)
}

// hostTensor is HostGrad's (grad) or HostWorking's view of parameter i.
func (o *Optimizer) hostTensor(i int, view string, grad bool) (HostTensor, error) {
	lo, hi := o.span(i)
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.deviceViews(); err != nil {
		return HostTensor{}, err
	}
	if !o.offloaded[i] {
		return HostTensor{}, fmt.Errorf("offload: %s(%q): the parameter is not in Options.OffloadParam (its buffer is on the device)", view, o.params[i].Name)
	}
	h, d := o.eng.HostWorking(), o.opts.WorkingDType
	if grad {
		h, d = o.eng.HostGrad(), o.opts.GradDType
	}
	if hi == lo { // an empty parameter: no host memory, perhaps none at all
		return HostTensor{Name: o.params[i].Name, Shape: o.params[i].Shape, DType: d, Host: h}, nil
	}
	at, _ := o.eng.HostOffset(int64(lo))
	es := int64(d.Size())
	return HostTensor{Name: o.params[i].Name, Shape: o.params[i].Shape, DType: d, Len: hi - lo,
		Bytes: h.Bytes()[es*at : es*(at+int64(hi-lo))], Host: h, Off: es * at}, nil
}

// DeviceMaster returns the device fp32 copy of parameter i's master
// weights (in New's order), which must be one of Options.DeviceMasters:
// what a GPU trainer reads where PyTorch's bf16 autocast reads fp32
// parameters. Every Step that updates writes it, from the new master
// weights, bit for bit (as DeviceWorking's rounding of them); after New,
// SetParam and LoadCheckpoint it is behind until SyncDevice, as
// DeviceWorking. See DeviceTensor for how long the view holds (its DType
// is F32). Panics if i is out of range.
//
// Errors: those of DeviceGrad; i not in Options.DeviceMasters.
func (o *Optimizer) DeviceMaster(i int) (DeviceTensor, error) {
	lo, hi := o.span(i)
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.deviceViews(); err != nil {
		return DeviceTensor{}, err
	}
	at, ok := o.mirrorAt[i]
	if !ok {
		return DeviceTensor{}, fmt.Errorf("offload: DeviceMaster(%q): not one of Options.DeviceMasters", o.params[i].Name)
	}
	return o.deviceTensor(i, adam.F32, o.eng.Mirror(), int(at), int(at)+hi-lo), nil
}

// DeviceGradOf is DeviceGrad of the parameter named name.
//
// Errors: no such parameter (the error names it); those of DeviceGrad.
func (o *Optimizer) DeviceGradOf(name string) (DeviceTensor, error) {
	i, err := o.Index(name)
	if err != nil {
		return DeviceTensor{}, err
	}
	return o.DeviceGrad(i)
}

// DeviceWorkingOf is DeviceWorking of the parameter named name.
//
// Errors: no such parameter (the error names it); those of DeviceGrad.
func (o *Optimizer) DeviceWorkingOf(name string) (DeviceTensor, error) {
	i, err := o.Index(name)
	if err != nil {
		return DeviceTensor{}, err
	}
	return o.DeviceWorking(i)
}

// deviceViews says why there are no device views now, if so. The caller
// holds o.mu.
func (o *Optimizer) deviceViews() error {
	switch {
	case o.opts.Device == nil:
		return ErrNoDevice
	case o.pool == nil:
		return ErrClosed
	case o.dev == devBroken || o.eng == nil:
		return fmt.Errorf("offload: %w: no device views until LoadCheckpoint restores a state", scheduler.ErrBroken)
	}
	return nil
}

// deviceTensor is the view of elements [lo, hi) of the flat device buffer
// all of dtype d, for parameter i. The caller holds o.mu.
func (o *Optimizer) deviceTensor(i int, d adam.DType, all scheduler.Vec, lo, hi int) DeviceTensor {
	t := DeviceTensor{Name: o.params[i].Name, Shape: o.params[i].Shape, DType: d, Len: hi - lo,
		Vec: scheduler.Vec{Mem: all.Mem, Off: all.Off + int64(lo), N: int64(hi - lo)}, o: o, eng: o.eng}
	// A CUDA device's memory has an address (scheduler's CUDA Mem is a
	// *cuda.Buffer); the simulated device's has none.
	if a, ok := all.Mem.(interface{ Ptr() uint64 }); ok {
		t.Ptr = a.Ptr() + uint64(t.Vec.Off)*uint64(d.Size())
	}
	return t
}

// SyncDevice makes the device buffers current for a GPU trainer's
// forward: when New (the master weights at zero), SetParam or
// LoadCheckpoint changed the host state since the last Step or
// SyncDevice, it moves the state to the device (the resident subgroups'
// state, and the working copy of every parameter rounded from the master
// weights, scheduler.Engine.Load) and waits for the copies; otherwise it
// does nothing. Call it after setting the initial values or loading a
// checkpoint, before the first forward that reads DeviceWorking, with no
// device work of the trainer in flight on the working copy or the
// DeviceMaster copies (it writes both). A Step with
// StepArgs.GradOnDevice refuses to run when it was needed and not called
// (the gradients were computed from stale weights).
//
// Errors: ErrNoDevice without Options.Device; ErrClosed; scheduler.
// ErrBroken (wrapped) after a device fault; a failed copy.
func (o *Optimizer) SyncDevice() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.deviceViews(); err != nil {
		return err
	}
	return o.loadDevice()
}

// loadDevice moves the host state to the device when it is ahead. The
// caller holds o.mu.
func (o *Optimizer) loadDevice() error {
	if o.dev != devHostAhead {
		return nil
	}
	if err := o.eng.Load(); err != nil {
		return o.engineErr(err)
	}
	o.dev = devSynced
	return nil
}
