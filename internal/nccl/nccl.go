package nccl

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/deepstates/dos/internal/comm"
	"github.com/deepstates/dos/internal/cuda"
	"golang.org/x/sys/unix"
)

// EnvLibrary names the environment variable that points at NCCL: the
// library file itself or a directory holding it. It is searched first.
const EnvLibrary = "DOS_NCCL"

// library is where NCCL is searched: DOS_NCCL, the loader's search path
// (Debian's and Ubuntu's libnccl2 put it in /usr/lib/x86_64-linux-gnu), the
// CUDA toolkit, and the directories of NVIDIA's pip wheels (PyTorch's
// nvidia/nccl/lib).
var library = cuda.Library{Pkg: "nccl", Name: "NCCL", Names: []string{"libnccl.so.2", "libnccl.so"}, Env: EnvLibrary,
	Wheels: []string{"nccl", "cu13"}}

// lib holds NCCL's entry points, loaded once.
var lib struct {
	once sync.Once
	err  error
	path string

	getVersion, getErrorString, getLastError, commInitAll, commDestroy, commAbort uintptr
	getUniqueID, commInitRank                                                     uintptr
	commGetAsyncError, allGather, reduceScatter, allReduce, broadcast             uintptr
	groupStart, groupEnd                                                          uintptr
}

func load() error {
	lib.once.Do(func() {
		if err := nvlsOff(); err != nil {
			lib.err = err
			return
		}
		h, path, err := library.Open()
		if err != nil {
			lib.err = err
			return
		}
		lib.path = path
		lib.err = library.Symbols(h, path, map[string]*uintptr{
			"ncclGetVersion":        &lib.getVersion,
			"ncclGetErrorString":    &lib.getErrorString,
			"ncclCommInitAll":       &lib.commInitAll,
			"ncclGetUniqueId":       &lib.getUniqueID,
			"ncclCommInitRank":      &lib.commInitRank,
			"ncclCommDestroy":       &lib.commDestroy,
			"ncclCommAbort":         &lib.commAbort,
			"ncclCommGetAsyncError": &lib.commGetAsyncError,
			"ncclAllGather":         &lib.allGather,
			"ncclReduceScatter":     &lib.reduceScatter,
			"ncclAllReduce":         &lib.allReduce,
			"ncclBroadcast":         &lib.broadcast,
			"ncclGroupStart":        &lib.groupStart,
			"ncclGroupEnd":          &lib.groupEnd,
		})
		if lib.err == nil {
			// ncclGetLastError (NCCL 2.13 and later) adds the reason.
			_ = library.Symbols(h, path, map[string]*uintptr{"ncclGetLastError": &lib.getLastError})
		}
	})
	return lib.err
}

// Available returns nil when NCCL and a CUDA device can be used, and
// otherwise an error that says why: no library (naming every place
// searched), a library without the functions used here, or no usable
// driver or device (cuda.Available). It never panics.
func Available() error {
	if err := load(); err != nil {
		return err
	}
	return cuda.Available()
}

// Version returns NCCL's version, ncclGetVersion: major*10000 + minor*100
// + patch (e.g. 22703 for 2.27.3), and the path it was loaded from.
func Version() (int, string, error) {
	if err := load(); err != nil {
		return 0, "", err
	}
	out, free, err := outBlock()
	if err != nil {
		return 0, "", err
	}
	defer free()
	if r := cuda.Call(lib.getVersion, uintptr(out)); r != 0 {
		return 0, "", newError("ncclGetVersion", r, 0)
	}
	return int(*(*int32)(out)), lib.path, nil
}

// resultNames are the ncclResult_t values (nccl.h).
var resultNames = map[int]string{
	0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
	4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
}

// Error is a failed NCCL call.
type Error struct {
	Call   string // the function and its main arguments
	Result int    // the ncclResult_t
	Name   string // e.g. ncclInvalidUsage
	Msg    string // ncclGetErrorString's, and ncclGetLastError's where there is one
}

func (e *Error) Error() string {
	if e.Msg == "" {
		return fmt.Sprintf("nccl: %s: %s", e.Call, e.Name)
	}
	return fmt.Sprintf("nccl: %s: %s: %s", e.Call, e.Name, e.Msg)
}

// newError describes result r of call; comm, when not 0, is asked for its
// last error.
func newError(call string, r int, h uintptr) *Error {
	e := &Error{Call: call, Result: r, Name: resultNames[r]}
	if e.Name == "" {
		e.Name = fmt.Sprintf("ncclResult_t(%d)", r)
	}
	e.Msg = cuda.CStringResult(lib.getErrorString, r)
	if lib.getLastError != 0 {
		if last := cuda.CStringResult(lib.getLastError, int(h)); last != "" && last != e.Msg {
			e.Msg += " (" + last + ")"
		}
	}
	return e
}

