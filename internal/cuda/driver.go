package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"structs"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
	"golang.org/x/sys/unix"
)

// MinDriverVersion is the oldest driver API version accepted, as
// cuDriverGetVersion reports it (1000*major + 10*minor): CUDA 12.0.
const MinDriverVersion = 12000

// ErrFreed is returned by a method called on a Buffer, HostBuffer, Stream,
// Event or Module after its Free, or on a Device after Close.
var ErrFreed = errors.New("cuda: use after free")

// Error is a failed driver call.
type Error struct {
	Call string // the driver function and, where useful, its main argument
	Code int    // the CUresult
	Name string // e.g. CUDA_ERROR_OUT_OF_MEMORY, from cuGetErrorName
	Msg  string // e.g. "out of memory", from cuGetErrorString
}

func (e *Error) Error() string {
	return fmt.Sprintf("cuda: %s: %s: %s", e.Call, e.Name, e.Msg)
}

// CUresult values this package tests for.
const (
	errNotReady    = 600 // CUDA_ERROR_NOT_READY
	errOutOfMemory = 2   // CUDA_ERROR_OUT_OF_MEMORY
)

// IsOutOfMemory reports whether err is a driver out-of-memory error.
func IsOutOfMemory(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == errOutOfMemory
}

// driver holds libcuda's entry points, loaded once.
var driver struct {
	once sync.Once
	err  error
	mu   sync.Mutex // guards scratch
	// scratch is an off-heap page for the out-parameters of calls off the
	// hot path, used under mu.
	scratch []byte

	cuInit, cuDriverGetVersion, cuGetErrorName, cuGetErrorString                           uintptr
	cuDeviceGetCount, cuDeviceGet, cuDeviceGetName, cuDeviceTotalMem, cuDeviceGetAttribute uintptr
	cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRelease, cuCtxSetCurrent, cuCtxSynchronize uintptr
	cuDevicePrimaryCtxGetState, cuDevicePrimaryCtxSetFlags                                 uintptr
	cuMemGetInfo, cuMemAlloc, cuMemFree, cuMemHostAlloc, cuMemFreeHost                     uintptr
	cuMemHostRegister, cuMemHostUnregister                                                 uintptr
	cuMemcpyHtoDAsync, cuMemcpyDtoHAsync, cuMemcpyDtoDAsync, cuMemsetD8Async               uintptr
	cuMemcpyHtoD, cuMemcpyDtoH                                                             uintptr
	cuStreamCreate, cuStreamDestroy, cuStreamSynchronize, cuStreamWaitEvent, cuStreamQuery uintptr
	cuEventCreate, cuEventDestroy, cuEventRecord, cuEventSynchronize, cuEventQuery         uintptr
	cuEventElapsedTime                                                                     uintptr
	cuModuleLoadDataEx, cuModuleUnload, cuModuleGetFunction, cuLaunchKernel                uintptr
	version                                                                                int
}

// load opens libcuda and resolves every symbol; it runs once.
func load() error {
	driver.once.Do(func() { driver.err = loadDriver() })
	return driver.err
}

