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
// # The schedule core
//
// The rules of the update phase are written once, in core.go: newCore
// turns a plan into the steps of one update phase, each with the issuer
// that enqueues it, its stream (or the CPU workers), its subgroup, staging
// slot and piece, and the steps it waits for with how it waits: on the
// host, on the device (a stream wait), both, or already ordered; the copy
// throttle is one of them. Like etcd-io/raft's RawNode it starts no
// goroutine, reads no clock and touches no device; two users drive it:
//
//  1. The engine executes it (Engine.Update, lanes.go). Each issuer walks
//     its steps in order: it waits until a step it depends on has been
//     issued by its own issuer, blocks on the host where the step says so,
//     makes the step's stream wait where it says so, enqueues it (a CPU
//     update runs it) between its events, and says it issued it.
//  2. The replay times it (Simulate): a step is ready once every step it
//     waits for has ended, and each resource serves its ready steps first
//     come first served, at the profile's rates.
//
// testdata/core.txt and testdata/replay.txt print the steps and the replay
// of small plans (TestGolden; -rewrite regenerates them).
// TestEngineAgreesWithReplay checks, through the simulated device's log,
// that the engine issues exactly these steps, each after what it depends
// on, waiting as the core says, and that the replay orders them the same
// way.
//
// # The engine
//
// Engine.Update runs the plan with every resource busy at once, on four
// issuers:
//
//	the GPU lane:  this goroutine   state H2D pieces (after the slot's
//	                                previous state left), the kernels
//	               drain goroutine  state D2H pieces (after the kernel)
//	the CPU lane:  feed goroutine   the upcast and gradient D2H into two
//	                                pinned host slots
//	               work goroutine   the SIMD workers, then the copy's H2D
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
// device (NewSim).
//
// # The simulated device
//
// NewSim executes each operation at once on the CPU, which would hide a
// missing wait; so it checks ordering instead (simorder.go): per buffer
// range it keeps the last writer and the readers since, per stream a
// vector clock of what is known complete (stream order, Wait, and what the
// host's Syncs saw), and fails with ErrOrder an operation that reads data
// before their writer is known complete or overwrites data still in use.
// It also keeps a virtual clock per stream and lane for Elapsed (1 µs an
// operation, or a profile's fits): a test device's timeline, not a
// planning tool.
//
// # Planning
//
// Simulate replays the core's steps in virtual time from a Profile, with
// no memory or math (the lanes, the slots, the pieces, the host waits, and
// contention between the CPU workers and the copies as a fluid model), for
// sizes and machines one does not have (dos plan).
// TestSimulateAgainstModel holds it within 5 % of the performance model,
// and BENCHMARKS.md compares both with the measured engine.
//
// # Traces
//
// Engine.Trace returns every operation of the last Update (resource,
// subgroup, start, end, bytes) from its events; Summarize gives the busy
// fraction of each resource and the overlap, WriteChrome the Chrome
// trace-event JSON that Perfetto opens. dos bench draws it as a timeline.
package scheduler
