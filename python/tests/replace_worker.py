"""A step loop while another thread keeps replacing p.data (test_threads.py runs it in a subprocess, so that a
crash is the test's failure, not pytest's end).

    python replace_worker.py DTYPE SECONDS

One thread steps dos.torch.AdamW in a loop; another replaces each parameter's p.data with tensors of other
sizes, dtypes and layouts, and with ones of the right shape and dtype (so that steps also succeed). Each step
either succeeds or raises ValueError or dos.DosError; anything else, or a crash, fails. It prints
"ok STEPS ERRORS" and exits 0.
"""
import sys
import threading
import time

import torch

import dos
import dos.torch as dt


def main():
    dtype = getattr(torch, sys.argv[1])
    seconds = float(sys.argv[2])
    shapes = [(1 << 20,), (512, 1029), (3,)]
    ps = [torch.nn.Parameter(torch.randn(*s).to(dtype)) for s in shapes]
    opt = dt.AdamW(ps, lr=1e-3)
    stop = threading.Event()
    bad = []

    def replace():
        try:
            replace_loop()
        except BaseException as e:
            bad.append("the replacing thread: " + repr(e))

    def replace_loop():
        i = 0
        while not stop.is_set():
            i += 1
            p, n = ps[i % len(ps)], shapes[i % len(ps)]
            k = i % 10
            if k == 0:  # another dtype
                p.data = torch.zeros(n, dtype=torch.float32 if dtype != torch.float32 else torch.bfloat16)
            elif k == 1:  # larger, another shape
                p.data = torch.zeros(2 * n[0] + 64, dtype=dtype)
            elif k == 2:  # not contiguous
                p.data = torch.zeros(n[::-1], dtype=dtype).t() if len(n) == 2 else torch.zeros(2 * n[0], dtype=dtype)[::2]
            elif k == 3:  # a gradient of another size
                p.grad.data = torch.zeros(7, dtype=dtype)  # .data skips autograd's check
            elif k < 7:  # smaller
                p.data = torch.zeros(1, dtype=dtype)
            time.sleep(0)
            for p, n in zip(ps, shapes):  # the right shape and dtype: steps can succeed
                if p.data.shape != n or p.data.dtype != dtype or not p.data.is_contiguous():
                    p.data = torch.randn(n).to(dtype)
                if p.grad is None or p.grad.shape != n:
                    p.grad = torch.full(n, 0.01, dtype=dtype)
            time.sleep(0)

    t = threading.Thread(target=replace)
    t.start()
    steps = errors = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and not bad:
            try:
                opt.step()
                steps += 1
            except (ValueError, dos.DosError):
                errors += 1
            except BaseException as e:  # anything else: not a clear refusal
                bad.append("step: " + repr(e))
                break
    finally:
        stop.set()
        t.join()
    if bad:
        print("unexpected:", bad[0])
        sys.exit(1)
    print("ok", steps, errors)


if __name__ == "__main__":
    main()
