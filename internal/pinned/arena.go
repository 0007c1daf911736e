// Package pinned provides page-locked (pinned) host memory for transfers to
// and from the GPU: an Arena, one mapping carved into aligned buffers, and
// a Ring, a bounded FIFO of reservations with backpressure for staging.
//
// With a CUDA device the memory is mmap'd and pinned with
// cuMemHostRegister (cuda.Device.HostRegister), so copies run at full PCIe
// speed; without one (d == nil) it is plain page-aligned, populated mmap
// memory with the same API (cuda.MapHost), so CPU-only code and tests run
// the same paths. Either way the memory is mapped once, up front, from
// 16 MiB on aligned and advised for transparent huge pages (cuda.MapHost):
// the resident set grows by the arena's size (rounded up to a page, or to
// 2 MiB) and no more, and a pinning failure is an error, never a silent
// fallback.
package pinned

import (
	"errors"
	"fmt"
	"sync"

	"github.com/deepstates/dos/internal/cuda"
)

// ErrExhausted is returned by Arena.Alloc when the arena has no room left.
var ErrExhausted = errors.New("pinned: arena exhausted")

// ErrClosed is returned by a Ring after Close, and by an Arena after Free.
var ErrClosed = errors.New("pinned: closed")

// Arena is one mapping of host memory carved into buffers by a bump
// allocator. Safe for concurrent use.
type Arena struct {
	mem  []byte
	host *cuda.HostBuffer // the pinned mapping; nil when unpinned

	mu     sync.Mutex
	used   int64
	closed bool
}

// New maps bytes (> 0) of host memory (cuda.MapHost) and pins it on d, or
// leaves it unpinned when d is nil. The mapping is rounded up to whole
// pages (from 16 MiB on, to whole 2 MiB); the arena's Len, and what Alloc
// hands out, is exactly bytes.
//
// Errors: bytes <= 0, mmap failing, the driver refusing to pin (for
// example over the locked-memory limit); the error says which.
func New(d *cuda.Device, bytes int64) (*Arena, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("pinned: arena of %d bytes: size must be > 0", bytes)
	}
	if d != nil {
		h, err := d.HostRegister(bytes)
		if err != nil {
			return nil, fmt.Errorf("pinned: pinning %d bytes: %w", bytes, err)
		}
		return &Arena{mem: h.Bytes(), host: h}, nil
	}
	mem, err := cuda.MapHost(bytes)
	if err != nil {
		return nil, fmt.Errorf("pinned: %w", err)
	}
	touch(mem[:cap(mem)])
	return &Arena{mem: mem}, nil
}

// Pinned reports whether the memory is page-locked for a device.
func (a *Arena) Pinned() bool { return a.host != nil }

// Len returns the arena's size in bytes.
func (a *Arena) Len() int64 { return int64(len(a.mem)) }

// Used returns the bytes handed out so far, alignment padding included.
func (a *Arena) Used() int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.used
}

// Buf is a buffer carved from an Arena: Len bytes at offset Off.
type Buf struct {
	a        *Arena
	Off, Len int64
}

// Alloc carves bytes (> 0) aligned to align (a power of two; 0 means 64,
// a cache line) from the arena.
//
// Errors: a bad size or alignment, ErrExhausted, ErrClosed.
func (a *Arena) Alloc(bytes, align int64) (Buf, error) {
	if align == 0 {
		align = 64
	}
	if bytes <= 0 || align < 0 || align&(align-1) != 0 {
		return Buf{}, fmt.Errorf("pinned: Alloc(%d, align %d): want a size > 0 and a power-of-two alignment", bytes, align)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return Buf{}, ErrClosed
	}
	off := (a.used + align - 1) &^ (align - 1)
	if off > int64(len(a.mem)) || bytes > int64(len(a.mem))-off {
		return Buf{}, fmt.Errorf("%w: %d bytes wanted, %d of %d free", ErrExhausted, bytes, int64(len(a.mem))-min(off, int64(len(a.mem))), len(a.mem))
	}
	a.used = off + bytes
	return Buf{a: a, Off: off, Len: bytes}, nil
}

// Reset makes the whole arena free again; buffers handed out before must
// not be used afterwards.
func (a *Arena) Reset() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.used = 0
}

// Free unpins and unmaps the memory. Buffers must not be used afterwards;
// a second Free does nothing.
func (a *Arena) Free() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	a.closed = true
	if a.host != nil {
		return a.host.Free()
	}
	return cuda.UnmapHost(a.mem)
}

// Bytes returns the buffer's memory.
func (b Buf) Bytes() []byte { return b.a.mem[b.Off : b.Off+b.Len : b.Off+b.Len] }

// Host returns the pinned mapping the buffer lies in and the buffer's
// offset in it, for cuda.Stream copies; nil when the arena is not pinned.
func (b Buf) Host() (*cuda.HostBuffer, int64) { return b.a.host, b.Off }

// Slice returns bytes [lo, hi) of the buffer as a buffer.
// Panics if the range is outside it.
func (b Buf) Slice(lo, hi int64) Buf {
	if lo < 0 || hi < lo || hi > b.Len {
		panic(fmt.Sprintf("pinned: Slice(%d, %d) of a %d-byte buffer", lo, hi, b.Len))
	}
	return Buf{a: b.a, Off: b.Off + lo, Len: hi - lo}
}

// touch faults every page of mem in (fresh, all-zero memory), as pinning
// does for a pinned arena: the resident set grows now, not on the hot path.
func touch(mem []byte) {
	for i := 0; i < len(mem); i += 4096 {
		mem[i] = 0
	}
}