func loadDriver() error {
	var lib uintptr
	var err, first error
	for _, name := range []string{"libcuda.so.1", "libcuda.so"} {
		if lib, err = purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_GLOBAL); err == nil {
			break
		}
		if first == nil {
			first = err
		}
	}
	if err != nil {
		return fmt.Errorf("cuda: no CUDA driver: %v", first)
	}
	d := &driver
	syms := []struct {
		p     *uintptr
		names []string // the first one present is used
	}{
		{&d.cuInit, []string{"cuInit"}},
		{&d.cuDriverGetVersion, []string{"cuDriverGetVersion"}},
		{&d.cuGetErrorName, []string{"cuGetErrorName"}},
		{&d.cuGetErrorString, []string{"cuGetErrorString"}},
		{&d.cuDeviceGetCount, []string{"cuDeviceGetCount"}},
		{&d.cuDeviceGet, []string{"cuDeviceGet"}},
		{&d.cuDeviceGetName, []string{"cuDeviceGetName"}},
		{&d.cuDeviceTotalMem, []string{"cuDeviceTotalMem_v2"}},
		{&d.cuDeviceGetAttribute, []string{"cuDeviceGetAttribute"}},
		{&d.cuDevicePrimaryCtxRetain, []string{"cuDevicePrimaryCtxRetain"}},
		{&d.cuDevicePrimaryCtxRelease, []string{"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"}},
		{&d.cuDevicePrimaryCtxGetState, []string{"cuDevicePrimaryCtxGetState"}},
		{&d.cuDevicePrimaryCtxSetFlags, []string{"cuDevicePrimaryCtxSetFlags_v2", "cuDevicePrimaryCtxSetFlags"}},
		{&d.cuCtxSetCurrent, []string{"cuCtxSetCurrent"}},
		{&d.cuCtxSynchronize, []string{"cuCtxSynchronize"}},
		{&d.cuMemGetInfo, []string{"cuMemGetInfo_v2"}},
		{&d.cuMemAlloc, []string{"cuMemAlloc_v2"}},
		{&d.cuMemFree, []string{"cuMemFree_v2"}},
		{&d.cuMemHostAlloc, []string{"cuMemHostAlloc"}},
		{&d.cuMemFreeHost, []string{"cuMemFreeHost"}},
		{&d.cuMemHostRegister, []string{"cuMemHostRegister_v2"}},
		{&d.cuMemHostUnregister, []string{"cuMemHostUnregister"}},
		{&d.cuMemcpyHtoDAsync, []string{"cuMemcpyHtoDAsync_v2"}},
		{&d.cuMemcpyDtoHAsync, []string{"cuMemcpyDtoHAsync_v2"}},
		{&d.cuMemcpyDtoDAsync, []string{"cuMemcpyDtoDAsync_v2"}},
		{&d.cuMemcpyHtoD, []string{"cuMemcpyHtoD_v2"}},
		{&d.cuMemcpyDtoH, []string{"cuMemcpyDtoH_v2"}},
		{&d.cuMemsetD8Async, []string{"cuMemsetD8Async"}},
		{&d.cuStreamCreate, []string{"cuStreamCreate"}},
		{&d.cuStreamDestroy, []string{"cuStreamDestroy_v2"}},
		{&d.cuStreamSynchronize, []string{"cuStreamSynchronize"}},
		{&d.cuStreamWaitEvent, []string{"cuStreamWaitEvent"}},
		{&d.cuStreamQuery, []string{"cuStreamQuery"}},
		{&d.cuEventCreate, []string{"cuEventCreate"}},
		{&d.cuEventDestroy, []string{"cuEventDestroy_v2"}},
		{&d.cuEventRecord, []string{"cuEventRecord"}},
		{&d.cuEventSynchronize, []string{"cuEventSynchronize"}},
		{&d.cuEventQuery, []string{"cuEventQuery"}},
		{&d.cuEventElapsedTime, []string{"cuEventElapsedTime_v2", "cuEventElapsedTime"}},
		{&d.cuModuleLoadDataEx, []string{"cuModuleLoadDataEx"}},
		{&d.cuModuleUnload, []string{"cuModuleUnload"}},
		{&d.cuModuleGetFunction, []string{"cuModuleGetFunction"}},
		{&d.cuLaunchKernel, []string{"cuLaunchKernel"}},
	}
	for _, s := range syms {
		for _, n := range s.names {
			if p, err := purego.Dlsym(lib, n); err == nil && p != 0 {
				*s.p = p
				break
			}
		}
		if *s.p == 0 {
			return fmt.Errorf("cuda: the driver library lacks %s: driver too old", s.names[0])
		}
	}
	w, err := hostWaitFromEnv()
	hostWait.Store(int32(w))
	envErr = err
	if d.scratch, err = unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE); err != nil {
		return fmt.Errorf("cuda: scratch page: %w", err)
	}
	if err := check("cuInit", d.cuInit, 0); err != nil {
		return err
	}
	v, err := outInt32("cuDriverGetVersion", d.cuDriverGetVersion)
	if err != nil {
		return err
	}
	d.version = int(v)
	if d.version < MinDriverVersion {
		return fmt.Errorf("cuda: driver API version %d.%d is older than the %d.%d dos needs",
			d.version/1000, d.version%1000/10, MinDriverVersion/1000, MinDriverVersion%1000/10)
	}
	return nil
}

