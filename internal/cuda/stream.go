package cuda

import (
	"sync/atomic"
	"time"
)

// Stream is a CUDA stream (cuStreamCreate, CU_STREAM_NON_BLOCKING): work on
// it runs in order; work on different streams may overlap.
type Stream struct {
	d     *Device
	h     uintptr
	freed atomic.Bool
}

const streamNonBlocking = 1

// NewStream creates a non-blocking stream.
func (d *Device) NewStream() (*Stream, error) {
	if err := d.enter(); err != nil {
		return nil, err
	}
	defer exit()
	h, err := outU64("cuStreamCreate", driver.cuStreamCreate, streamNonBlocking)
	if err != nil {
		return nil, err
	}
	return &Stream{d: d, h: uintptr(h)}, nil
}

// Free destroys the stream (cuStreamDestroy_v2) once its work is done. A
// second Free does nothing.
func (s *Stream) Free() error {
	return s.d.release(&s.freed, "cuStreamDestroy_v2", driver.cuStreamDestroy, s.h)
}

func (s *Stream) enter() error {
	if s.freed.Load() {
		return ErrFreed
	}
	return s.d.enter()
}

// Handle returns the raw CUstream, for CUDA libraries that take a stream
// (a CUstream is a cudaStream_t). It is valid until Free; work enqueued on
// it through another library runs in order with the stream's other work.
func (s *Stream) Handle() uintptr { return s.h }

// Device returns the device the stream was created on.
func (s *Stream) Device() *Device { return s.d }

// Lock is Device.Lock for the stream's device, after checking that the
// stream was not freed (ErrFreed): the way into a library call that
// enqueues on Handle. Undo it with Unlock.
func (s *Stream) Lock() error { return s.enter() }

// Sync waits until all work on the stream is done (cuStreamSynchronize);
// an asynchronous error of that work surfaces here. Under WaitSleep it
// polls (cuStreamQuery) for SpinBeforeSleep first; the wait after that
// sleeps where the context does (Device.Sleeps) and spins where it does
// not.
func (s *Stream) Sync() error {
	if err := s.enter(); err != nil {
		return err
	}
	defer exit()
	return pollThen("cuStreamQuery", driver.cuStreamQuery, "cuStreamSynchronize", driver.cuStreamSynchronize, s.h)
}

// Wait makes later work on s wait for e's last Record (cuStreamWaitEvent),
// without blocking the host.
func (s *Stream) Wait(e *Event) error {
	if e.freed.Load() {
		return ErrFreed
	}
	if err := s.enter(); err != nil {
		return err
	}
	defer exit()
	return check("cuStreamWaitEvent", driver.cuStreamWaitEvent, s.h, e.h, 0)
}

// CopyHtoD enqueues a copy of n bytes from src at srcOff to dst at dstOff
// (cuMemcpyHtoDAsync_v2). It does not allocate.
//
// Errors: a range outside either buffer, a freed buffer or stream, a
// failed call.
func (s *Stream) CopyHtoD(dst *Buffer, dstOff int64, src *HostBuffer, srcOff, n int64) error {
	if err := dst.span("CopyHtoD", dstOff, n); err != nil {
		return err
	}
	a, err := src.addr("CopyHtoD", srcOff, n)
	if err != nil || n == 0 {
		return err
	}
	if err := s.enter(); err != nil {
		return err
	}
	defer exit()
	if r := call(driver.cuMemcpyHtoDAsync, uintptr(dst.ptr)+uintptr(dstOff), a, uintptr(n), s.h); r != 0 {
		return newError("cuMemcpyHtoDAsync_v2", r)
	}
	return nil
}

// CopyDtoH enqueues a copy of n bytes from src at srcOff to dst at dstOff
// (cuMemcpyDtoHAsync_v2). It does not allocate. Errors as CopyHtoD.
func (s *Stream) CopyDtoH(dst *HostBuffer, dstOff int64, src *Buffer, srcOff, n int64) error {
	if err := src.span("CopyDtoH", srcOff, n); err != nil {
		return err
	}
	a, err := dst.addr("CopyDtoH", dstOff, n)
	if err != nil || n == 0 {
		return err
	}
	if err := s.enter(); err != nil {
		return err
	}
	defer exit()
	if r := call(driver.cuMemcpyDtoHAsync, a, uintptr(src.ptr)+uintptr(srcOff), uintptr(n), s.h); r != 0 {
		return newError("cuMemcpyDtoHAsync_v2", r)
	}
	return nil
}

