#!/usr/bin/env python3
"""A Hugging Face model trained with dos.torch.AdamW: train, checkpoint lazily, resume.

    make python                                    # builds python/dos/libdos.so
    PYTHONPATH=python python3 examples/torch_hf.py [--steps 60] [--ckpt DIR] [--text FILE] [--device cpu|cuda]

transformers' GPT2LMHeadModel (a small one from GPT2Config: 4 layers, width 128, 4 heads, context 128, byte-level
vocabulary of 256, random init; no download) learns --text (default: this repository's README.md) byte by byte.
On CUDA (the default where torch sees a GPU) the parameters stay float32 on cuda:0 and the forward runs under bf16
autocast, as torch.optim.AdamW users train; dos keeps the AdamW state in pinned host memory and updates it in its
interleaved update phase (gpu_budget 256 MiB). On the CPU dos's SIMD workers update it. Halfway it saves lazily
into --ckpt (the learning-rate scheduler's state beside it with torch.save) while training goes on, then waits for
the save to be durable; at the end a fresh model and optimizer load that checkpoint, replay the second half on the
same batches, and must end bit for bit where the first run did (on CUDA with deterministic algorithms). Exits 1 if
they differ or the loss did not fall below the first batch's, 2 without transformers.
"""
import argparse
import os
import sys
import tempfile

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import torch  # noqa: E402

import dos.torch as dt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T, B = 128, 8


def batches(data, seed, n, device):
    """n batches of B windows of T+1 bytes of data, from seed."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        starts = torch.randint(0, len(data) - T - 1, (B,), generator=g)
        yield torch.stack([data[s:s + T + 1] for s in starts.tolist()]).to(device)


def model_and_optimizer(steps, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=T, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = GPT2LMHeadModel(config).to(device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings; not biases or LayerNorms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    kw = dict(device="cuda", gpu_budget=256 << 20) if device.type == "cuda" else {}
    opt = dt.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95),
                   weight_decay=0.1, max_grad_norm=1.0, **kw)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return model, opt, sched


def train(model, opt, sched, data, first, last, device, save=None):
    loss = None
    for step, xy in enumerate(data, start=1):
        if step <= first:
            continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=xy[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), xy[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if save and step == save[0]:
            handle = opt.save(save[1])  # returns at once; the state is captured and written in the background
            torch.save(sched.state_dict(), os.path.join(save[1], "scheduler.pt"))
            save.append(handle)
        if step == last:
            break
    return loss.item()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ckpt", default=None, help="checkpoint root (default: a temporary directory)")
    ap.add_argument("--text", default=os.path.join(ROOT, "README.md"), help="the text to learn (bytes)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error(f"--steps {a.steps}: want at least 2 (the checkpoint is taken halfway)")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("examples/torch_hf.py needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    with open(a.text, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if len(data) < T + 2:
        ap.error(f"--text {a.text}: {len(data)} bytes; want at least {T + 2}")
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)
    if a.ckpt is None:
        with tempfile.TemporaryDirectory(prefix="dos-hf-") as root:
            rc = run(a.steps, root, data, device)
        print(f"(the checkpoint's root {root} was temporary and is removed; --ckpt DIR keeps one)")
        return rc
    os.makedirs(a.ckpt, exist_ok=True)
    return run(a.steps, a.ckpt, data, device)


def run(steps, root, data, device):
    half = steps // 2
    model, opt, sched = model_and_optimizer(steps, device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        xy = next(batches(data, 1, 1, device))
        first = torch.nn.functional.cross_entropy(model(input_ids=xy[:, :-1]).logits.float().reshape(-1, 256),
                                                  xy[:, 1:].reshape(-1)).item()
    save = [half, root]
    end = train(model, opt, sched, batches(data, 1, steps, device), 0, steps, device, save)
    print(f"GPT2LMHeadModel, {sum(p.numel() for p in model.parameters())} parameters on {device}; "
          f"placement {opt.placement()}")
    print(f"trained {steps} steps: loss {first:.4f} -> {end:.4f}; checkpoint of step {half}: "
          f"{save[2].wait()} (durable)")
    model2, opt2, sched2 = model_and_optimizer(steps, device)
    opt2.load(root)  # the master weights into the model's parameters, the moments, the step, the groups' lr
    sched2.load_state_dict(torch.load(os.path.join(root, "scheduler.pt")))
    end2 = train(model2, opt2, sched2, batches(data, 1, steps, device), half, steps, device)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    print(f"resumed from step {half} and trained to step {steps}: loss {end2:.4f}; "
          f"the same weights as the straight run: {same}")
    opt.close()
    opt2.close()
    return 0 if same and end < first else 1


if __name__ == "__main__":
    sys.exit(main())