// Available returns nil when a CUDA driver and at least one device can be
// used, and otherwise an error that says why: no driver library, a driver
// too old, cuInit failing, or no device. It never exits the process.
func Available() error {
	n, err := DeviceCount()
	if err != nil {
		return err
	}
	if n == 0 {
		return errors.New("cuda: the driver sees no CUDA device")
	}
	return nil
}

// DriverVersion returns the driver API version, 1000*major + 10*minor
// (cuDriverGetVersion).
func DriverVersion() (int, error) {
	if err := load(); err != nil {
		return 0, err
	}
	return driver.version, nil
}

// DeviceCount returns the number of CUDA devices (cuDeviceGetCount).
func DeviceCount() (int, error) {
	if err := load(); err != nil {
		return 0, err
	}
	n, err := outInt32("cuDeviceGetCount", driver.cuDeviceGetCount)
	return int(n), err
}

// MaxCallArgs is the most integer or pointer arguments Call passes: the
// size of purego's argument block.
const MaxCallArgs = 32

// Call invokes the C function at fn (from purego.Dlsym) with up to
// MaxCallArgs integer or pointer arguments and returns the low 32 bits of
// its result, sign-extended: a C int or enum such as a CUresult or a
// cublasStatus_t. It panics with more than MaxCallArgs arguments. It does
// not allocate, so it suits hot paths into other CUDA libraries (cuBLASLt's
// cublasLtMatmul takes 16 arguments). Float arguments and results wider
// than 32 bits are out of its reach: use purego.SyscallN for those.
//
// Memory that the arguments point to must stay valid during the call and
// must not be Go heap memory the garbage collector could free meanwhile:
// this package keeps such memory off the heap (mmap'd pages). A function
// that needs a CUDA context current, as most CUDA libraries do, must be
// called between Device.Lock (or Stream.Lock) and Unlock.
func Call(fn uintptr, args ...uintptr) int { return call(fn, args...) }

// call is Call, for this package.
//
// It is purego.SyscallN without SyscallN's one heap allocation per call
// (its variadic argument escapes, a consequence of go:uintptrescapes): the
// argument block lives on this goroutine's stack (the stack cannot move
// during a cgo call) and goes to purego's own trampoline through
// runtime.cgocall, as SyscallN does. The block's layout and the trampoline
// are purego v0.11.3's (go.mod pins it); TestCallABI checks them on every
// machine with libc.
func call(fn uintptr, args ...uintptr) int {
	if len(args) > MaxCallArgs {
		panic(fmt.Sprintf("cuda: call with %d arguments, more than %d", len(args), MaxCallArgs))
	}
	s := syscallArgs{fn: fn}
	copy(s.ints()[:], args)
	runtime_cgocall(syscallXABI0, unsafe.Pointer(&s))
	return int(int32(s.a1))
}

// syscallArgs mirrors purego's argument block (purego/syscall.go, v0.11.3),
// which its assembly trampoline reads and writes: the function, 32 integer
// arguments (the result comes back in a1), 8 float registers, arm64's r8.
type syscallArgs struct {
	_ structs.HostLayout

	fn, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15                uintptr
	a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32 uintptr
	f1, f2, f3, f4, f5, f6, f7, f8                                                      uintptr
	arm64R8                                                                             uintptr
}

// ints is the block's integer arguments a1..a32 as an array: the fields are
// consecutive uintptrs of a HostLayout struct, so nothing pads them
// (TestCallArgsLayout checks it).
func (s *syscallArgs) ints() *[MaxCallArgs]uintptr {
	return (*[MaxCallArgs]uintptr)(unsafe.Pointer(&s.a1))
}

