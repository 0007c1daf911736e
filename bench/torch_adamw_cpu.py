#!/usr/bin/env python3
"""PyTorch's CPU AdamW on one flat fp32 tensor, the reference for dos's CPU
update rate. Prints Gparam/s and GB/s (28 B/param: fp32 p, g, m, v read;
p, m, v written) for fused=True, foreach=True and the single-tensor loop.

    python3 bench/torch_adamw_cpu.py [--n 16777216] [--threads 16] [--reps 7]
"""
import argparse
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16 << 20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for name, kw in (("fused", dict(fused=True)), ("foreach", dict(foreach=True)), ("single", dict(foreach=False))):
        p = torch.nn.Parameter(torch.randn(a.n))
        p.grad = torch.randn(a.n) * 1e-2
        opt = torch.optim.AdamW([p], lr=1e-3, **kw)
        opt.step()  # state allocation and warm-up
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"torch {torch.__version__} AdamW {name:8s} n={a.n} threads={a.threads}: "
              f"{a.n / med / 1e9:.3f} Gparam/s {28 * a.n / med / 1e9:.1f} GB/s (median of {a.reps})")


if __name__ == "__main__":
    main()
