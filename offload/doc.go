// Package offload is the optimizer that trainers use: AdamW over named
// parameters whose fp32 master weights and optimizer state (exp_avg,
// exp_avg_sq, max_exp_avg_sq) live in host memory, cut into ZeRO-3
// subgroups.
//
// # The trainer's loop
//
// A trainer builds an Optimizer once from its parameters (name and shape, in
// order) and Options, sets the initial values with SetParam, and then, every
// iteration:
//
//  1. reads the working parameters through Working (the 16-bit copy, or the
//     fp32 master weights when Options.WorkingDType is none) for forward and
//     backward;
//  2. writes the gradients into the buffers Grad returns (the optimizer owns
//     them, so it can place them where the update runs);
//  3. calls Step, which, in this order: checks every gradient of every
//     subgroup for Inf and NaN and skips the whole step if it finds one
//     (nothing changes, the step counter does not advance); computes the
//     global gradient norm and the clip coefficient when
//     Options.MaxGradNorm > 0 (torch.nn.utils.clip_grad_norm_); advances the
//     one step counter; and updates every subgroup with the same bias
//     corrections;
//  4. every N steps, saves a checkpoint with SaveCheckpoint.
//
// Without Options.Device every subgroup is updated on the CPU by adam's
// worker pool, gradients and working copy in host memory. With it, the
// update phase runs through scheduler.Engine, interleaved between the CPU
// workers and the device (Deep Optimizer States, Maurya et al., Middleware
// 2024, §4), behind the same API.
//
// # A trainer on the GPU
//
// A trainer whose forward and backward run on Options.Device (a CUDA
// device) reads and writes the engine's device buffers themselves, with no
// copy through the host: DeviceWorking(i) is parameter i's 16-bit working
// copy (Options.WorkingDType) and DeviceGrad(i) its gradient
// (Options.GradDType), DeviceTensor.Ptr their device addresses. The loop
// becomes:
//
//  1. once, after SetParam (or LoadCheckpoint), SyncDevice: the master
//     weights reach the device working copy;
//  2. forward and backward on the trainer's stream, reading DeviceWorking
//     and writing every DeviceGrad; then synchronize that stream;
//  3. Step with StepArgs.GradOnDevice: the checks and clipping run on the
//     device gradients as always, the update leaves the new working copy
//     on the device, and every write of it is complete when Step returns,
//     so the next forward, on any stream, reads it.
//
// The host buffers are then secondary: Working fetches the working copy
// from the device when a Step with GradOnDevice left it behind (SyncHost
// does it and reports errors); Master, Snapshot and the checkpoints read
// the master state as always. The views hold until Close, or until a
// LoadCheckpoint that replaces the engine after a device fault
// (DeviceTensor.Valid). Options.GPUBudget bounds the update phase's own
// device memory; Options.DeviceBytes is what the gradients and the working
// copy take besides, and Options.DeviceMasters' fp32 copies (DeviceMaster)
// take 4 bytes a parameter more. On the simulated device ("sim") the same path runs
// on the CPU, its memory reached through scheduler.Sim.HostView.
//
// # Subgroups
//
// The parameters are laid end to end in one flat space of P elements, in the
// order given to New, group after group (Options.Groups: parameter group 0's
// first). Each group's span is cut into subgroups of S = Options.SubgroupSize
// elements, the last one shorter, as DeepSpeed ZeRO-3 cuts its flat
// partition into sub_group_size pieces (perfmodel.SubgroupSizes); a
// parameter may span two or more subgroups, a subgroup never two groups, so
// that each subgroup is updated with one group's lr and weight_decay. With
// Options.OffloadParam each run of parameters that are all, or all not,
// held on the host is cut apart too (CutSubgroups), so that a subgroup is
// host-held (Subgroup.HostHeld: its gradient and working copy in pinned
// host memory, HostGrad and HostWorking, updated by the CPU workers in
// place before the others) or not.
//
// # Parameter groups
//
// As torch.optim's param_groups, Options.Groups gives groups of parameters
// their own lr and weight_decay (Param.Group picks one); the other
// hyperparameters, the step counter, the non-finite check and the global
// gradient norm are shared: clipping scales every group by the one
// clip_grad_norm_ factor over all parameters. SetLR sets every group's
// rate, SetGroupLR one's; checkpoints save and restore both.
//
// # Overlap with backward
//
// With Options.OverlapBackward a GPU trainer tells the optimizer, block by
// block during its backward, which gradients are final (GradsFinal): the
// last blocks' first. Once a suffix of the flat space is final, what the
// update phase does there without any global value starts at once, on the
// engine's copy streams after the trainer's work so far
// (scheduler.Engine.Prefetch): each CPU subgroup's gradient D2H, into
// pinned host memory of its own, and the first two streamed subgroups'
// state H2D (state does not depend on the gradients). Nothing else can
// move: the non-finite check and the global norm need every gradient, so
// no update (CPU, streamed or resident) may start before the last block's
// backward; the check itself runs once, on the device, over every
// gradient at once, as without the overlap (a sum in another order would
// change the clip coefficient's last bit); the upcast of CPU subgroups'
// 16-bit gradients on the GPU has scratch for two subgroups only; and a
// streamed subgroup after the first two needs a staging slot that an
// earlier subgroup's update frees. The update reads the same gradients and
// computes the same bits with or without the overlap; a skipped step, and
// any change of the gradients or the host state before the Step (ZeroGrad,
// SetParam, WriteState, LoadCheckpoint), drop what was started.
package offload