// runtime.cgocall, as purego reaches it (the runtime allows this link for
// purego's sake). noescape: the argument block stays on the stack.
//
//go:linkname runtime_cgocall runtime.cgocall
//go:noescape
func runtime_cgocall(fn uintptr, arg unsafe.Pointer) int32

// purego's trampoline that unpacks a syscallArgs and calls the C function.
//
//go:linkname syscallXABI0 github.com/ebitengine/purego.syscallXABI0
var syscallXABI0 uintptr

// check calls fn and turns a non-zero CUresult into an *Error.
func check(name string, fn uintptr, args ...uintptr) error {
	if r := call(fn, args...); r != 0 {
		return newError(name, r)
	}
	return nil
}

func newError(name string, code int) error {
	e := &Error{Call: name, Code: code, Name: fmt.Sprintf("CUresult(%d)", code), Msg: "unknown error"}
	if driver.cuGetErrorName == 0 {
		return e
	}
	driver.mu.Lock()
	defer driver.mu.Unlock()
	out := scratchAddr()
	if call(driver.cuGetErrorName, uintptr(code), out) == 0 {
		e.Name = cString(scratchPtr())
	}
	if call(driver.cuGetErrorString, uintptr(code), out) == 0 {
		e.Msg = cString(scratchPtr())
	}
	return e
}

// scratchAddr is the address of the scratch page; hold driver.mu.
func scratchAddr() uintptr { return uintptr(unsafe.Pointer(&driver.scratch[0])) }

// scratchPtr reads the pointer a call stored at the start of the scratch
// page; hold driver.mu.
func scratchPtr() unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&driver.scratch[0])) }

// scratchU64 reads the 8-byte integer at the start of the scratch page.
func scratchU64() uint64 { return scratchU64At(0) }

// scratchU64At reads the 8-byte integer at byte off of the scratch page.
func scratchU64At(off int) uint64 { return *(*uint64)(unsafe.Pointer(&driver.scratch[off])) }

// scratchPtrAt0 is the scratch page itself, for calls that write a string
// into it.
func scratchPtrAt0() unsafe.Pointer { return unsafe.Pointer(&driver.scratch[0]) }

// outInt32 calls fn(&int32, args...) and returns the int32.
func outInt32(name string, fn uintptr, args ...uintptr) (int32, error) {
	v, err := outU64(name, fn, args...)
	return int32(uint32(v)), err // little-endian: the int32 is the low half
}

// outU64 calls fn(&out, args...), out being 8 zeroed bytes, and returns
// them (a handle, a device pointer, a size, or an int32 in the low half).
func outU64(name string, fn uintptr, args ...uintptr) (uint64, error) {
	driver.mu.Lock()
	defer driver.mu.Unlock()
	*(*uint64)(unsafe.Pointer(&driver.scratch[0])) = 0
	var a [8]uintptr
	a[0] = scratchAddr()
	n := copy(a[1:], args)
	if r := call(fn, a[:n+1]...); r != 0 {
		return 0, newErrorLocked(name, r)
	}
	return scratchU64(), nil
}

// newErrorLocked is newError for a caller that holds driver.mu.
func newErrorLocked(name string, code int) error {
	driver.mu.Unlock()
	defer driver.mu.Lock()
	return newError(name, code)
}

// cString copies the NUL-terminated C string at p (at most 4096 bytes).
func cString(p unsafe.Pointer) string {
	if p == nil {
		return ""
	}
	b := unsafe.Slice((*byte)(p), 4096)
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// lockCtx locks the goroutine to its thread and makes ctx current; the
// caller must call runtime.UnlockOSThread when done.
func lockCtx(ctx uintptr) error {
	runtime.LockOSThread()
	if r := call(driver.cuCtxSetCurrent, ctx); r != 0 {
		runtime.UnlockOSThread()
		return newError("cuCtxSetCurrent", r)
	}
	return nil
}
