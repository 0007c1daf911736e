#!/usr/bin/env python3
"""PyTorch eager's GPT-2 training speed on one GPU: the reference of dos's GPU trainer
(issue 16, "Speed"; bench/gpt2_speed.sh runs both).

    python3 bench/torch_gpt2.py --model gpt2|gpt2-medium|gpt2-large|gpt2-xl --batch B \\
        [--seq 1024] [--steps 20] [--warmup 5] [--seed 1337]

transformers' GPT2LMHeadModel built from its config (n_layer/n_embd/n_head 12/768/12,
24/1024/16, 36/1280/20, 48/1600/25; n_positions 1024; vocabulary 50304; tied embeddings;
no dropout, as dos), random init, fp32 parameters on the GPU, sdpa attention, bf16
autocast, the mean cross-entropy over all B*T positions from the logits in fp32,
clip_grad_norm_(1.0), torch.optim.AdamW(fused=True), synthetic random tokens from a fixed
seed. Each iteration (forward, backward, clip, step, zero_grad) is timed with CUDA events;
the figures are the median of the iterations after --warmup.

MFU is against the H200's bf16 dense peak, 989e12 FLOP/s, with llm.c's count of FLOPs per
token, 6N + 6*L*C*T (N = sum(p.numel() for p in model.parameters()), the tied wte once).

Prints one line per figure, then last one machine-readable line:
  torch_gpt2 {"model": ..., "batch": ..., "seq": ..., "params": ..., "tokens_per_s": ...,
              "ms_per_iter": ..., "mfu": ..., "peak_mem_gib": ...}
(with "error": "..." and exit status 1 when the run fails, e.g. out of memory).
"""
import argparse
import json
import math
import statistics
import sys

PEAK_FLOPS = 989e12  # H200 / H100 SXM bf16 dense
VOCAB = 50304  # 50257 padded to a multiple of 128
MODELS = {  # n_layer, n_embd, n_head
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}


def flops_per_token(n_params, n_layer, n_embd, seq):
    """llm.c's count: 6N for the matmuls with the weights, 6*L*C*T for attention."""
    return 6 * n_params + 6 * n_layer * n_embd * seq


def make_model(config):
    """GPT2LMHeadModel from config with sdpa attention, across transformers versions."""
    from transformers import GPT2LMHeadModel

    try:
        config._attn_implementation = "sdpa"  # what _from_config and the model's __init__ read
    except AttributeError:
        pass
    try:
        return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    except TypeError:  # a transformers whose _from_config does not take it
        return GPT2LMHeadModel(config)


def train_step(model, opt, params, d, vocab):
    """One iteration on a batch d of B x (T+1) tokens: bf16 autocast forward, the mean cross-entropy from fp32
    logits, backward, clip_grad_norm_(1.0), opt.step(), zero_grad(set_to_none=True). Returns the loss tensor."""
    import torch
    import torch.nn.functional as F

    x, y = d[:, :-1].contiguous(), d[:, 1:].contiguous()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=x, use_cache=False).logits
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    ap.add_argument("--batch", type=int, default=16, help="B, sequences per iteration")
    ap.add_argument("--seq", type=int, default=1024, help="T, tokens per sequence (at most 1024)")
    ap.add_argument("--steps", type=int, default=20, help="timed iterations after the warm-up")
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of the figures")
    ap.add_argument("--seed", type=int, default=1337)
    a = ap.parse_args()
    if not (1 <= a.seq <= 1024 and a.batch >= 1 and a.steps >= 1 and a.warmup >= 0):
        ap.error("want 1 <= --seq <= 1024, --batch >= 1, --steps >= 1, --warmup >= 0")

    L, C, H = MODELS[a.model]
    B, T = a.batch, a.seq
    result = {"model": a.model, "batch": B, "seq": T}

    def finish(rc):
        print("torch_gpt2 " + json.dumps(result), flush=True)
        sys.exit(rc)

    try:
        import torch
        import transformers
        from transformers import GPT2Config
    except ImportError as e:
        result["error"] = f"needs torch and transformers: {e}"
        print(f"torch_gpt2: {result['error']}", file=sys.stderr)
        finish(1)

    if not torch.cuda.is_available():
        result["error"] = "no CUDA device"
        print("torch_gpt2: no CUDA device", file=sys.stderr)
        finish(1)
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name(dev)}")
    torch.manual_seed(a.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=C, n_layer=L, n_head=H,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=True)
    try:
        with torch.device(dev):  # initialise on the GPU: the 1.5B model's init takes long on the CPU
            model = make_model(config)
        model = model.to(device=dev, dtype=torch.float32)
        model.train()
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        fpt = flops_per_token(n, L, C, T)
        result["params"] = n
        attn = getattr(model.config, "_attn_implementation", "?")
        print(f"model {a.model}: {L} layers, width {C}, {H} heads, vocab {VOCAB}, {n} params ({n / 1e6:.1f}M), attention {attn}")
        print(f"batch {B} x {T} = {B * T} tokens/iter, {fpt / 1e9:.3f} GFLOP/token (6N + 6LCT)")
        opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        g = torch.Generator(device=dev)
        g.manual_seed(a.seed)
        data = [torch.randint(0, 50257, (B, T + 1), generator=g, device=dev) for _ in range(4)]

        def step(i):
            return train_step(model, opt, params, data[i % len(data)], VOCAB)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        times, losses = [], []
        for i in range(a.warmup + a.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(i)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
            losses.append(loss.item())
            if i >= a.warmup:
                times.append(ms)
            if i < a.warmup or i == a.warmup + a.steps - 1 or (i - a.warmup) % 10 == 0:
                print(f"iter {i + 1:3d}{' (warm-up)' if i < a.warmup else ''}: {ms:8.2f} ms  loss {losses[-1]:.4f}", flush=True)
        peak = torch.cuda.max_memory_allocated(dev) / 2**30
    except torch.cuda.OutOfMemoryError as e:
        result["error"] = "out of memory"
        print(f"torch_gpt2: out of memory: {str(e).splitlines()[0]}", file=sys.stderr)
        finish(1)
    except Exception as e:  # one machine-readable line whatever happens
        result["error"] = f"{type(e).__name__}: {e}"
        print(f"torch_gpt2: {type(e).__name__}: {e}", file=sys.stderr)
        finish(1)

    ms = statistics.median(times)
    tps = B * T / (ms / 1e3)
    mfu = fpt * tps / PEAK_FLOPS
    result.update(tokens_per_s=round(tps, 1), ms_per_iter=round(ms, 3), mfu=round(mfu, 4),
                  peak_mem_gib=round(peak, 3), attention=attn, torch=torch.__version__)
    print(f"ms/iter: {ms:.2f} (median of {len(times)} after {a.warmup} warm-up; min {min(times):.2f}, max {max(times):.2f})")
    print(f"tokens/s: {tps:.0f}")
    print(f"MFU: {100 * mfu:.1f}% of {PEAK_FLOPS / 1e12:.0f} TFLOP/s")
    print(f"peak memory: {peak:.2f} GiB (torch.cuda.max_memory_allocated)")
    if not all(math.isfinite(l) for l in losses):
        result["error"] = "non-finite loss"
        print("torch_gpt2: a loss was not finite", file=sys.stderr)
        finish(1)
    finish(0)


if __name__ == "__main__":
    main()
