#!/usr/bin/env python3
"""What a PyTorch user picks when the optimizer state does not fit, against dos.torch.AdamW (issue 18's offload
comparison; one mode per process: bench/e2e_offload.sh runs them beside dos train in one call).

    PYTHONPATH=python python3 bench/torch_offload.py --mode dos|fsdp2|gpu --model gpt2-xl --batch 8
        [--seq 1024] [--steps 10] [--warmup 3] [--gpu-budget-gib 8] [--schedule auto] [--cap-gib 0]
        [--checkpointing] [--split-step] [--threads N]

transformers' GPT2LMHeadModel (bench/torch_gpt2.py's model, random init), bf16 autocast, the mean cross-entropy
from fp32 logits, clip_grad_norm_(1.0), AdamW lr 6e-4, betas (0.9, 0.95), weight_decay 0.1, random tokens:
  gpu    fp32 parameters on the GPU, torch.optim.AdamW(fused=True) there: the ceiling, when it fits;
  fsdp2  FSDP2 on one NCCL rank, fully_shard with CPUOffloadPolicy(pin_memory=True) and bf16 parameters
         (MixedPrecisionPolicy), torch.optim.AdamW(fused=True) on the CPU shards: what a PyTorch user picks
         today (ANCHORS.md: 0.74-0.80 s per iteration at 1.5B, B 8);
  dos    bfloat16 parameters on the GPU, dos.torch.AdamW(device="cuda", gpu_budget, schedule): fp32 master
         weights and the moments in dos's pinned host memory, the update phase interleaved;
  torchao  fp32 parameters on the GPU, torchao's CPUOffloadOptimizer(torch.optim.AdamW, offload_gradients=True,
         fused=True): each gradient moves to pinned host memory in a post-accumulate-grad hook during the
         backward (its device copy freed), the step runs PyTorch's fused CPU AdamW per parameter as the
         gradients arrived and copies each parameter back: the strongest single-GPU offload in PyTorch
         (ANCHORS.md). It cannot clip (the device gradients are gone): --no-clip is implied. torchao is not
         installed on the GPU machine and not part of this repository: TORCHAO_CPU_OFFLOAD names a copy of
         its one file, torchao/optim/cpu_offload.py of pytorch/ao, fetched for the run into an ignored folder
         (bench/e2e_offload.sh uses .torchao/cpu_offload.py when it is there); its one import,
         torchao.utils.get_available_devices, is provided here.
--model is a GPT-2 preset or LAYERS:EMBD:HEADS (dos train's --layers, --embd, --heads).
--cap-gib caps the process's device memory, for a smaller card's: PyTorch's allocator through
torch.cuda.set_per_process_memory_fraction, less (in dos mode) the device memory dos.torch.AdamW took.
--checkpointing turns on activation checkpointing (what a cap below the activations needs).
Each iteration is timed with CUDA events (forward and backward, then clip and step), the median after
--warmup. The last line is machine-readable:
  torch_offload {"mode": ..., "ms_per_iter": ..., "fwd_bwd_ms": ..., "step_ms": ..., "tokens_per_s": ..., ...}
(with "error" and exit status 1 when the run fails, e.g. out of memory).
"""
import argparse
import json
import os
import statistics
import time
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt2 import MODELS, VOCAB, flops_per_token, make_model  # noqa: E402



