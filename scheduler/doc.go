// Package scheduler runs the update phase of one rank interleaved between
// the CPU workers and a GPU (Deep Optimizer States, Maurya et al.,
// Middleware 2024, sections 3-4; DESIGN.md, "Update phase").
//
// # The plan
//
// NewPlan places each subgroup (perfmodel.Schedule's counts, usually
// perfmodel.Profile.Choose's): OnCPU subgroups move their gradient D2H,
// the SIMD workers update p, m, v in pinned host memory and the new 16-bit
// copy moves H2D; OnGPU subgroups move p, m, v H2D into one of two device
// staging slots, the fused kernel updates them and writes the copy in
// device memory, and they move back D2H; Resident subgroups keep p, m, v
// on the device. The streamed GPU subgroups are spread evenly among the CPU
// ones (the stride k = CPU/GPU, DESIGN.md's definition).
//
// # The engine
//
// Engine.Update runs the plan with every resource busy at once:
//
//	the CPU lane:  feeder goroutine  gradient D2H into two pinned host slots
//	               worker goroutine  the SIMD workers, then the copy's H2D
//	the GPU lane:  this goroutine    state H2D (after the slot's previous
//	                                 state left), then the kernel
//	               drainer goroutine state D2H (after the kernel)
//
// Four streams (the H2D copies, the kernels, the D2H copies, the upcasts)
// and events order the work; the host waits only on events, never on the
// whole device. Every copy of one direction goes on one stream, enqueued
// only when it can run and state copies in 64 MiB pieces at most two deep:
// on the H200 the copy engines otherwise served a stream that always had
// work queued before another, and a CPU subgroup's copy waited 160 ms
// behind GPU subgroups' state (BENCHMARKS.md).
//
// The global checks (Engine.Stats: non-finite gradients, the sum of squares
// for clipping) run over every subgroup on the device before the update,
// so one decision and one step counter hold for both devices; the caller
// (offload.Optimizer) turns them into adam.Coeffs.
//
// # Faults
//
// A copy or launch that cannot be enqueued stops the lanes; Update drains
// what was enqueued and completes every subgroup from where it stood, one
// at a time, and returns a *FaultError: the state is fully advanced. A
// fault inside the device (reported when waiting) or during the completion
// leaves the state unknown: Update returns ErrBroken, and so does every
// later call. Tests fail the i-th operation for every i on the simulated
// device (NewSim), which executes each operation at once on the CPU and
// keeps a virtual clock per stream and lane.
//
// # Planning
//
// Simulate replays the engine's schedule in virtual time from a Profile,
// with no memory or math, operation by operation (the lanes, the slots,
// the pieces, the host waits, and contention between the CPU workers and
// the copies as a fluid model): the simulated device's timing half, which
// dos plan runs for sizes and machines one does not have. It codes the
// engine's policy a second time; TestSimulateAgainstModel holds it within
// 5 % of the performance model, and BENCHMARKS.md compares both with the
// measured engine.
//
// # Traces
//
// Engine.Trace returns every operation of the last Update (resource,
// subgroup, start, end, bytes) from its events; Summarize gives the busy
// fraction of each resource and the overlap, WriteChrome the Chrome
// trace-event JSON that Perfetto opens. dos bench draws it as a timeline.
package scheduler
