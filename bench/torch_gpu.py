#!/usr/bin/env python3
"""PyTorch's side of bench/gpu.sh, on the same sizes as dos's kernels
benchmarks: fused AdamW on one 2^28-element fp32 tensor and on 128 tensors
of 2M, the device-to-device copy of 1 GiB, pinned 1 GiB H2D, D2H and both at
once on two streams. CUDA events, warm-up, median of --reps. Prints one
line per measurement: 'torch NAME: VALUE UNIT'.
"""
import argparse
import statistics

import torch


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")

    n = 1 << 28
    p = torch.nn.Parameter(torch.ones(n, device=dev))
    p.grad = torch.full((n,), 1e-3, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    t = timed(opt.step, a.reps)
    print(f"torch adamw_fused_268M: {n / t / 1e9:.3f} Gparam/s {28 * n / t / 1e9:.1f} GB/s")
    del p, opt

    ps = [torch.nn.Parameter(torch.ones(2 << 20, device=dev)) for _ in range(128)]
    for q in ps:
        q.grad = torch.full_like(q, 1e-3)
    opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    t = timed(opt.step, a.reps)
    print(f"torch adamw_fused_128x2M: {128 * (2 << 20) / t / 1e9:.3f} Gparam/s")
    del ps, opt

    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), a.reps)
    print(f"torch copy_dtod_1GiB: {2 * size / t / 1e9:.1f} GB/s (read + write)")

    h1 = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    h2 = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    d1 = torch.empty(size, dtype=torch.uint8, device=dev)
    d2 = torch.empty(size, dtype=torch.uint8, device=dev)
    t = timed(lambda: d1.copy_(h1, non_blocking=True), a.reps)
    print(f"torch pinned_h2d_1GiB: {size / t / 1e9:.1f} GB/s")
    t = timed(lambda: h2.copy_(d2, non_blocking=True), a.reps)
    print(f"torch pinned_d2h_1GiB: {size / t / 1e9:.1f} GB/s")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(s1):
            d1.copy_(h1, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(d2, non_blocking=True)
        s1.synchronize()
        s2.synchronize()

    import time
    both()
    ts = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        both()
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts)
    print(f"torch pinned_h2d+d2h_1GiB: {2 * size / t / 1e9:.1f} GB/s (both directions)")


if __name__ == "__main__":
    main()
