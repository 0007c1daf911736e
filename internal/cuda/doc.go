// Package cuda is the part of the CUDA driver API that dos needs, reached
// through dlopen with github.com/ebitengine/purego: no cgo, so the same
// binary runs with and without a GPU. Available reports why a GPU cannot be
// used (no libcuda, no device, driver too old) and never exits the process.
//
// # Contexts and threads
//
// A CUDA context is current per OS thread, and goroutines move between
// threads. The rule here: every method that calls the driver locks its
// goroutine to its OS thread, makes the device's primary context current
// (cuCtxSetCurrent, a thread-local store in the driver) and unlocks when the
// call returns. So any goroutine may call any method at any time; nothing
// depends on which thread ran the previous call. Objects (Device, Stream,
// Event, Buffer, HostBuffer, Module, Function) are safe for concurrent use
// unless their doc says otherwise; the work on one Stream runs in the order
// it was enqueued, as in CUDA.
//
// # Memory the driver reads or writes
//
// Host memory handed to the driver (copy sources and destinations, kernel
// argument arrays, out-parameters) is never Go heap memory: pinned host
// buffers come from cuMemHostAlloc or from mmap plus cuMemHostRegister, and
// kernel arguments live in an off-heap Args block. The hot path (Launch,
// the async copies, Event.Record, Stream.Wait) calls the driver with plain
// integers through purego's trampoline, on an argument block kept on the
// stack, and does not allocate.
//
// # Other CUDA libraries
//
// Bindings of other CUDA libraries (internal/cublas) reach them through the
// same allocation-free path, Call, with the device's context made current
// by Device.Lock or Stream.Lock and released by Unlock, and enqueue their
// work on Stream.Handle.
//
// Every object comes from its constructor (Open, Device.Alloc, NewStream,
// NewArgs, ...); a zero value is not usable and methods on nil objects
// panic. A zero Device is the exception that returns an error, since its
// fields are exported.
//
// # Errors
//
// A failed driver call returns an *Error naming the call and the driver's
// error name and string, e.g. "cuda: cuMemAlloc_v2(1099511627776 B):
// CUDA_ERROR_OUT_OF_MEMORY: out of memory". Using a freed Buffer, Stream,
// Event or Module is caught in Go and returns ErrFreed, before the driver
// sees a dangling handle.
package cuda
