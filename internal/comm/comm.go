// Package comm holds the collectives a ZeRO-3 trainer runs between its
// ranks: all-gather (a block's parameter shards into the whole block before
// its forward and backward), reduce-scatter (the gradients into each rank's
// shard), all-reduce (the global gradient norm, the non-finite check) and
// broadcast (the initial weights, NCCL's unique id), behind one interface,
// Comm, with NCCL's semantics (ncclAllGather, ncclReduceScatter,
// ncclAllReduce, ncclBroadcast).
//
// Local is the in-process implementation over host memory: N ranks in one
// process, each driven by its own goroutine, meet in every call. It is what
// `dos train --device sim --gpus N` and the tests run, so that the
// sharding, the order of the collectives and the multi-rank commit are
// tested without GPUs. internal/nccl has the same collectives over CUDA
// device memory (libnccl.so.2 through purego), enqueued on a stream.
//
// Every rank must call the same collectives in the same order, with the
// same element counts, dtype, operation and root: NCCL hangs or corrupts
// memory otherwise; Local returns an error on every rank naming the ranks
// that differ.
package comm

import (
	"errors"
	"fmt"
)

// DType is an element type of a collective's buffers.
type DType uint8

// The element types: fp32 (gradients, master weights), bf16 (the working
// copy, 16-bit gradients) and fp64 (statistics: the gradients' sum of
// squares).
const (
	F32 DType = iota
	BF16
	F64
)

// Size returns the bytes of one element: 4, 2 or 8.
func (d DType) Size() int64 {
	switch d {
	case F32:
		return 4
	case F64:
		return 8
	}
	return 2
}

func (d DType) String() string {
	switch d {
	case F32:
		return "float32"
	case BF16:
		return "bfloat16"
	case F64:
		return "float64"
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// Op is a reduction.
type Op uint8

// The reductions: Sum (ncclSum) and Avg (ncclAvg: the sum divided by the
// number of ranks).
const (
	Sum Op = iota
	Avg
)

func (o Op) String() string {
	switch o {
	case Sum:
		return "sum"
	case Avg:
		return "avg"
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Comm is one rank's end of a communicator of Size ranks (NCCL's
// ncclComm_t). Buffers are byte slices of the implementation's memory:
// host memory for Local. Element counts follow from the slices' lengths
// and the dtype; a length that is not a multiple of the element size is an
// error.
//
// A call returns once its result is in recv (Local) or, for a device
// implementation, once it is enqueued on the rank's stream. A Comm is used
// by one goroutine at a time.
type Comm interface {
	// Rank returns this end's rank, in [0, Size).
	Rank() int
	// Size returns the number of ranks.
	Size() int
	// AllGather writes every rank's send, in rank order, into recv:
	// len(recv) == Size()*len(send) (ncclAllGather). send may be recv's
	// own rank's segment.
	AllGather(send, recv []byte, dt DType) error
	// ReduceScatter reduces the ranks' send element-wise with op and
	// writes segment Rank() of the result into recv: len(send) ==
	// Size()*len(recv) (ncclReduceScatter). recv may be send's own rank's
	// segment.
	ReduceScatter(send, recv []byte, dt DType, op Op) error
	// AllReduce reduces the ranks' send element-wise with op into every
	// rank's recv: len(recv) == len(send) (ncclAllReduce); recv may be
	// send.
	AllReduce(send, recv []byte, dt DType, op Op) error
	// Broadcast copies root's buf into every other rank's buf
	// (ncclBroadcast in place).
	Broadcast(buf []byte, root int) error
	// Abort fails this call and every later one on every rank of the
	// communicator with err (ncclCommAbort): what a rank does when it
	// cannot go on, so that the others stop waiting for it.
	Abort(err error)
	// Close releases this end; a collective the other ranks call after it
	// fails with ErrClosed instead of waiting for this one.
	Close() error
}

// ErrClosed is a collective's error when a rank of its communicator has
// closed its end.
var ErrClosed = errors.New("comm: a rank closed the communicator")

// ErrAborted wraps the error a rank passed to Abort.
var ErrAborted = errors.New("comm: the communicator was aborted")

// MismatchError is a collective's error on every rank when the ranks
// called different collectives, or the same one with different counts,
// dtypes, reductions or roots.
type MismatchError struct {
	Call int    // the communicator's call number, from 0
	Rank int    // the first rank whose call differs from rank 0's
	Want string // rank 0's call
	Got  string // Rank's call
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("comm: collective %d: rank %d called %s where rank 0 called %s", e.Call, e.Rank, e.Got, e.Want)
}