// outBlock maps a page off the Go heap for a call's out-parameters.
func outBlock() (unsafe.Pointer, func(), error) {
	b, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		return nil, nil, fmt.Errorf("nccl: mmap: %w", err)
	}
	return unsafe.Pointer(&b[0]), func() { _ = unix.Munmap(b) }, nil
}

// maxRanks bounds InitAll's devices (its out-parameters share one page).
const maxRanks = 256

// Comm is one rank's end of a communicator (ncclComm_t) on one GPU.
// Collectives are enqueued on a stream of that GPU. Rank, Size and Device
// are safe for concurrent use; the collectives of one Comm must come from
// one goroutine at a time, in the same order on every rank.
type Comm struct {
	h      uintptr
	dev    *cuda.Device
	rank   int
	size   int
	closed atomic.Bool
	abort  atomic.Pointer[error] // Abort's
}

// ErrClosed is a collective's error on a closed Comm.
var ErrClosed = errors.New("nccl: use of a closed communicator")

// InitAll creates a communicator over devs, one rank per device in order
// (ncclCommInitAll): rank r runs on devs[r]. Every device must be another
// GPU (NCCL refuses two ranks on one).
//
// Errors: no NCCL (Available's), no devices or more than 256, a nil or
// closed device, NCCL's own (*Error, e.g. ncclInvalidUsage for a GPU named
// twice).
func InitAll(devs []*cuda.Device) ([]*Comm, error) {
	if err := load(); err != nil {
		return nil, err
	}
	if len(devs) == 0 || len(devs) > maxRanks {
		return nil, fmt.Errorf("nccl: InitAll of %d devices: want 1 to %d", len(devs), maxRanks)
	}
	out, free, err := outBlock()
	if err != nil {
		return nil, err
	}
	defer free()
	comms := unsafe.Slice((*uintptr)(out), len(devs))
	list := unsafe.Slice((*int32)(unsafe.Add(out, 8*maxRanks)), len(devs))
	for i, d := range devs {
		if d == nil {
			return nil, fmt.Errorf("nccl: InitAll: device %d is nil", i)
		}
		list[i] = int32(d.Ordinal)
	}
	if err := devs[0].Lock(); err != nil {
		return nil, fmt.Errorf("nccl: InitAll: device %d: %w", devs[0].Ordinal, err)
	}
	r := cuda.Call(lib.commInitAll, uintptr(out), uintptr(len(devs)), uintptr(unsafe.Pointer(&list[0])))
	cuda.Unlock()
	if r != 0 {
		return nil, newError(fmt.Sprintf("ncclCommInitAll(%d devices %v)", len(devs), list), r, 0)
	}
	cs := make([]*Comm, len(devs))
	for i, d := range devs {
		cs[i] = &Comm{h: comms[i], dev: d, rank: i, size: len(devs)}
	}
	return cs, nil
}

// Rank returns this end's rank, in [0, Size).
func (c *Comm) Rank() int { return c.rank }

// Size returns the number of ranks.
func (c *Comm) Size() int { return c.size }

// Device returns the GPU this rank runs on.
func (c *Comm) Device() *cuda.Device { return c.dev }

// Span is a range of device memory: Len bytes of Buf from byte Off.
type Span struct {
	Buf      *cuda.Buffer
	Off, Len int64
}

// dataType maps comm's element types to ncclDataType_t.
func dataType(dt comm.DType) (uintptr, error) {
	switch dt {
	case comm.F32:
		return 7, nil // ncclFloat32
	case comm.BF16:
		return 9, nil // ncclBfloat16
	case comm.F64:
		return 8, nil // ncclFloat64
	}
	return 0, fmt.Errorf("nccl: dtype %v: want float32, bfloat16 or float64", dt)
}

// redOp maps comm's reductions to ncclRedOp_t.
func redOp(op comm.Op) (uintptr, error) {
	switch op {
	case comm.Sum:
		return 0, nil // ncclSum
	case comm.Avg:
		return 4, nil // ncclAvg
	}
	return 0, fmt.Errorf("nccl: reduction %v: want sum or avg", op)
}

// ptr checks sp against its buffer and element size es and returns its
// device address.
func (sp Span) ptr(what string, es int64) (uintptr, error) {
	if sp.Buf == nil {
		return 0, fmt.Errorf("nccl: %s: nil buffer", what)
	}
	if sp.Buf.Freed() {
		return 0, fmt.Errorf("nccl: %s: %w", what, cuda.ErrFreed)
	}
	if sp.Off < 0 || sp.Len < 0 || sp.Off > sp.Buf.Len()-sp.Len {
		return 0, fmt.Errorf("nccl: %s: bytes [%d, %d+%d) outside a buffer of %d", what, sp.Off, sp.Off, sp.Len, sp.Buf.Len())
	}
	if sp.Len%es != 0 {
		return 0, fmt.Errorf("nccl: %s: %d bytes, not a multiple of the element's %d", what, sp.Len, es)
	}
	return uintptr(sp.Buf.Ptr() + uint64(sp.Off)), nil
}

