// Package trainer is dos's Megatron-style example trainer and main job: a
// GPT-2-architecture language model written out in Go (forward and backward
// by hand, as llm.c does in C; matrix products through gonum's BLAS),
// trained byte by byte on Newton's Opticks with the offloaded AdamW of
// package offload, exactly as a user's trainer embeds it: the optimizer owns
// the parameters, the model reads the working copy and writes gradients into
// the optimizer's buffers, and checkpoints carry the trainer's own objects
// (iteration, loader position, RNG state, loss scale, configuration).
//
// Parameters are named and laid out as Hugging Face's GPT-2 (wte.weight,
// h.0.attn.c_attn.weight as [in, out], ...), so ExportHF writes a model that
// transformers.GPT2LMHeadModel loads.
//
// References:
//   - Radford et al. Language Models are Unsupervised Multitask Learners (GPT-2), 2019.
//   - Hugging Face transformers, models/gpt2/modeling_gpt2.py.
//   - Karpathy, llm.c: train_gpt2.c (forward and backward passes).
//   - Shoeybi et al. Megatron-LM (learning-rate schedule flags), 2019.
package trainer