def torchao_optimizer():
    """torchao's CPUOffloadOptimizer class from the file TORCHAO_CPU_OFFLOAD names (see --mode torchao), with the
    torchao.utils it imports provided when torchao is not installed."""
    import importlib.util
    import types

    path = os.environ.get("TORCHAO_CPU_OFFLOAD", "")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--mode torchao: TORCHAO_CPU_OFFLOAD={path!r} is not a file: set it to a copy of "
                                "torchao/optim/cpu_offload.py (pytorch/ao), which this repository does not hold")
    try:
        import torchao.utils  # noqa: F401
    except ImportError:
        utils = types.ModuleType("torchao.utils")
        utils.TORCH_VERSION_AT_LEAST_2_4 = True  # what older copies import too
        utils.get_available_devices = lambda: ["cpu", "cuda"]
        pkg = types.ModuleType("torchao")
        pkg.utils = utils
        sys.modules["torchao"], sys.modules["torchao.utils"] = pkg, utils
    spec = importlib.util.spec_from_file_location("torchao_cpu_offload", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CPUOffloadOptimizer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["dos", "fsdp2", "gpu", "torchao"], required=True)
    ap.add_argument("--model", default="gpt2-xl", help=f"{', '.join(sorted(MODELS))} or LAYERS:EMBD:HEADS")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gpu-budget-gib", type=float, default=8.0, help="dos: device memory for its update phase")
    ap.add_argument("--schedule", default="auto", help="dos: auto, cpu, static or C,G,R")
    ap.add_argument("--sub-group-size", type=int, default=100_000_000)
    ap.add_argument("--cap-gib", type=float, default=0,
                    help="cap the process's device memory (0: none); dos's own device memory counts against it")
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing (transformers' gradient_checkpointing_enable, non-reentrant)")
    ap.add_argument("--split-step", action="store_true",
                    help="wait for backward on the device, then time clip_grad_norm_ and the optimizer step apart on "
                         "the host (clip_ms, opt_step_ms; the wait perturbs the iteration a little)")
    ap.add_argument("--no-clip", action="store_true",
                    help="no clip_grad_norm_ (FSDP2's offload then steps without the global norm's pass over the "
                         "gradients)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch.set_num_threads: the CPU threads of FSDP2's CPU AdamW (default: every core)")
    ap.add_argument("--seed", type=int, default=1337)
    a = ap.parse_args()
    result = {"mode": a.mode, "model": a.model, "batch": a.batch, "seq": a.seq}

    def finish(rc):
        print("torch_offload " + json.dumps(result), flush=True)
        sys.exit(rc)

    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config

    torch.set_num_threads(a.threads)
    result["threads"] = torch.get_num_threads()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    total = torch.cuda.get_device_properties(dev).total_memory

    def cap(outside=0):
        """Cap PyTorch's allocator at --cap-gib less the device memory dos holds outside it (bytes)."""
        if a.cap_gib > 0:
            torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, (a.cap_gib * 2**30 - outside) / total)), dev)

    cap()
    try:
        L, C, H = MODELS[a.model] if a.model in MODELS else (int(v) for v in a.model.split(":"))
    except ValueError:
        ap.error(f"--model {a.model!r}: want one of {sorted(MODELS)} or LAYERS:EMBD:HEADS such as 36:3072:24")
    B, T = a.batch, a.seq
    torch.manual_seed(a.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=C, n_layer=L, n_head=H, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=True)
    kw = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    try:
        if a.mode == "fsdp2":
            import torch.distributed as dist
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29513")
            dist.init_process_group("nccl", rank=0, world_size=1)
            model = make_model(config)  # on the CPU: the offload policy keeps the fp32 shards there
            if a.checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.transformer.h:
                fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=True), mp_policy=mp)
            fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=True), mp_policy=mp)
            opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
        else:
            with torch.device(dev):
                model = make_model(config)
            if a.checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if a.mode == "gpu":
                model = model.to(dev, torch.float32)
                opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
            elif a.mode == "torchao":
                model = model.to(dev, torch.float32)
                opt = torchao_optimizer()(model.parameters(), torch.optim.AdamW, offload_gradients=True, fused=True, **kw)
                a.no_clip = True  # its hooks free the device gradients: nothing left to clip
            else:
                import dos.torch as dt

                model = model.to(dev, torch.bfloat16)
                torch.cuda.synchronize(dev)
                free0 = torch.cuda.mem_get_info(dev)[0]
                opt = dt.AdamW(model.parameters(), device="cuda", gpu_budget=int(a.gpu_budget_gib * 2**30),
                               schedule=a.schedule, sub_group_size=a.sub_group_size, **kw)
                result["placement"] = opt.placement()
                result["dos_device_gib"] = round((free0 - torch.cuda.mem_get_info(dev)[0]) / 2**30, 2)
                cap(free0 - torch.cuda.mem_get_info(dev)[0])  # dos's device memory counts against the cap
                print(f"dos placement: {result['placement']}", flush=True)
        model.train()
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        result["params"] = n
        print(f"{a.mode}: {a.model} {n / 1e6:.1f}M parameters, B {B} x T {T}", flush=True)
        g = torch.Generator(device=dev).manual_seed(a.seed)
        data = [torch.randint(0, 50257, (B, T + 1), generator=g, device=dev) for _ in range(4)]
        fb, st, it, clip, opt_ms = [], [], [], [], []
        for i in range(a.warmup + a.steps):
            d = data[i % len(data)]
            x, y = d[:, :-1].contiguous(), d[:, 1:].contiguous()
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            e1.record()
            if a.split_step:  # the device done with backward first, then the host's clip and step timed apart
                e1.synchronize()
                h0 = time.perf_counter()
            if not a.no_clip:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            if a.split_step:
                torch.cuda.synchronize(dev)
                h1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            e2.record()
            e2.synchronize()
            if i >= a.warmup:
                fb.append(e0.elapsed_time(e1))
                st.append(e1.elapsed_time(e2))
                it.append(e0.elapsed_time(e2))
                if a.split_step:
                    clip.append(1e3 * (h1 - h0))
                    opt_ms.append(1e3 * (time.perf_counter() - h1))
            print(f"iter {i + 1}: {e0.elapsed_time(e2):.1f} ms (forward+backward {e0.elapsed_time(e1):.1f}, "
                  f"step {e1.elapsed_time(e2):.1f}), loss {loss.item():.4f}", flush=True)
        ms = statistics.median(it)
        tps = B * T / (ms / 1e3)
        result.update(ms_per_iter=round(ms, 2), fwd_bwd_ms=round(statistics.median(fb), 2),
                      step_ms=round(statistics.median(st), 2), tokens_per_s=round(tps, 1),
                      tflops=round(flops_per_token(n, L, C, T) * tps / 1e12, 1),
                      peak_mem_gib=round(torch.cuda.max_memory_allocated(dev) / 2**30, 2),
                      checkpointing=a.checkpointing, cap_gib=a.cap_gib, clip=not a.no_clip)
        if clip:
            result.update(clip_ms=round(statistics.median(clip), 2), opt_step_ms=round(statistics.median(opt_ms), 2))
    except torch.cuda.OutOfMemoryError as e:
        result["error"] = "out of memory: " + str(e).splitlines()[0]
        finish(1)
    except Exception as e:  # one machine-readable line whatever happens
        result["error"] = f"{type(e).__name__}: {e}"
        finish(1)
    finish(0)


if __name__ == "__main__":
    main()
