// Package perfmodel is dos's performance model of the update phase (the
// performance model of Deep Optimizer States, Maurya et al., 2024: the
// stride chosen from measured rates, not a hand-tuned ratio; see
// ../shared/PAPERS.md): a Profile of measured rates, fits
// of time = latency + size/rate, and a model that predicts the update
// phase's makespan for a schedule and chooses the schedule that minimises
// it.
//
// # The schedule
//
// The n subgroups of a rank (Workload) are split three ways (Schedule):
// Resident subgroups keep p, m, v on the GPU and are only updated there;
// of the others, GPU subgroups move p, m, v host to device, are updated by
// the fused kernel and move back, and CPU subgroups are updated by the SIMD
// workers in host memory. The stride k is DESIGN.md's: of every k+1
// non-resident subgroups, k go to the CPU and one to the GPU, so
// k = CPU/GPU: k = 0 is all-GPU, and all-CPU (GPU = 0) is k = +Inf. The
// counts are the model's variables; k follows from them, so neither edge
// divides by zero.
//
// # Costs per subgroup of s parameters (bytes per parameter in brackets)
//
//	GPU subgroup:      H2D  state  [StateBytes: 12 for p, m, v; 16 with amsgrad]
//	                   GPU  update s/Ug (the fused kernel reads the gradient on the GPU
//	                        and writes the 16-bit working copy in place)
//	                   D2H  state  [StateBytes]
//	resident subgroup: GPU  update s/Ug
//	CPU subgroup:      D2H  gradient [GradBytes: 2 for bf16/fp16, 4 for fp32], or, with
//	                        UpcastOnGPU, GPU conversion s/Dc then D2H [4]
//	                   CPU  update s/Uc (at the gradient dtype that arrives)
//	                   H2D  16-bit copy [CopyBytes: 2, or 0 without a working copy]
//
// Every transfer costs its Fit: latency + bytes/B (seconds, bytes, bytes/s);
// every update latency + params/U (params/s). When both PCIe directions carry
// traffic in the phase, their duplex rates (measured with both running) are
// used instead of the one-way rates. A Profile without GPU rates describes a
// CPU-only run: gradients and weights live on the host, nothing crosses
// PCIe, and the only schedule is all-CPU.
//
// # The makespan
//
// The four resources, CPU pool, H2D lane, D2H lane and GPU, work in
// parallel, each serially through its items. No resource can finish before
// its own busy time plus the fill before its first item can start and the
// drain after its last one ends, so the makespan is
//
//	T = max over r in {CPU, H2D, D2H, GPU} of  busy(r) + fill(r) + drain(r)
//
// and the bottleneck is the r that attains it.
//
// The CPU workers and the copies to and from pinned memory also share the
// host's memory bandwidth: on the H200 machine a CPU subgroup took 35 ms
// instead of 23 and a state H2D 39 ms instead of 25 while both ran. The
// profile's Contention holds the two slow-downs, fc for the CPU while both
// PCIe directions copy and fl for a lane while the CPU updates (measured
// with both running). Both run slowed down until one is done, the other
// then at its own rate: with tc the CPU's busy time alone and tl a lane's,
//
//	tc·fc <= tl·fl (the CPU is done first, at x = tc·fc):
//	    CPU x,           lane x + tl - x/fl
//	otherwise (the lane is done first, at x = tl·fl):
//	    CPU x + tc - x/fc, lane x
//
// and the CPU's busy time is the longer of its two, against H2D and D2H.
// (On the H200 machine this fitted every schedule of a k sweep within 4 %
// by hand, where a shared-bandwidth resource could not: the copies cannot
// speed up past PCIe once the CPU is done.) The makespan may then be
// non-convex in the GPU count, so Choose tries every count. With UpcastOnGPU a CPU
// subgroup's gradient is converted on the GPU before its D2H: that
// conversion adds to the fills that start with a gradient.
//
//	fill:  CPU  the first gradient's D2H;  GPU  0 with a resident subgroup,
//	       else the first state's H2D;  H2D  0 with a GPU subgroup, else the
//	       first CPU subgroup's D2H and update;  D2H  0 with a CPU subgroup,
//	       else the first GPU subgroup's H2D and update.
//	drain: CPU  the last copy's H2D;  GPU  0 with a resident subgroup last,
//	       else the last state's D2H;  H2D  0 when a copy can go last, else the
//	       last GPU subgroup's update and D2H;  D2H  0 when a GPU state can go
//	       last, else the last CPU subgroup's update and copy H2D.
//
// With Workload.Prefetch the CPU subgroups' gradient D2H (not upcast) and
// the first two streamed subgroups' state H2D happen during the backward:
// they leave the lanes' busy time (and a phase without D2H then moves its
// copies up at the one-way rate), and the fills that waited for them (the
// CPU's, the GPU's) do not; the D2H lane then starts with a streamed
// subgroup's state, and the H2D lane with a CPU subgroup's copy or the
// third streamed state, which waits for slot 0's way back.
//
// This is a lower bound, reached by a pipeline that keeps the bottleneck
// busy from its first possible moment to its last (the scheduler's job);
// the scheduler issue validates it against measured runs.
//
// # Against the paper's formulation
//
// The paper balances one GPU subgroup's round trip, 2·B⁻¹·state + s/Ug
// (with B one PCIe rate and the conversion rate Dc for the gradient), against
// k CPU subgroups, k·s/Uc, and takes k ≈ round(Uc·(2·state/B + 1/Ug)). That
// is this model's balance point when PCIe is half duplex and nothing is
// resident. Here the two directions are separate resources (the H200's
// PCIe carries ~55 GB/s each way and ~96 GB/s both ways together), the CPU
// path's own transfers (gradients down, 16-bit copies up) count against the
// lanes, fill and drain are charged, residency is a variable bounded by the
// GPU memory budget, and k may be any ratio of counts, 0 and +Inf included.
package perfmodel
