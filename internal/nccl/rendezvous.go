package nccl

import (
	"encoding/hex"
	"fmt"
	"os"
	"runtime"
	"unsafe"

	"github.com/deepstates/dos/internal/cuda"
	"github.com/ebitengine/purego"
)

// EnvNVLS is NCCL's switch for NVLink SHARP (multicast objects on NVSwitch
// systems). dos sets it to "0" in the process's C environment before NCCL
// loads, whatever its value was: a program that uses multicast can put a
// host's shared GPUs out of service (the GPU machines' KINDS.md), and dos's
// collectives do not need it.
const EnvNVLS = "NCCL_NVLS_ENABLE"

// nvlsOff sets EnvNVLS=0 in the C environment, where NCCL reads it
// (getenv), and in Go's. A pure-Go binary's os.Setenv need not reach C's
// environ, so it calls libc's setenv through purego; the strings live off
// the Go heap for the call.
func nvlsOff() error {
	if err := os.Setenv(EnvNVLS, "0"); err != nil {
		return fmt.Errorf("nccl: setting %s=0: %w", EnvNVLS, err)
	}
	libc, err := purego.Dlopen("libc.so.6", purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return fmt.Errorf("nccl: setting %s=0 before NCCL loads: %w", EnvNVLS, err)
	}
	setenv, err := purego.Dlsym(libc, "setenv")
	if err != nil {
		return fmt.Errorf("nccl: setting %s=0 before NCCL loads: %w", EnvNVLS, err)
	}
	out, free, err := outBlock()
	if err != nil {
		return err
	}
	defer free()
	b := unsafe.Slice((*byte)(out), 64)
	copy(b, EnvNVLS+"\x00")
	copy(b[32:], "0\x00")
	if r := cuda.Call(setenv, uintptr(out), uintptr(unsafe.Add(out, 32)), 1); r != 0 {
		return fmt.Errorf("nccl: setenv(%s, 0) failed (%d)", EnvNVLS, r)
	}
	return nil
}

// ID is a communicator's unique id (ncclUniqueId, 128 bytes): rank 0
// creates it (NewID) and hands it to the other ranks, in other processes
// or on other hosts, which join with InitRank. String and ParseID carry it
// through a file or a socket as hex.
type ID [128]byte

// String returns the id in hex (256 characters).
func (id ID) String() string { return hex.EncodeToString(id[:]) }

// ParseID reads an id written by String.
//
// Errors: not 256 hex digits.
func ParseID(s string) (ID, error) {
	var id ID
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != len(id) {
		return id, fmt.Errorf("nccl: a unique id is %d hex digits; got %d characters (%v)", 2*len(id), len(s), err)
	}
	copy(id[:], b)
	return id, nil
}

// NewID creates a communicator's unique id (ncclGetUniqueId): called once,
// by the process of rank 0, which then hands it to the others.
//
// Errors: no NCCL; NCCL's (it opens its bootstrap socket here).
func NewID() (ID, error) {
	var id ID
	if err := load(); err != nil {
		return id, err
	}
	out, free, err := outBlock()
	if err != nil {
		return id, err
	}
	defer free()
	if r := cuda.Call(lib.getUniqueID, uintptr(out)); r != 0 {
		return id, newError("ncclGetUniqueId", r, 0)
	}
	copy(id[:], unsafe.Slice((*byte)(out), len(id)))
	return id, nil
}

// InitRank joins rank rank of an n-rank communicator whose id rank 0 made
// with NewID (ncclCommInitRank), on dev: each process (or goroutine)
// calls it for its own ranks, and it returns once all n have joined, which
// is how several processes, or hosts, meet. With one process driving
// every GPU, InitAll does the same in one call.
//
// Errors: no NCCL; n < 1, rank outside [0, n), a nil device; NCCL's.
func InitRank(dev *cuda.Device, n int, id ID, rank int) (*Comm, error) {
	if err := load(); err != nil {
		return nil, err
	}
	if n < 1 || rank < 0 || rank >= n {
		return nil, fmt.Errorf("nccl: InitRank of rank %d of %d", rank, n)
	}
	if dev == nil {
		return nil, fmt.Errorf("nccl: InitRank: nil device")
	}
	out, free, err := outBlock()
	if err != nil {
		return nil, err
	}
	defer free()
	if err := dev.Lock(); err != nil {
		return nil, fmt.Errorf("nccl: InitRank on device %d: %w", dev.Ordinal, err)
	}
	var r int
	switch runtime.GOARCH {
	case "amd64":
		// System V: the 128-byte struct is passed in memory, on the stack
		// after the register arguments; comm, nranks and rank take rdi,
		// rsi and rdx. purego's trampoline puts the 7th argument and on
		// onto the stack in order.
		var a [6 + 16]uintptr
		a[0], a[1], a[2] = uintptr(out), uintptr(n), uintptr(rank)
		for i := range 16 {
			a[6+i] = uintptr(*(*uint64)(unsafe.Pointer(&id[8*i])))
		}
		r = cuda.Call(lib.commInitRank, a[:]...)
	case "arm64":
		// AAPCS64: a composite over 16 bytes is copied by the caller and
		// passed by reference, in argument order.
		p := unsafe.Add(out, 256)
		copy(unsafe.Slice((*byte)(p), len(id)), id[:])
		r = cuda.Call(lib.commInitRank, uintptr(out), uintptr(n), uintptr(p), uintptr(rank))
	default:
		cuda.Unlock()
		return nil, fmt.Errorf("nccl: InitRank on %s: only amd64 and arm64", runtime.GOARCH)
	}
	cuda.Unlock()
	if r != 0 {
		return nil, newError(fmt.Sprintf("ncclCommInitRank(rank %d of %d, device %d)", rank, n, dev.Ordinal), r, 0)
	}
	return &Comm{h: *(*uintptr)(out), dev: dev, rank: rank, size: n}, nil
}
