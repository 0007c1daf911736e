package cuda

import (
	"fmt"
	"sync/atomic"
	"unsafe"
)

// Buffer is device memory from cuMemAlloc: Len bytes at device address
// Ptr, 256-byte aligned.
type Buffer struct {
	d       *Device
	ptr     uint64
	size    int64
	freed   atomic.Bool
	counted atomic.Bool // in its device's MemoryUsed until Free
	lent    bool        // Borrow's: Free releases nothing
}

// Alloc allocates bytes (> 0) of device memory (cuMemAlloc_v2), within
// the device's SetMemoryLimit cap when one is set.
//
// Errors: bytes <= 0, out of memory (IsOutOfMemory reports it; over the
// cap too, CUDA_ERROR_OUT_OF_MEMORY saying so), a closed device.
func (d *Device) Alloc(bytes int64) (*Buffer, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("cuda: Alloc(%d): size must be > 0", bytes)
	}
	if err := d.enter(); err != nil {
		return nil, err
	}
	defer exit()
	call := fmt.Sprintf("cuMemAlloc_v2(%d B)", bytes)
	if err := reserve(d.Ordinal, bytes, call); err != nil {
		return nil, err
	}
	p, err := outU64(call, driver.cuMemAlloc, uintptr(bytes))
	if err != nil {
		unreserve(d.Ordinal, bytes)
		return nil, err
	}
	b := &Buffer{d: d, ptr: p, size: bytes}
	b.counted.Store(true)
	return b, nil
}

// Borrow returns a Buffer over bytes of device memory at ptr that something
// else allocated on d and frees (a range of another Buffer, an
// optimizer's device view): copies, kernels and collectives take it as
// they take any Buffer. Its Free only marks it freed; the memory stays
// its owner's, which must keep it allocated while the Buffer is used. It
// is not counted in MemoryUsed. It does not call the driver.
//
// Errors: a zero ptr, bytes <= 0.
func (d *Device) Borrow(ptr uint64, bytes int64) (*Buffer, error) {
	if ptr == 0 || bytes <= 0 {
		return nil, fmt.Errorf("cuda: Borrow(%#x, %d): want a device address and bytes > 0", ptr, bytes)
	}
	return &Buffer{d: d, ptr: ptr, size: bytes, lent: true}, nil
}

// maxOrdinals bounds the device ordinals whose memory is counted.
const maxOrdinals = 64

// caps holds, per device ordinal, SetMemoryLimit's cap (0: none) and the
// bytes Alloc has handed out that Free has not taken back, over every
// Device of that ordinal in the process.
var caps [maxOrdinals]struct{ limit, used atomic.Int64 }

// SetMemoryLimit caps the device memory that Alloc hands out on device
// ordinal, over every Device of that ordinal in the process together, at
// bytes (0 removes the cap): what dos allocates (weights, gradients,
// activations, workspaces, the update phase), not the driver's own
// memory (the context, modules). An Alloc that would pass it fails as out
// of memory. Buffers allocated before count (MemoryUsed); a cap below
// them refuses every later Alloc until they are freed.
//
// Errors: an ordinal outside [0, 64), bytes < 0.
func SetMemoryLimit(ordinal int, bytes int64) error {
	if ordinal < 0 || ordinal >= maxOrdinals || bytes < 0 {
		return fmt.Errorf("cuda: SetMemoryLimit(%d, %d): want an ordinal in [0, %d) and bytes >= 0", ordinal, bytes, maxOrdinals)
	}
	caps[ordinal].limit.Store(bytes)
	return nil
}

// MemoryLimit returns device ordinal's SetMemoryLimit cap in bytes (0:
// none).
func MemoryLimit(ordinal int) int64 {
	if ordinal < 0 || ordinal >= maxOrdinals {
		return 0
	}
	return caps[ordinal].limit.Load()
}

// MemoryUsed returns the bytes of device memory Alloc has handed out on
// device ordinal that Free has not taken back.
func MemoryUsed(ordinal int) int64 {
	if ordinal < 0 || ordinal >= maxOrdinals {
		return 0
	}
	return caps[ordinal].used.Load()
}

// reserve counts bytes on ordinal, or fails as out of memory when that
// passes its cap.
func reserve(ordinal int, bytes int64, call string) error {
	if ordinal < 0 || ordinal >= maxOrdinals {
		return nil
	}
	c := &caps[ordinal]
	used := c.used.Add(bytes)
	if l := c.limit.Load(); l > 0 && used > l {
		c.used.Add(-bytes)
		return &Error{Call: call, Code: errOutOfMemory, Name: "CUDA_ERROR_OUT_OF_MEMORY",
			Msg: fmt.Sprintf("over the device memory cap of %d bytes (%d in use)", l, used-bytes)}
	}
	return nil
}

// unreserve takes bytes back from ordinal's count.
func unreserve(ordinal int, bytes int64) {
	if ordinal >= 0 && ordinal < maxOrdinals {
		caps[ordinal].used.Add(-bytes)
	}
}

// Ptr returns the device address (CUdeviceptr).
func (b *Buffer) Ptr() uint64 { return b.ptr }

// Len returns the size in bytes.
func (b *Buffer) Len() int64 { return b.size }

// Freed reports whether Free was called.
func (b *Buffer) Freed() bool { return b.freed.Load() }

// Free releases the memory (cuMemFree_v2; for a Borrow's Buffer nothing).
// Later use returns ErrFreed; a second Free does nothing. Work still queued on a stream that uses the
// buffer must be finished first (synchronize on it).
func (b *Buffer) Free() error {
	if b.lent {
		b.freed.Store(true)
		return nil
	}
	if b.counted.Swap(false) {
		unreserve(b.d.Ordinal, b.size)
	}
	return b.d.release(&b.freed, "cuMemFree_v2", driver.cuMemFree, uintptr(b.ptr))
}

