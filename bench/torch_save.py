#!/usr/bin/env python3
"""A checkpoint taken during training: dos.torch.AdamW.save against torch.distributed.checkpoint.async_save of the
same state (issue 18's save comparison; one mode per process).

    PYTHONPATH=python python3 bench/torch_save.py --mode dos|dcp --dir DIR [--model gpt2-xl] [--batch 4]
        [--steps 12] [--save-at 4] [--gpu-budget-gib 8] [--ring-gib 0]

transformers' GPT2LMHeadModel (bench/torch_gpt2.py's, random init), bf16 autocast, random tokens, on cuda:0:
  dcp  fp32 parameters, torch.optim.AdamW(fused=True) on the GPU; at iteration --save-at,
       torch.distributed.checkpoint.async_save({"model": ..., "optim": ...}) into DIR (one gloo rank; DCP's
       FileSystemWriter, which fsyncs its files), the future polled between iterations;
  dos  bfloat16 parameters, dos.torch.AdamW(device="cuda", gpu_budget) (fp32 master weights and moments in
       pinned host memory); at --save-at, opt.save(DIR), the SaveHandle polled between iterations.
Both checkpoints hold what a resume needs: fp32 master weights and both moments (12 bytes per parameter; DCP's
also the step counts). Reported: the time the save call blocks the loop, the extra time of the iterations that
ran while the checkpoint was written (against the median iteration before), the time until durable, the bytes
on disk, and the flush rate (bytes over time until durable). The last line is machine-readable:
  torch_save {"mode": ..., "blocked_s": ..., "stall_s": ..., "durable_s": ..., "bytes": ..., "gb_per_s": ...}
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt2 import MODELS, VOCAB, make_model  # noqa: E402


def du(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["dos", "dcp"], required=True)
    ap.add_argument("--dir", required=True, help="checkpoint directory (created; must be empty or absent)")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2-xl")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-at", type=int, default=4)
    ap.add_argument("--gpu-budget-gib", type=float, default=8.0)
    ap.add_argument("--ring-gib", type=float, default=0, help="dos: save's ring_bytes in GiB (0: the default, 256 MiB)")
    ap.add_argument("--seed", type=int, default=1337)
    a = ap.parse_args()
    result = {"mode": a.mode, "model": a.model, "batch": a.batch}
    if os.path.exists(a.dir) and os.listdir(a.dir):
        ap.error(f"--dir {a.dir}: not empty")

    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    L, C, H = MODELS[a.model]
    torch.manual_seed(a.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=C, n_layer=L, n_head=H, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=True)
    kw = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    with torch.device(dev):
        model = make_model(config)
    if a.mode == "dcp":
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29514")
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
    else:
        import dos.torch as dt

        model = model.to(torch.bfloat16)
        opt = dt.AdamW(model.parameters(), device="cuda", gpu_budget=int(a.gpu_budget_gib * 2**30), **kw)
    model.train()
    g = torch.Generator(device=dev).manual_seed(a.seed)
    data = [torch.randint(0, 50257, (a.batch, 1025), generator=g, device=dev) for _ in range(4)]
    its, during = [], []
    pending, t_save, blocked = None, 0.0, 0.0
    for i in range(1, a.steps + 1):
        if i == a.save_at:
            torch.cuda.synchronize(dev)
            t_save = time.perf_counter()
            if a.mode == "dcp":
                from torch.distributed.checkpoint.state_dict import get_state_dict

                msd, osd = get_state_dict(model, opt)
                pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=a.dir)
            else:
                pending = opt.save(a.dir, ring_bytes=int(a.ring_gib * 2**30))
            blocked = time.perf_counter() - t_save
        t0 = time.perf_counter()
        d = data[i % len(data)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=d[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), d[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
        dt_i = time.perf_counter() - t0
        if pending is not None:
            during.append(dt_i)
            if pending.done():
                if a.mode == "dcp":
                    pending.result()
                else:
                    pending.wait()
                result["durable_s"] = round(time.perf_counter() - t_save, 2)
                pending = None
        elif i >= 2 and not during:
            its.append(dt_i)
        print(f"iter {i}: {1e3 * dt_i:.1f} ms, loss {loss.item():.4f}" + (" (checkpoint in flight)" if pending else ""),
              flush=True)
    if pending is not None:  # not yet durable when training ended: wait, and count the wait as durable time
        pending.result() if a.mode == "dcp" else pending.wait()
        result["durable_s"] = round(time.perf_counter() - t_save, 2)
        result["note"] = "durable after the last iteration"
    base = statistics.median(its) if its else 0
    nbytes = du(a.dir)
    result.update(blocked_s=round(blocked, 3), iter_ms=round(1e3 * base, 1),
                  stall_s=round(sum(max(0.0, x - base) for x in during), 3), iters_during=len(during),
                  bytes=nbytes, gb_per_s=round(nbytes / 1e9 / result["durable_s"], 2))
    print("torch_save " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
