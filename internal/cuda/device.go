package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
)

// Device is one CUDA device with its primary context retained
// (cuDevicePrimaryCtxRetain), the context every method makes current.
type Device struct {
	Ordinal int
	// Name is the device's name, e.g. "NVIDIA H200" (cuDeviceGetName).
	Name string
	// TotalMem is the device memory in bytes (cuDeviceTotalMem).
	TotalMem int64
	// Major and Minor are the compute capability, e.g. 9 and 0.
	Major, Minor int
	// SMs is the number of multiprocessors.
	SMs int
	// PCIBusID is the device's PCI address, domain:bus:device.0 in hex.
	PCIBusID string
	// AsyncEngines is the number of copy engines (1: copies in one
	// direction at a time; 2: H2D and D2H overlap).
	AsyncEngines int
	// Sleeps reports whether the primary context sleeps in
	// cuStreamSynchronize and cuCtxSynchronize
	// (CU_CTX_SCHED_BLOCKING_SYNC): set by Open under WaitSleep when it
	// found the context inactive, or by whoever made it active.
	Sleeps bool

	dev    uintptr // CUdevice
	ctx    uintptr // CUcontext, the primary context
	closed atomic.Bool
}

var errNotOpen = errors.New("cuda: the Device was not made by Open")

// CUdevice_attribute values used here.
const (
	attrMultiprocessorCount = 16
	attrPCIBusID            = 33
	attrPCIDeviceID         = 34
	attrAsyncEngineCount    = 40
	attrPCIDomainID         = 50
	attrCCMajor             = 75
	attrCCMinor             = 76
)

// Open returns device ordinal (0 for the first) with its primary context.
//
// Errors: no usable driver (see Available), a WaitEnv value other than
// spin and sleep, an ordinal out of range, or a failed driver call.
func Open(ordinal int) (*Device, error) {
	n, err := DeviceCount()
	if err != nil {
		return nil, err
	}
	if envErr != nil {
		return nil, envErr
	}
	if ordinal < 0 || ordinal >= n {
		return nil, fmt.Errorf("cuda: device %d does not exist (%d devices)", ordinal, n)
	}
	h, err := outInt32("cuDeviceGet", driver.cuDeviceGet, uintptr(ordinal))
	if err != nil {
		return nil, err
	}
	d := &Device{Ordinal: ordinal, dev: uintptr(h)}
	if d.Name, err = deviceName(d.dev); err != nil {
		return nil, err
	}
	mem, err := outU64("cuDeviceTotalMem_v2", driver.cuDeviceTotalMem, d.dev)
	if err != nil {
		return nil, err
	}
	d.TotalMem = int64(mem)
	attrs := map[int]*int{attrCCMajor: &d.Major, attrCCMinor: &d.Minor, attrMultiprocessorCount: &d.SMs, attrAsyncEngineCount: &d.AsyncEngines}
	var dom, bus, slot int
	attrs[attrPCIDomainID], attrs[attrPCIBusID], attrs[attrPCIDeviceID] = &dom, &bus, &slot
	for a, p := range attrs {
		v, err := outInt32("cuDeviceGetAttribute", driver.cuDeviceGetAttribute, uintptr(a), d.dev)
		if err != nil {
			return nil, err
		}
		*p = int(v)
	}
	d.PCIBusID = fmt.Sprintf("%04x:%02x:%02x.0", dom, bus, slot)
	if d.Sleeps, err = schedFlags(d.dev); err != nil {
		return nil, err
	}
	ctx, err := outU64("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain, d.dev)
	if err != nil {
		return nil, err
	}
	d.ctx = uintptr(ctx)
	return d, nil
}

func deviceName(dev uintptr) (string, error) {
	driver.mu.Lock()
	defer driver.mu.Unlock()
	if r := call(driver.cuDeviceGetName, scratchAddr(), 256, dev); r != 0 {
		return "", newErrorLocked("cuDeviceGetName", r)
	}
	return cString(scratchPtrAt0()), nil
}

// String describes the device in one line.
func (d *Device) String() string {
	return fmt.Sprintf("%s (device %d, sm_%d%d, %d SMs, %.1f GiB, PCI %s, %d copy engines)",
		d.Name, d.Ordinal, d.Major, d.Minor, d.SMs, float64(d.TotalMem)/(1<<30), d.PCIBusID, d.AsyncEngines)
}

// enter makes the device's context current on a locked thread; the caller
// must call runtime.UnlockOSThread afterwards (exit).
func (d *Device) enter() error {
	if d.ctx == 0 {
		return errNotOpen
	}
	if d.closed.Load() {
		return ErrFreed
	}
	return lockCtx(d.ctx)
}

func exit() { runtime.UnlockOSThread() }

// Lock locks the calling goroutine to its OS thread and makes the device's
// primary context current there, for calls into other CUDA libraries
// (cuBLASLt, through Call) that use the current context. On success the
// caller must call Unlock when those calls are done; on error nothing is
// locked.
//
// Locks nest (runtime.LockOSThread counts), so this package's methods may
// be called between Lock and Unlock; but a method on another device makes
// that device's context current on the thread: call Lock again after one.
//
// Errors: a Device not made by Open, a closed device, a failed
// cuCtxSetCurrent.
func (d *Device) Lock() error { return d.enter() }

// Unlock undoes one successful Device.Lock or Stream.Lock: the goroutine
// may move between OS threads again. The context stays current on the
// thread, which does no harm: every call of this package sets its own.
func Unlock() { exit() }

// release runs the driver's destroy call fn(h) once: the first call marks
// freed and destroys; later calls do nothing.
func (d *Device) release(freed *atomic.Bool, name string, fn, h uintptr) error {
	if freed.Swap(true) {
		return nil
	}
	if err := d.enter(); err != nil {
		return err
	}
	defer exit()
	return check(name, fn, h)
}

// MemInfo returns the free and total device memory in bytes
// (cuMemGetInfo).
func (d *Device) MemInfo() (free, total int64, err error) {
	if err := d.enter(); err != nil {
		return 0, 0, err
	}
	defer exit()
	driver.mu.Lock()
	defer driver.mu.Unlock()
	a := scratchAddr()
	if r := call(driver.cuMemGetInfo, a, a+8); r != 0 {
		return 0, 0, newErrorLocked("cuMemGetInfo_v2", r)
	}
	return int64(scratchU64()), int64(scratchU64At(8)), nil
}

// Sync waits for all work on the device (cuCtxSynchronize), as the
// context's scheduling flags say (Sleeps). Not for the hot path:
// synchronize on events or streams instead.
func (d *Device) Sync() error {
	if err := d.enter(); err != nil {
		return err
	}
	defer exit()
	return check("cuCtxSynchronize", driver.cuCtxSynchronize)
}

// Close releases the primary context. Memory, streams and modules created
// on the device must be freed first; they are not tracked.
func (d *Device) Close() error {
	if d.ctx == 0 {
		return errNotOpen
	}
	if d.closed.Swap(true) {
		return nil
	}
	return check("cuDevicePrimaryCtxRelease", driver.cuDevicePrimaryCtxRelease, d.dev)
}
