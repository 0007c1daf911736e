// Package trainer is dos's Megatron-style example trainer and main job: a
// GPT-2-architecture language model written out in Go (forward and backward
// by hand, as llm.c does in C; matrix products through gonum's BLAS),
// trained (by default byte by byte on Newton's Opticks; GPT-2's sizes and
// BPE with package gpt's presets) with the offloaded AdamW of package
// offload, exactly as a user's trainer embeds it: the optimizer owns
// the parameters, the model reads the working copy and writes gradients into
// the optimizer's buffers, and checkpoints carry the trainer's own objects
// (iteration, loader position, RNG state, loss scale, configuration).
//
// # On the GPU
//
// With TrainConfig.Device "cuda" the same model runs on GPU 0 through
// internal/gptcuda (bf16 with fp32 accumulation and residual stream, flash
// attention, cuBLASLt products, every kernel deterministic): forward reads
// the optimizer's device working copy (offload.Optimizer.DeviceWorking) and
// backward writes the device gradients (DeviceGrad), so offload's Step
// (StepArgs.GradOnDevice) checks, clips and updates them where they are,
// with the optimizer state in pinned host memory and the update phase
// interleaved between the CPU and the GPU in the performance model's
// schedule (a short calibration at start without TrainConfig.Profile). The
// host model stays the float64 reference the GPU model is tested against.
// With TrainConfig.StreamBlocks (dos train --stream-blocks N|auto) the
// first blocks' matrices and biases live in pinned host memory instead
// (offload.Options.OffloadParam) and stream to two block slots on the GPU
// before each block's forward and backward, their gradients back as the
// block's backward ends (stream.go): a model larger than the GPU trains.
//
// # One loop over replicas
//
// Run, Evaluate and Sample step a world of ranks (world.go): one, or
// ZeRO-3's N. Each rank is a replica of the model, where its forward and
// backward run, and the offload.Optimizer that owns its parameters; the
// replica constructors (newWorld) are the one place that asks where. A
// host replica (host.go) runs the Go model, its weights read from its
// optimizer or all-gathered from the ranks' pieces; a GPU replica
// (gpu.go) runs gptcuda, each block's weights from its source: resident in
// device memory or streamed from host memory (localSource), or
// all-gathered from its peers (gatherSource, zerogpu.go). One saver
// (checkpointing.go) writes the checkpoints of one rank or of a job.
//
// # Ranks
//
// With TrainConfig.GPUs N > 1 (dos train --gpus N) the run is ZeRO-3 data
// parallelism over N ranks in this process: rank r holds piece r of every
// tensor and that piece's optimizer state in an offload.Optimizer of its
// own, all-gathers the working copy before forward, trains on Batch/N rows
// of the global batch, reduce-scatters the averaged gradients into its
// piece and steps with the whole model's gradient norm
// (offload.StepArgs.Reduce): on the host or Device "sim" over
// internal/comm's in-process communicator (zero.go, host.go), with Device "cuda"
// rank r on GPU r over NCCL, each block's matrices gathered just before
// the block runs (zerogpu.go). Checkpoints of a job:
// each rank saves into CkptDir/rank-%05d and the job commits the step in
// CkptDir's latest once every rank's save is durable
// (checkpoint.CommitJob); a resume needs the same ranks.
//
// Parameters are named and laid out as Hugging Face's GPT-2 (wte.weight,
// h.0.attn.c_attn.weight as [in, out], ...; package gpt describes them for
// every trainer), so ExportHF writes a model that
// transformers.GPT2LMHeadModel loads.
//
// # Data
//
// A run reads one of two kinds of data, each with its batch order:
//
//   - a text (New; dos train --text, or the embedded Opticks), tokenized by
//     TrainConfig.Tokenizer: "byte" (one token per byte) or "gpt2" (GPT-2's
//     BPE; see Tokenizer). The last ValFraction of its tokens validates
//     (NewDataset), and Loader reads the rest: batch i reads from position
//     p_i, rows of T tokens one after the other, p_0 = 0, p_{i+1} = p_i + B*T,
//     and p goes back to 0 when the batch there and its last target would
//     not fit. With at least B*T+1 tokens that is llm.c's order below; a
//     shorter text repeats its rows to fill a batch.
//   - pre-tokenized data (NewTokens; dos train --data), uint16 tokens in
//     llm.c's or nanoGPT's file layout (ReadTokens, WriteTokens), read in
//     llm.c's DataLoader order exactly (TokenBatches): batch i (i = 0, 1,
//     ...) takes the B*T+1 tokens from position p_i, input row b being
//     tokens[p_i + b*T : p_i + b*T + T] and its targets the same shifted by
//     one; p_0 = 0, p_{i+1} = p_i + B*T, and when p_{i+1} + B*T + 1 exceeds
//     the number of tokens, p_{i+1} = 0. Validation reads separate tokens,
//     or the data's last ValFraction, which training then leaves out.
//
// The checkpoint records the position of the next batch, so a resumed run
// reads the batches a straight one would.
//
// References:
//   - Radford et al. Language Models are Unsupervised Multitask Learners (GPT-2), 2019.
//   - Hugging Face transformers, models/gpt2/modeling_gpt2.py.
//   - Karpathy, llm.c: train_gpt2.c (forward and backward passes), train_gpt2.cu (the GPU's).
//   - Dao, FlashAttention-2, 2023 (the GPU model's attention).
//   - Shoeybi et al. Megatron-LM (learning-rate schedule flags), 2019.
package trainer