// sizes checks a collective's spans: big == mult*small bytes, each a whole
// number of elements of es bytes.
func sizes(call string, small, big int64, mult int, es int64, smallName, bigName string) error {
	if small%es != 0 || big%es != 0 {
		return fmt.Errorf("nccl: %s: %s %d and %s %d bytes: not whole elements of %d bytes", call, smallName, small, bigName, big, es)
	}
	if big != int64(mult)*small {
		return fmt.Errorf("nccl: %s: %s is %d bytes, want %d × %s's %d", call, bigName, big, mult, smallName, small)
	}
	return nil
}

// enter checks that c and s can be used together and makes the device
// current (Stream.Lock); the caller calls cuda.Unlock.
func (c *Comm) enter(call string, s *cuda.Stream) error {
	if p := c.abort.Load(); p != nil {
		return fmt.Errorf("%w: %w", comm.ErrAborted, *p)
	}
	if c.closed.Load() {
		return ErrClosed
	}
	if s == nil {
		return fmt.Errorf("nccl: %s: nil stream", call)
	}
	if s.Device() != c.dev {
		return fmt.Errorf("nccl: %s: rank %d's stream is on device %d, the communicator's on %d", call, c.rank, s.Device().Ordinal, c.dev.Ordinal)
	}
	return s.Lock()
}

// AllGather enqueues on s the gather of every rank's send, in rank order,
// into recv: recv.Len == Size()*send.Len (ncclAllGather). send may be
// recv's own rank's segment.
//
// Errors: the sizes, dtype, a freed buffer or stream, a closed or aborted
// communicator, NCCL's.
func (c *Comm) AllGather(s *cuda.Stream, send, recv Span, dt comm.DType) error {
	t, err := dataType(dt)
	if err != nil {
		return err
	}
	if err := sizes("AllGather", send.Len, recv.Len, c.size, dt.Size(), "send", "recv"); err != nil {
		return err
	}
	sp, err := send.ptr("AllGather send", dt.Size())
	if err != nil {
		return err
	}
	rp, err := recv.ptr("AllGather recv", dt.Size())
	if err != nil {
		return err
	}
	return c.call("ncclAllGather", s, lib.allGather, sp, rp, uintptr(send.Len/dt.Size()), t, c.h, 0)
}

// ReduceScatter enqueues on s the element-wise reduction with op of the
// ranks' send, writing segment Rank() of it into recv: send.Len ==
// Size()*recv.Len (ncclReduceScatter). recv may be send's own rank's
// segment.
//
// Errors: those of AllGather, and the reduction.
func (c *Comm) ReduceScatter(s *cuda.Stream, send, recv Span, dt comm.DType, op comm.Op) error {
	t, err := dataType(dt)
	if err != nil {
		return err
	}
	o, err := redOp(op)
	if err != nil {
		return err
	}
	if err := sizes("ReduceScatter", recv.Len, send.Len, c.size, dt.Size(), "recv", "send"); err != nil {
		return err
	}
	sp, err := send.ptr("ReduceScatter send", dt.Size())
	if err != nil {
		return err
	}
	rp, err := recv.ptr("ReduceScatter recv", dt.Size())
	if err != nil {
		return err
	}
	return c.call("ncclReduceScatter", s, lib.reduceScatter, sp, rp, uintptr(recv.Len/dt.Size()), t, o, c.h, 0)
}

// AllReduce enqueues on s the element-wise reduction with op of the ranks'
// send into every rank's recv: recv.Len == send.Len (ncclAllReduce); recv
// may be send.
//
// Errors: those of ReduceScatter.
func (c *Comm) AllReduce(s *cuda.Stream, send, recv Span, dt comm.DType, op comm.Op) error {
	t, err := dataType(dt)
	if err != nil {
		return err
	}
	o, err := redOp(op)
	if err != nil {
		return err
	}
	if err := sizes("AllReduce", send.Len, recv.Len, 1, dt.Size(), "send", "recv"); err != nil {
		return err
	}
	sp, err := send.ptr("AllReduce send", dt.Size())
	if err != nil {
		return err
	}
	rp, err := recv.ptr("AllReduce recv", dt.Size())
	if err != nil {
		return err
	}
	return c.call("ncclAllReduce", s, lib.allReduce, sp, rp, uintptr(send.Len/dt.Size()), t, o, c.h, 0)
}

