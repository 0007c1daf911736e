package cuda

import (
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Module is loaded GPU code (cuModuleLoadDataEx), here PTX that the driver
// compiles for the device.
type Module struct {
	d     *Device
	h     uintptr
	freed atomic.Bool
}

// CUjit_option values for the compiler's error log.
const (
	jitErrorLogBuffer     = 5
	jitErrorLogBufferSize = 6
)

// LoadModule loads PTX source (NUL-termination is added) and compiles it
// for the device.
//
// Errors: empty PTX, or the driver rejecting it; the error carries the
// compiler's log (e.g. "ptxas ... syntax error").
func (d *Device) LoadModule(ptx []byte) (*Module, error) {
	if len(ptx) == 0 {
		return nil, fmt.Errorf("cuda: LoadModule: empty PTX")
	}
	// Off-heap copies of the image and the option arrays and log.
	const logSize = 8192
	page := unix.Getpagesize()
	size := (len(ptx) + 1 + 64 + logSize + page - 1) / page * page
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("cuda: LoadModule: mmap: %w", err)
	}
	defer unix.Munmap(mem)
	img := len(mem) - len(ptx) - 1
	copy(mem[img:], ptx)
	mem[len(mem)-1] = 0
	logOff := 64
	opts := (*[2]int32)(unsafe.Pointer(&mem[0]))
	vals := (*[2]uintptr)(unsafe.Pointer(&mem[8]))
	outMod := (*uintptr)(unsafe.Pointer(&mem[24]))
	opts[0], opts[1] = jitErrorLogBuffer, jitErrorLogBufferSize
	vals[0] = uintptr(unsafe.Pointer(&mem[logOff]))
	vals[1] = logSize
	if err := d.enter(); err != nil {
		return nil, err
	}
	defer exit()
	r := call(driver.cuModuleLoadDataEx, uintptr(unsafe.Pointer(outMod)), uintptr(unsafe.Pointer(&mem[img])), 2,
		uintptr(unsafe.Pointer(&opts[0])), uintptr(unsafe.Pointer(&vals[0])))
	if r != 0 {
		e := newError("cuModuleLoadDataEx", r).(*Error)
		if log := strings.TrimSpace(cString(unsafe.Pointer(&mem[logOff]))); log != "" {
			e.Msg += ": " + log
		}
		return nil, e
	}
	return &Module{d: d, h: *outMod}, nil
}

// Free unloads the module (cuModuleUnload); its Functions must not be
// launched afterwards (Launch returns ErrFreed). A second Free does nothing.
func (m *Module) Free() error {
	return m.d.release(&m.freed, "cuModuleUnload", driver.cuModuleUnload, m.h)
}

// Function is a kernel of a Module.
type Function struct {
	m    *Module
	h    uintptr
	Name string
}

// Function looks up the kernel name (its extern "C" name).
//
// Errors: no such kernel (CUDA_ERROR_NOT_FOUND), a freed module.
func (m *Module) Function(name string) (*Function, error) {
	if m.freed.Load() {
		return nil, ErrFreed
	}
	if err := m.d.enter(); err != nil {
		return nil, err
	}
	defer exit()
	cname := append([]byte(name), 0)
	driver.mu.Lock()
	defer driver.mu.Unlock()
	// The name is read during the call only; a NUL-terminated copy on the
	// scratch page keeps Go memory away from the driver.
	if len(cname) > 1024 {
		return nil, fmt.Errorf("cuda: kernel name too long: %.40q...", name)
	}
	copy(driver.scratch[64:], cname)
	if r := call(driver.cuModuleGetFunction, scratchAddr(), m.h, scratchAddr()+64); r != 0 {
		return nil, newErrorLocked(fmt.Sprintf("cuModuleGetFunction(%q)", name), r)
	}
	return &Function{m: m, h: uintptr(scratchU64()), Name: name}, nil
}

// MaxArgs is the most arguments an Args block holds.
const MaxArgs = 32

