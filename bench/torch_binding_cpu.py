#!/usr/bin/env python3
"""dos.torch.AdamW's step on CPU parameters against torch.optim.AdamW(foreach=False) and (foreach=True), in one run.

    PYTHONPATH=python python3 bench/torch_binding_cpu.py [--n 16777216] [--steps 8]

One parameter of --n elements (float32, then bfloat16 for dos: its 16-bit working copy of fp32 masters), a fixed
gradient; the median of --steps steps after two warm-up steps, in ms, and the parameters per second. torch's
threads: torch.get_num_threads(); dos's: every CPU (threads=0).
"""
import argparse
import statistics
import time

import torch

import dos.torch as dt


def median_ms(opt, steps):
    for _ in range(2):
        opt.step()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 24)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"n={a.n}, torch {torch.__version__} with {torch.get_num_threads()} threads")
    rows = []
    for name, dtype, make in (
        ("torch.optim.AdamW(foreach=False)", torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)),
        ("torch.optim.AdamW(foreach=True)", torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
        ("dos.torch.AdamW float32", torch.float32, lambda ps: dt.AdamW(ps, lr=1e-3)),
        ("dos.torch.AdamW bfloat16", torch.bfloat16, lambda ps: dt.AdamW(ps, lr=1e-3)),
    ):
        p = torch.nn.Parameter(torch.randn(a.n, generator=g).to(dtype))
        p.grad = (torch.randn(a.n, generator=g) * 0.01).to(dtype)
        opt = make([p])
        ms = median_ms(opt, a.steps)
        if hasattr(opt, "close"):
            opt.close()
        rows.append((name, ms))
    for name, ms in rows:
        print(f"{name:36s} {ms:8.1f} ms  {a.n / ms / 1e6:6.2f} Gparam/s")


if __name__ == "__main__":
    main()