// Broadcast enqueues on s the copy of root's buf into every other rank's
// buf, in place (ncclBroadcast with sendbuff == recvbuff), as bytes.
//
// Errors: a root outside [0, Size), those of AllGather.
func (c *Comm) Broadcast(s *cuda.Stream, buf Span, root int) error {
	if root < 0 || root >= c.size {
		return fmt.Errorf("nccl: Broadcast from root %d of %d ranks", root, c.size)
	}
	p, err := buf.ptr("Broadcast", 1)
	if err != nil {
		return err
	}
	// ncclUint8 (1): the buffer as bytes.
	return c.call("ncclBroadcast", s, lib.broadcast, p, p, uintptr(buf.Len), 1, uintptr(root), c.h, 0)
}

// call makes s's device current and calls the collective fn with args,
// whose last one, the cudaStream_t, it sets to s's handle; it allocates
// only on error.
func (c *Comm) call(name string, s *cuda.Stream, fn uintptr, args ...uintptr) error {
	if err := c.enter(name, s); err != nil {
		return err
	}
	args[len(args)-1] = s.Handle()
	r := cuda.Call(fn, args...)
	cuda.Unlock()
	if r != 0 {
		return newError(fmt.Sprintf("%s (rank %d of %d)", name, c.rank, c.size), r, c.h)
	}
	return nil
}

// GroupStart opens a group of collectives (ncclGroupStart): one goroutine
// may then call the collectives of several ranks, which NCCL launches
// together at GroupEnd. NCCL keeps the group per OS thread, so GroupStart
// locks the calling goroutine to its thread until GroupEnd, which the
// same goroutine must call (also after an error in between).
func GroupStart() error {
	if err := load(); err != nil {
		return err
	}
	runtime.LockOSThread()
	if r := cuda.Call(lib.groupStart); r != 0 {
		runtime.UnlockOSThread()
		return newError("ncclGroupStart", r, 0)
	}
	return nil
}

// GroupEnd closes the group GroupStart opened on this goroutine and
// launches its collectives (ncclGroupEnd), and unlocks the goroutine from
// its thread.
func GroupEnd() error {
	if err := load(); err != nil {
		return err
	}
	r := cuda.Call(lib.groupEnd)
	runtime.UnlockOSThread()
	if r != 0 {
		return newError("ncclGroupEnd", r, 0)
	}
	return nil
}

// AsyncError returns an error NCCL found while running this rank's
// collectives (ncclCommGetAsyncError; a remote rank's failure, a network
// error), or nil.
func (c *Comm) AsyncError() error {
	if c.closed.Load() {
		return ErrClosed
	}
	out, free, err := outBlock()
	if err != nil {
		return err
	}
	defer free()
	if r := cuda.Call(lib.commGetAsyncError, c.h, uintptr(out)); r != 0 {
		return newError("ncclCommGetAsyncError", r, c.h)
	}
	if r := int(*(*int32)(out)); r != 0 {
		return newError(fmt.Sprintf("rank %d of %d (asynchronous)", c.rank, c.size), r, c.h)
	}
	return nil
}

// Abort stops this rank's communicator (ncclCommAbort: its queued and
// running collectives are abandoned, a call blocked in NCCL on it
// returns) and fails every later call on it with err wrapped in
// comm.ErrAborted. It may run while a collective of this rank is blocked
// in NCCL, which is what it is for; a collective that starts while Abort
// runs may still reach the freed communicator: stop issuing collectives
// first. It frees the communicator: Close
// afterwards does nothing. Unlike internal/comm's Local, it does not reach
// the other ranks: their collectives that need this one stop completing
// (or report an error through AsyncError), so each of them must Abort too;
// a trainer aborts every rank's end when one fails.
func (c *Comm) Abort(err error) error {
	if err == nil {
		err = errors.New("aborted")
	}
	c.abort.CompareAndSwap(nil, &err)
	if c.closed.Swap(true) {
		return nil
	}
	if err := c.dev.Lock(); err != nil {
		return err
	}
	r := cuda.Call(lib.commAbort, c.h)
	cuda.Unlock()
	if r != 0 {
		return newError("ncclCommAbort", r, 0)
	}
	return nil
}

// Close frees the communicator after its queued collectives
// (ncclCommDestroy); a second Close does nothing.
func (c *Comm) Close() error {
	if c.closed.Swap(true) {
		return nil
	}
	if err := c.dev.Lock(); err != nil {
		return err
	}
	r := cuda.Call(lib.commDestroy, c.h)
	cuda.Unlock()
	if r != 0 {
		return newError("ncclCommDestroy", r, 0)
	}
	return nil
}
