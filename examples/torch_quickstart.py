#!/usr/bin/env python3
"""dos.torch.AdamW in a PyTorch training loop: train, checkpoint lazily, resume.

    make python                                    # builds python/dos/libdos.so
    PYTHONPATH=python python3 examples/torch_quickstart.py [--steps 100] [--ckpt DIR]

A small MLP learns a fixed random linear map (CPU, float32) with dos.torch.AdamW, a cosine learning-rate
schedule (torch.optim.lr_scheduler) and clipping (max_grad_norm). Halfway it saves lazily into --ckpt
(training goes on while the state is written; the scheduler's state is saved beside it with torch.save) and
then waits for the save to be durable. At the end a fresh
model and optimizer load that checkpoint, replay the second half with the same batches, and must end bit for
bit where the first run did. Exits 1 if they differ or the loss did not fall.
"""
import argparse
import os
import sys
import tempfile

import torch

import dos.torch as dt


def batches(seed, n):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 8, generator=g)
    for _ in range(n):
        x = torch.randn(64, 16, generator=g)
        yield x, x @ w


def model_and_optimizer(steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = dt.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, weight_decay=0.1,
                   max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return model, opt, sched


def train(model, opt, sched, data, first, last, save=None):
    loss = None
    for step, (x, y) in enumerate(data, start=1):
        if step <= first:
            continue
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if save and step == save[0]:
            handle = opt.save(save[1])  # returns at once; the state is captured and written in the background
            torch.save(sched.state_dict(), os.path.join(save[1], "scheduler.pt"))  # the schedule is the caller's
            save.append(handle)
        if step == last:
            break
    return loss.item()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ckpt", default=None, help="checkpoint root (default: a temporary directory)")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error(f"--steps {a.steps}: want at least 2 (the checkpoint is taken halfway)")
    if a.ckpt is None:  # a temporary root, removed at the end
        with tempfile.TemporaryDirectory(prefix="dos-torch-") as root:
            rc = run(a.steps, root)
        print(f"(the checkpoint's root {root} was temporary and is removed; --ckpt DIR keeps one)")
        return rc
    os.makedirs(a.ckpt, exist_ok=True)
    return run(a.steps, a.ckpt)


def run(steps, root):
    half = steps // 2

    model, opt, sched = model_and_optimizer(steps)
    with torch.no_grad():
        first = torch.nn.functional.mse_loss(model(next(batches(1, 1))[0]), next(batches(1, 1))[1]).item()
    save = [half, root]
    end = train(model, opt, sched, batches(1, steps), 0, steps, save)
    print(f"trained {steps} steps: loss {first:.4f} -> {end:.4f}; checkpoint of step {half}: {save[2].wait()} (durable)")

    model2, opt2, sched2 = model_and_optimizer(steps)
    opt2.load(root)  # the master weights into the model's parameters, the moments, the step, the groups' lr
    sched2.load_state_dict(torch.load(os.path.join(root, "scheduler.pt")))
    end2 = train(model2, opt2, sched2, batches(1, steps), half, steps)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    print(f"resumed from step {half} and trained to step {steps}: loss {end2:.4f}; "
          f"the same weights as the straight run: {same}")
    opt.close()
    opt2.close()
    return 0 if same and end < first else 1


if __name__ == "__main__":
    sys.exit(main())
