package scheduler

import (
	"time"

	"github.com/deepstates/dos/adam"
)

// Mem is device memory from Device.Alloc: Len bytes.
type Mem interface{ Len() int64 }

// Host is pinned host memory from Device.AllocHost: the device copies to
// and from it asynchronously.
type Host interface{ Bytes() []byte }

// Stream is an in-order queue of device work (a CUDA stream), from
// Device.NewStream.
type Stream interface{ isStream() }

// Event marks a point in a stream's work (a CUDA event), from
// Device.NewEvent: other streams wait for it, the host blocks on it, and
// two completed events give the time between them.
type Event interface{ isEvent() }

// Vec is N elements of device memory from element Off of Mem; the element
// size (4 for fp32, 2 for bf16 and fp16) comes from where it is used.
type Vec struct {
	Mem    Mem
	Off, N int64
}

// State is a subgroup's fp32 optimizer state on the device: master weights,
// exp_avg, exp_avg_sq and, with amsgrad only, max_exp_avg_sq.
type State struct {
	Param, ExpAvg, ExpAvgSq, MaxExpAvgSq Vec
}

// Device is what the scheduler needs of a GPU (DESIGN.md: the interface is
// defined where it is consumed). NewCUDA implements it on a CUDA device
// with dos's kernels; NewSim is the simulated device for tests.
//
// Enqueueing methods (H2D, D2H, D2D, Record, Wait, AdamW, Widen16, Zero) return
// an error when the work could not be enqueued; such a call has no effect.
// Work that fails later, on the device, is reported by Sync or GradStats.
// Methods may be called from several goroutines.
type Device interface {
	// Name names the device ("NVIDIA H200", "sim").
	Name() string
	// Alloc returns bytes (> 0) of device memory. Errors: out of memory.
	Alloc(bytes int64) (Mem, error)
	// AllocHost returns bytes (> 0) of pinned host memory, zeroed, at
	// least 4096-byte aligned.
	AllocHost(bytes int64) (Host, error)
	// MapHost returns bytes (> 0) of zeroed host memory that only the CPU
	// reads and writes, never a copy: pageable, 64-byte aligned (on CUDA,
	// cuda.MapHost's: outside the Go heap, and from 16 MiB on 2
	// MiB-aligned and advised for transparent huge pages). UnmapHost
	// releases it. Errors: bytes <= 0, mmap's; UnmapHost of memory
	// MapHost did not return.
	MapHost(bytes int64) (Host, error)
	UnmapHost(h Host) error
	// NewStream and NewEvent create a stream and an event (events can be
	// timed).
	NewStream() (Stream, error)
	NewEvent() (Event, error)
	// FreeMem, FreeHost, FreeStream and FreeEvent release what this
	// device returned. Errors: the driver's, or a handle from another
	// device.
	FreeMem(m Mem) error
	FreeHost(h Host) error
	FreeStream(s Stream) error
	FreeEvent(e Event) error
	// H2D copies n bytes from src at srcOff to dst at dstOff on s; D2H
	// the other way.
	H2D(s Stream, dst Mem, dstOff int64, src Host, srcOff, n int64) error
	D2H(s Stream, dst Host, dstOff int64, src Mem, srcOff, n int64) error
	// D2D copies n bytes from src at srcOff to dst at dstOff on s, both
	// device memory.
	D2D(s Stream, dst Mem, dstOff int64, src Mem, srcOff, n int64) error
	// Record marks the work enqueued on s so far; Wait makes later work on
	// s wait for e's last Record; Sync blocks the caller until it is done.
	Record(e Event, s Stream) error
	Wait(s Stream, e Event) error
	Sync(e Event) error
	// Elapsed is the device time from a to b, both recorded and done.
	Elapsed(a, b Event) (time.Duration, error)
	// AdamW enqueues the fused update of st with gradient g (gd: F32, BF16
	// or F16) writing the 16-bit copy out (od: BF16 or F16; 0 for none),
	// with adam.Path.Step's semantics and results.
	AdamW(s Stream, c *adam.Coeffs, st State, gd adam.DType, g Vec, od adam.DType, out Vec) error
	// Widen16 enqueues dst = float32(src) for a BF16 or F16 src.
	Widen16(s Stream, d adam.DType, dst, src Vec) error
	// Zero enqueues setting n bytes of m from off to zero (a memset).
	Zero(s Stream, m Mem, off, n int64) error
	// GradStats runs adam.Path.GradStats on a gradient of dtype gd on the
	// device, on s, and waits for it: whether every element is finite,
	// and the sum of squares of the unscaled elements, the CPU's bits
	// (adam.Path.GradStats's order).
	GradStats(s Stream, gd adam.DType, g Vec, unscale float32) (finite bool, sumSquares float64, err error)
	// GradPartials is GradStats without the last sum
	// (adam.Pool.GradPartials on the device): the sum of squares of g's
	// adam.MinChunk block b goes to dst[b] (len(dst) at least g's
	// blocks), the CPU's bits, so that the partials of gradients held
	// partly on the host add up to those of one device gradient.
	GradPartials(s Stream, gd adam.DType, g Vec, unscale float32, dst []float64) (finite bool, err error)
	// GradPartialsTo is GradPartials enqueued on s without a wait: the
	// partial sums go to dst's float64 elements in device memory (dst.N
	// at least g's blocks, the CPU's bits) and an element of g that is
	// not finite sets flag's int32 element (flag.N 1) to 1; nothing
	// clears it (Zero does). The caller orders its read of them after s.
	GradPartialsTo(s Stream, gd adam.DType, g Vec, unscale float32, dst, flag Vec) error
}
