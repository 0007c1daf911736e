// Package nccl is the part of NCCL that a ZeRO-3 trainer needs (issue 19):
// communicators over the GPUs of one process (ncclCommInitAll) and the
// collectives all-gather, reduce-scatter, all-reduce and broadcast on
// device memory, enqueued on a CUDA stream. It reaches libnccl.so.2 at run
// time through github.com/ebitengine/purego, as internal/cuda reaches
// libcuda: no cgo, and the same binary runs without NCCL or a GPU
// (Available says why not).
//
// A Comm has the semantics of internal/comm's Comm (the in-process
// implementation over host memory that the CPU tests run), on device
// memory: the same element counts, the same rank order, Avg as NCCL's
// ncclAvg. Collectives are asynchronous: a call returns once the work is
// enqueued on the stream, and the result is there when the stream reaches
// it. Every rank must call the same collectives in the same order with the
// same counts; NCCL hangs otherwise, so the sizes are checked here first
// and a call that would be wrong on this rank is refused before NCCL sees
// it. In one process each rank's calls come from its own goroutine (one
// device per thread, NCCL's supported mode), or from one goroutine between
// GroupStart and GroupEnd.
//
// Errors are *Error: the function, NCCL's ncclResult_t by name, and
// NCCL's own description (ncclGetErrorString, and ncclGetLastError where
// the library has it).
package nccl