// span checks that [off, off+n) lies inside b and that b is live.
func (b *Buffer) span(what string, off, n int64) error {
	if b == nil {
		return fmt.Errorf("cuda: %s: nil buffer", what)
	}
	if b.freed.Load() {
		return fmt.Errorf("cuda: %s: device buffer: %w", what, ErrFreed)
	}
	if off < 0 || n < 0 || off > b.size || n > b.size-off {
		return fmt.Errorf("cuda: %s: range [%d, %d) outside the %d-byte device buffer", what, off, off+n, b.size)
	}
	return nil
}

// HostBuffer is page-locked (pinned) host memory the GPU copies to and from
// at full PCIe speed: from cuMemHostAlloc, or mmap'd memory registered with
// cuMemHostRegister. It is never Go heap memory.
type HostBuffer struct {
	d          *Device
	mem        []byte
	registered bool // mmap + cuMemHostRegister; otherwise cuMemHostAlloc
	freed      atomic.Bool
}

// CU_MEMHOSTALLOC_PORTABLE / CU_MEMHOSTREGISTER_PORTABLE: pinned for every
// context, not only the current one.
const hostPortable = 1

// HostAlloc allocates bytes (> 0) of pinned host memory (cuMemHostAlloc,
// portable).
//
// Errors: bytes <= 0, the driver refusing (too much pinned memory), a
// closed device.
func (d *Device) HostAlloc(bytes int64) (*HostBuffer, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("cuda: HostAlloc(%d): size must be > 0", bytes)
	}
	if err := d.enter(); err != nil {
		return nil, err
	}
	defer exit()
	driver.mu.Lock()
	defer driver.mu.Unlock()
	if r := call(driver.cuMemHostAlloc, scratchAddr(), uintptr(bytes), hostPortable); r != 0 {
		return nil, newErrorLocked(fmt.Sprintf("cuMemHostAlloc(%d B)", bytes), r)
	}
	return &HostBuffer{d: d, mem: unsafe.Slice((*byte)(scratchPtr()), bytes)}, nil
}

// HostRegister maps bytes (> 0) of anonymous memory with MapHost (whole
// pages; from 16 MiB up, 2 MiB-aligned and advised for transparent huge
// pages) and pins it with cuMemHostRegister (portable), which faults every
// page in. Free unregisters and unmaps it.
//
// Errors: bytes <= 0, mmap failing, the driver refusing to pin.
func (d *Device) HostRegister(bytes int64) (*HostBuffer, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("cuda: HostRegister(%d): size must be > 0", bytes)
	}
	mem, err := MapHost(bytes)
	if err != nil {
		return nil, fmt.Errorf("cuda: HostRegister(%d B): %w", bytes, err)
	}
	if err := d.RegisterHost(mem[:cap(mem)]); err != nil {
		UnmapHost(mem)
		return nil, err
	}
	return &HostBuffer{d: d, mem: mem, registered: true}, nil
}

// RegisterHost pins mem, which must not be Go heap memory (mmap'd memory,
// for one), with cuMemHostRegister (portable); UnregisterHost undoes it.
// HostRegister is the usual way in.
func (d *Device) RegisterHost(mem []byte) error {
	if len(mem) == 0 {
		return fmt.Errorf("cuda: RegisterHost: empty memory")
	}
	if err := d.enter(); err != nil {
		return err
	}
	defer exit()
	return check(fmt.Sprintf("cuMemHostRegister_v2(%d B)", len(mem)), driver.cuMemHostRegister,
		uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), hostPortable)
}

// UnregisterHost unpins memory pinned by RegisterHost.
func (d *Device) UnregisterHost(mem []byte) error {
	if len(mem) == 0 {
		return nil
	}
	if err := d.enter(); err != nil {
		return err
	}
	defer exit()
	return check("cuMemHostUnregister", driver.cuMemHostUnregister, uintptr(unsafe.Pointer(&mem[0])))
}

// Bytes returns the memory. It must not be used after Free.
func (h *HostBuffer) Bytes() []byte { return h.mem }

// Len returns the size in bytes.
func (h *HostBuffer) Len() int64 { return int64(len(h.mem)) }

// Free releases the memory (cuMemFreeHost, or cuMemHostUnregister and
// munmap). A second Free does nothing.
func (h *HostBuffer) Free() error {
	if h.freed.Swap(true) {
		return nil
	}
	if h.registered {
		err := h.d.UnregisterHost(h.mem[:cap(h.mem)])
		if uerr := UnmapHost(h.mem); err == nil {
			err = uerr
		}
		return err
	}
	if err := h.d.enter(); err != nil {
		return err
	}
	defer exit()
	return check("cuMemFreeHost", driver.cuMemFreeHost, uintptr(unsafe.Pointer(&h.mem[0])))
}

// addr checks [off, off+n) and returns the host address of off.
func (h *HostBuffer) addr(what string, off, n int64) (uintptr, error) {
	if h == nil {
		return 0, fmt.Errorf("cuda: %s: nil host buffer", what)
	}
	if h.freed.Load() {
		return 0, fmt.Errorf("cuda: %s: host buffer: %w", what, ErrFreed)
	}
	if off < 0 || n < 0 || off > int64(len(h.mem)) || n > int64(len(h.mem))-off {
		return 0, fmt.Errorf("cuda: %s: range [%d, %d) outside the %d-byte host buffer", what, off, off+n, len(h.mem))
	}
	if n == 0 {
		return 0, nil
	}
	return uintptr(unsafe.Pointer(&h.mem[off])), nil
}
