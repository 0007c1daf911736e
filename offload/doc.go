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
// # Subgroups
//
// The parameters are laid end to end in one flat space of P elements, in the
// order given to New. Subgroup i covers elements [i*S, min((i+1)*S, P)) for
// S = Options.SubgroupSize, as DeepSpeed ZeRO-3 cuts its flat partition into
// sub_group_size pieces; a parameter may span two or more subgroups.
package offload