// Args is an off-heap block of kernel arguments for Launch: each Add
// appends one argument in the kernel's parameter order. An Args is used by
// one goroutine at a time; it may be reset and refilled for every launch
// (the driver copies the arguments at launch). Adding allocates nothing.
type Args struct {
	mem  []byte // [0, 8*MaxArgs): pointers to the values; then the values
	n    int
	bufs []*Buffer // device buffers named, checked at launch
	err  error
}

// NewArgs returns an empty argument block (one mmap'd page).
func NewArgs() (*Args, error) {
	mem, err := unix.Mmap(-1, 0, unix.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("cuda: NewArgs: mmap: %w", err)
	}
	a := &Args{mem: mem, bufs: make([]*Buffer, 0, MaxArgs)}
	for i := range MaxArgs {
		*(*uintptr)(unsafe.Pointer(&mem[8*i])) = uintptr(unsafe.Pointer(&mem[8*MaxArgs+8*i]))
	}
	return a, nil
}

// Free unmaps the block.
func (a *Args) Free() error {
	if a.mem == nil {
		return nil
	}
	err := unix.Munmap(a.mem)
	a.mem = nil
	return err
}

// Reset empties the block.
func (a *Args) Reset() {
	a.n, a.err = 0, nil
	clear(a.bufs[:cap(a.bufs)])
	a.bufs = a.bufs[:0]
}

func (a *Args) slot() []byte {
	if a.n >= MaxArgs {
		if a.err == nil {
			a.err = fmt.Errorf("cuda: more than %d kernel arguments", MaxArgs)
		}
		return make([]byte, 8)
	}
	s := a.mem[8*MaxArgs+8*a.n : 8*MaxArgs+8*a.n+8]
	a.n++
	return s
}

// Ptr adds the device address of b plus off bytes (a T* parameter). A freed
// buffer or an offset outside it makes Launch fail.
func (a *Args) Ptr(b *Buffer, off int64) *Args {
	if err := b.span("kernel argument", off, 0); err != nil && a.err == nil {
		a.err = err
	}
	if b != nil {
		a.bufs = append(a.bufs, b)
		*(*uint64)(unsafe.Pointer(&a.slot()[0])) = b.ptr + uint64(off)
	}
	return a
}

// U64 adds a 64-bit integer (long long, size_t).
func (a *Args) U64(v uint64) *Args {
	*(*uint64)(unsafe.Pointer(&a.slot()[0])) = v
	return a
}

// I32 adds a 32-bit integer (int).
func (a *Args) I32(v int32) *Args {
	*(*int32)(unsafe.Pointer(&a.slot()[0])) = v
	return a
}

// F32 adds a float.
func (a *Args) F32(v float32) *Args {
	*(*uint32)(unsafe.Pointer(&a.slot()[0])) = math.Float32bits(v)
	return a
}

// Dim3 is a grid or block shape.
type Dim3 struct{ X, Y, Z uint32 }

// Launch enqueues f on s with the grid and block shapes, sharedBytes of
// dynamic shared memory and the arguments in a (cuLaunchKernel). It does
// not allocate.
//
// Errors: an argument error recorded by Args (a freed buffer, too many
// arguments), a freed module or stream, a launch the driver refuses (too
// many threads, too much shared memory). A fault inside the kernel
// surfaces later, from Stream.Sync or Event.Sync.
func (f *Function) Launch(s *Stream, grid, block Dim3, sharedBytes uint32, a *Args) error {
	if a.err != nil {
		return a.err
	}
	for _, b := range a.bufs {
		if b.freed.Load() {
			return fmt.Errorf("cuda: launch %s: device buffer argument: %w", f.Name, ErrFreed)
		}
	}
	if f.m.freed.Load() {
		return fmt.Errorf("cuda: launch %s: module: %w", f.Name, ErrFreed)
	}
	if err := s.enter(); err != nil {
		return err
	}
	defer exit()
	r := call(driver.cuLaunchKernel, f.h, uintptr(grid.X), uintptr(grid.Y), uintptr(grid.Z),
		uintptr(block.X), uintptr(block.Y), uintptr(block.Z), uintptr(sharedBytes), s.h,
		uintptr(unsafe.Pointer(&a.mem[0])), 0)
	if r != 0 {
		return newError("cuLaunchKernel("+f.Name+")", r)
	}
	return nil
}