// CopyDtoD enqueues a device-to-device copy of n bytes
// (cuMemcpyDtoDAsync_v2). It does not allocate. Errors as CopyHtoD.
func (s *Stream) CopyDtoD(dst *Buffer, dstOff int64, src *Buffer, srcOff, n int64) error {
	if err := dst.span("CopyDtoD", dstOff, n); err != nil {
		return err
	}
	if err := src.span("CopyDtoD", srcOff, n); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	if err := s.enter(); err != nil {
		return err
	}
	defer exit()
	if r := call(driver.cuMemcpyDtoDAsync, uintptr(dst.ptr)+uintptr(dstOff), uintptr(src.ptr)+uintptr(srcOff), uintptr(n), s.h); r != 0 {
		return newError("cuMemcpyDtoDAsync_v2", r)
	}
	return nil
}

// Memset enqueues setting n bytes of dst from off to v (cuMemsetD8Async).
func (s *Stream) Memset(dst *Buffer, off, n int64, v byte) error {
	if err := dst.span("Memset", off, n); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	if err := s.enter(); err != nil {
		return err
	}
	defer exit()
	return check("cuMemsetD8Async", driver.cuMemsetD8Async, uintptr(dst.ptr)+uintptr(off), uintptr(v), uintptr(n), s.h)
}

// Event is a CUDA event: a point in a stream's work that other streams can
// wait for and the host can synchronize on or time.
type Event struct {
	d     *Device
	h     uintptr
	freed atomic.Bool
}

// Event flags.
const (
	eventDefault       = 0
	eventDisableTiming = 2
)

// NewEvent creates an event; timing enables Elapsed (and costs a little on
// every Record). Under WaitSleep (SetHostWait) the event is made with
// CU_EVENT_BLOCKING_SYNC: Sync sleeps on it.
func (d *Device) NewEvent(timing bool) (*Event, error) {
	if err := d.enter(); err != nil {
		return nil, err
	}
	defer exit()
	flags := uintptr(eventDisableTiming)
	if timing {
		flags = eventDefault
	}
	if CurrentHostWait() == WaitSleep {
		flags |= eventBlockingSync
	}
	h, err := outU64("cuEventCreate", driver.cuEventCreate, flags)
	if err != nil {
		return nil, err
	}
	return &Event{d: d, h: uintptr(h)}, nil
}

// Free destroys the event (cuEventDestroy_v2). A second Free does nothing.
func (e *Event) Free() error {
	return e.d.release(&e.freed, "cuEventDestroy_v2", driver.cuEventDestroy, e.h)
}

// Record captures the work enqueued on s so far (cuEventRecord). It does
// not allocate.
func (e *Event) Record(s *Stream) error {
	if e.freed.Load() {
		return ErrFreed
	}
	if err := s.enter(); err != nil {
		return err
	}
	defer exit()
	if r := call(driver.cuEventRecord, e.h, s.h); r != 0 {
		return newError("cuEventRecord", r)
	}
	return nil
}

// Sync blocks until the work the event captured is done
// (cuEventSynchronize): under WaitSleep it polls (cuEventQuery) for
// SpinBeforeSleep, then sleeps on an event made under WaitSleep; else the
// driver spins.
func (e *Event) Sync() error {
	if e.freed.Load() {
		return ErrFreed
	}
	if err := e.d.enter(); err != nil {
		return err
	}
	defer exit()
	return pollThen("cuEventQuery", driver.cuEventQuery, "cuEventSynchronize", driver.cuEventSynchronize, e.h)
}

// Done reports whether the captured work is done, without blocking
// (cuEventQuery).
func (e *Event) Done() (bool, error) {
	if e.freed.Load() {
		return false, ErrFreed
	}
	if err := e.d.enter(); err != nil {
		return false, err
	}
	defer exit()
	switch r := call(driver.cuEventQuery, e.h); r {
	case 0:
		return true, nil
	case errNotReady:
		return false, nil
	default:
		return false, newError("cuEventQuery", r)
	}
}

// Elapsed returns the GPU time between two recorded, completed timing
// events (cuEventElapsedTime; resolution about 0.5 µs).
func Elapsed(start, end *Event) (time.Duration, error) {
	if start.freed.Load() || end.freed.Load() {
		return 0, ErrFreed
	}
	if err := start.d.enter(); err != nil {
		return 0, err
	}
	defer exit()
	driver.mu.Lock()
	defer driver.mu.Unlock()
	if r := call(driver.cuEventElapsedTime, scratchAddr(), start.h, end.h); r != 0 {
		return 0, newErrorLocked("cuEventElapsedTime", r)
	}
	ms := *(*float32)(scratchPtrAt0())
	return time.Duration(float64(ms) * 1e6), nil
}
