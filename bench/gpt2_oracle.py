#!/usr/bin/env python3
"""PyTorch as the oracle of a whole dos training run (issue 16, "Correctness").

    python3 bench/gpt2_oracle.py --hf HF0 --data shard.bin --batch 4 --seq 1024 \\
        --dos-log dos.jsonl --beta1 0.9 --beta2 0.95 --eps 1e-8 --weight-decay 0.1 \\
        --max-grad-norm 1.0 [--steps 50] [--tol-step 0.02] [--tol-end 0.01] [--out oracle.json]

HF0 is `dos export --hf` of the run's step-0 checkpoint (config.json + model.safetensors;
vocab_size may be padded, e.g. 50304). The script loads it into transformers'
GPT2LMHeadModel in fp32 on the GPU (sdpa attention, every dropout 0: dos has none), then
for each step i of dos's log trains on exactly dos's batch i: the shard read in llm.c's
DataLoader order (batch i starts at p_i; row b is tokens[p_i + b*T : p_i + b*T + T], its
targets one further; p_0 = 0, p_{i+1} = p_i + B*T, back to 0 when p_{i+1} + B*T + 1 passes
the end of the training tokens), forward under bf16 autocast, the mean cross-entropy over
all B*T positions computed here in fp32 from the logits, backward, clip_grad_norm_, the
learning rate dos logged for that step, torch.optim.AdamW(fused=True) with weight decay on
every parameter (as dos), zero_grad. A step dos logged as skipped (non-finite gradients)
is skipped here too.

--data is a token shard: llm.c's (a header of 256 little-endian int32: magic 20240520,
version 1, ntokens; then ntokens uint16) or nanoGPT's raw uint16 (no header; recognised
when the first int32 is not the magic). --val-fraction F uses only the first
int(ntokens * (1 - F)) tokens for training, for a dos that holds out the tail.

--dos-log is dos's per-step log, JSON lines, one object per optimizer step with at least
step (1-based), loss (the batch's mean cross-entropy in nats, before the update), lr (the
learning rate of this step's update), grad_norm (global L2 norm before clipping) and
skipped. Other lines (no step or no loss) are ignored; a step logged twice counts once, the
last line. Where a record also has pos (the token offset of its batch), the script checks
it against its own order and stops with status 2 on the first difference.

Prints one line per step (step, lr, dos loss, torch loss, diff, both gradient norms; the
norms are informative, not checked), then last the verdict:
  oracle: PASS max |diff| X at step S, end diff Y%
PASS when every |dos loss - torch loss| <= --tol-step (nats) and the last step's differs
by at most --tol-end relative to torch's. Exit status 0 on PASS, 1 on FAIL, 2 when the
inputs are unusable. --out writes both curves and the verdict as JSON.

The shard reader and the log reader need only the standard library (no torch): they can be
imported and tested anywhere.
"""
import argparse
import contextlib
import json
import math
import mmap
import os
import struct
import sys
from array import array

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_BYTES = 256 * 4


class InputError(Exception):
    """An input the oracle cannot use (exit status 2)."""


class TokenShard:
    """A uint16 token file, read through mmap: llm.c's (header) or nanoGPT's (raw)."""

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(LLMC_HEADER_BYTES)
            if len(head) >= 4 and struct.unpack("<i", head[:4])[0] == LLMC_MAGIC:
                if len(head) < LLMC_HEADER_BYTES:
                    raise InputError(f"{path}: llm.c magic but only {size} bytes, shorter than the 1024-byte header")
                _, version, n = struct.unpack("<3i", head[:12])
                if version != LLMC_VERSION:
                    raise InputError(f"{path}: llm.c shard version {version}; want {LLMC_VERSION} (uint16 GPT-2 tokens)")
                if n < 0 or size != LLMC_HEADER_BYTES + 2 * n:
                    raise InputError(f"{path}: header says {n} tokens ({LLMC_HEADER_BYTES + 2 * n} bytes), the file has {size} bytes")
                self.format, self.offset, self.ntokens = "llm.c", LLMC_HEADER_BYTES, n
            else:
                if size % 2:
                    raise InputError(f"{path}: no llm.c header and an odd size ({size} bytes): not raw uint16 tokens")
                self.format, self.offset, self.ntokens = "nanoGPT raw uint16", 0, size // 2
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else b""

    def __len__(self):
        return self.ntokens

    def tokens(self, start, n):
        """Tokens [start, start + n) as a list of ints."""
        if start < 0 or n < 0 or start + n > self.ntokens:
            raise IndexError(f"tokens [{start}, {start + n}) outside [0, {self.ntokens})")
        a = array("H")
        a.frombytes(self._mm[self.offset + 2 * start: self.offset + 2 * (start + n)])
        if sys.byteorder != "little":
            a.byteswap()
        return a.tolist()


class Batches:
    """llm.c's DataLoader order over the first n tokens of a shard, as dos's trainer.Loader
    reads it: a batch is B rows of T tokens from pos (rows repeat from pos when the data
    holds fewer than B rows), pos advances by rows*T and goes back to 0 first when the
    batch at pos would not fit with its last target."""

    def __init__(self, shard, B, T, n=None):
        self.shard, self.B, self.T = shard, B, T
        self.n = len(shard) if n is None else n
        if B < 1 or T < 1:
            raise InputError(f"batch {B}, sequence {T}: want >= 1")
        if self.n < T + 1:
            raise InputError(f"{self.n} training tokens cannot hold one sequence of {T} and its target")
        self.rows = min(B, (self.n - 1) // T)
        self.pos = 0
        self.wrapped = 0

    def next(self):
        """Returns (pos, inputs, targets): lists of B rows of T ints."""
        if self.pos + self.rows * self.T + 1 > self.n:
            self.pos = 0
            self.wrapped += 1
        pos, T = self.pos, self.T
        window = self.shard.tokens(pos, self.rows * T + 1)
        inputs, targets = [], []
        for b in range(self.B):
            s = (b % self.rows) * T
            inputs.append(window[s:s + T])
            targets.append(window[s + 1:s + T + 1])
        self.pos += self.rows * T
        return pos, inputs, targets


def read_dos_log(path):
    """dos's per-step JSON-lines log: a list of records for steps 1..N, in order."""
    by_step = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not JSON: {e}")
            if not isinstance(rec, dict) or "step" not in rec or "loss" not in rec:
                continue  # another kind of record (a header, a validation loss, ...)
            try:
                step = int(rec["step"])
            except (TypeError, ValueError):
                raise InputError(f"{path}:{lineno}: step {rec['step']!r} is not an integer")
            for k in ("loss", "lr"):
                if not isinstance(rec.get(k), (int, float)):
                    raise InputError(f"{path}:{lineno}: step {step} has no numeric {k!r} (keys: {', '.join(sorted(rec))})")
            by_step[step] = rec
    if not by_step:
        raise InputError(f"{path}: no per-step records (JSON objects with step and loss)")
    steps = sorted(by_step)
    if steps[0] != 1:
        raise InputError(f"{path}: the first step logged is {steps[0]}; the oracle starts from step 1 (the step-0 export)")
    missing = [s for s in range(1, steps[-1] + 1) if s not in by_step]
    if missing:
        raise InputError(f"{path}: steps {missing[:5]}{'...' if len(missing) > 5 else ''} are missing")
    return [by_step[s] for s in steps]


def num(x):
    """A float from a JSON value (None, strings like "NaN" become NaN)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def judge(dos_loss, torch_loss, tol_step, tol_end):
    """(ok, max |diff|, its step (1-based), end relative diff) of two loss curves."""
    diffs = [abs(d - t) for d, t in zip(dos_loss, torch_loss)]
    worst = max(range(len(diffs)), key=lambda i: diffs[i] if not math.isnan(diffs[i]) else math.inf)
    max_diff = diffs[worst]
    end = abs(dos_loss[-1] - torch_loss[-1]) / abs(torch_loss[-1]) if torch_loss[-1] != 0 else math.inf
    ok = all(d <= tol_step for d in diffs) and end <= tol_end  # NaN compares False: FAIL
    return ok, max_diff, worst + 1, end


def load_model(hf_dir, device):
    import torch
    from torch import nn
    from transformers import GPT2LMHeadModel

    kw = dict(attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    try:
        model = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32, **kw)  # transformers >= 4.56
    except TypeError:
        model = GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float32, **kw)
    model = model.to(device=device, dtype=torch.float32)
    for m in model.modules():  # whatever the config said: dos has no dropout
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model.train()
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf", required=True, help="dos export --hf directory of the run's step 0")
    ap.add_argument("--data", required=True, help="the token shard dos trained on")
    ap.add_argument("--batch", type=int, required=True, help="B, sequences per step")
    ap.add_argument("--seq", type=int, default=1024, help="T, tokens per sequence")
    ap.add_argument("--dos-log", required=True, help="dos train --log-json output (JSON lines)")
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight_decay, on every parameter (as dos)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="clip_grad_norm_ max_norm (0: no clipping; dos's --clip)")
    ap.add_argument("--steps", type=int, default=0, help="steps to compare (0: all in the log)")
    ap.add_argument("--tol-step", type=float, default=0.02, help="max |loss diff| in nats at every step")
    ap.add_argument("--tol-end", type=float, default=0.01, help="max relative loss diff at the last step")
    ap.add_argument("--val-fraction", type=float, default=0.0,
                    help="train on the first int(ntokens*(1-F)) tokens only, as a dos that holds out the tail (default 0: all)")
    ap.add_argument("--loss-vocab", type=int, default=0,
                    help="score the loss over the first N logit columns only (0: all vocab_size columns)")
    ap.add_argument("--device", default="cuda", help="torch device (cuda; cpu only for a smoke test)")
    ap.add_argument("--bf16-params", nargs="?", const="all", default="", choices=["all", "ln", "emb", "grads"],
                    help="a diagnostic, not the oracle: dos's precision recipe in PyTorch, or a part of it. all: forward "
                         "and backward read every parameter rounded to bf16 (LayerNorm and embeddings included, as dos's "
                         "working copy) and every gradient is rounded to bf16 before clipping and the fp32 AdamW (as "
                         "dos's gradients); ln: only the LayerNorm weights and biases are rounded; emb: only wte and wpe; "
                         "grads: only the gradients")
    ap.add_argument("--sdpa", default="default", choices=["default", "flash", "efficient", "cudnn", "math"],
                    help="the scaled_dot_product_attention backend (default: PyTorch's choice; the others measure how far "
                         "two valid PyTorch runs drift apart, the oracle's own noise floor)")
    ap.add_argument("--log-out", help="also write this run's curve as JSON lines in dos's --log-json format (step, loss, "
                                      "lr, grad_norm, skipped, pos), so that another oracle run can take it as --dos-log")
    ap.add_argument("--out", help="write both curves and the verdict as JSON to this path")
    a = ap.parse_args()

    try:
        log = read_dos_log(a.dos_log)
        steps = a.steps or len(log)
        if steps > len(log):
            raise InputError(f"--steps {steps}, but {a.dos_log} has {len(log)} steps")
        log = log[:steps]
        shard = TokenShard(a.data)
        if not 0 <= a.val_fraction < 1:
            raise InputError(f"--val-fraction {a.val_fraction}: want [0, 1)")
        ntrain = int(len(shard) * (1 - a.val_fraction))
        batches = Batches(shard, a.batch, a.seq, ntrain)
    except (InputError, OSError) as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        sys.exit(2)

    try:
        import torch
        import torch.nn.functional as F
        import transformers
    except ImportError as e:
        print(f"oracle: error: needs torch and transformers: {e}", file=sys.stderr)
        sys.exit(2)

    dev = torch.device(a.device)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev.type}")
    print(f"data: {a.data}: {shard.format}, {len(shard)} tokens, training on the first {ntrain}; "
          f"B {a.batch}, T {a.seq}: {a.batch * a.seq} tokens a step, {steps} steps")
    model = load_model(a.hf, dev)
    cfg = model.config
    V = cfg.vocab_size
    nparams = sum(p.numel() for p in model.parameters())
    tied = model.lm_head.weight is model.transformer.wte.weight
    print(f"model: {a.hf}: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, n_positions {cfg.n_positions}, "
          f"vocab {V}, {nparams} params, tied embeddings {tied}, attention {getattr(cfg, '_attn_implementation', '?')}")
    if a.seq > cfg.n_positions:
        print(f"oracle: error: --seq {a.seq} exceeds the model's n_positions {cfg.n_positions}", file=sys.stderr)
        sys.exit(2)
    Vloss = a.loss_vocab or V
    if not 0 < Vloss <= V:
        print(f"oracle: error: --loss-vocab {a.loss_vocab}: want 1..{V}", file=sys.stderr)
        sys.exit(2)
    print(f"AdamW({'fused' if dev.type == 'cuda' else 'not fused'}) betas ({a.beta1}, {a.beta2}), eps {a.eps}, weight_decay {a.weight_decay} on every parameter; "
          f"clip {a.max_grad_norm if a.max_grad_norm > 0 else 'off'}; bf16 autocast; loss over {Vloss} of {V} columns")

    params = list(model.parameters())
    fused = {"fused": True} if dev.type == "cuda" else {}  # the CPU smoke test: whatever this torch has
    opt = torch.optim.AdamW(params, lr=float(log[0]["lr"]), betas=(a.beta1, a.beta2), eps=a.eps,
                            weight_decay=a.weight_decay, **fused)
    named = dict(model.named_parameters())
    rounded = {"": [], "grads": [], "all": params,
               "ln": [p for n, p in named.items() if ".ln_" in n or n.startswith("ln_")],
               "emb": [p for n, p in named.items() if n.endswith(("wte.weight", "wpe.weight"))]}[a.bf16_params]
    if a.bf16_params:
        print(f"diagnostic --bf16-params {a.bf16_params}: {len(rounded)} parameters read in bf16"
              f"{', gradients rounded to bf16' if a.bf16_params in ('all', 'grads') else ''}")
    attn_ctx = contextlib.nullcontext
    if a.sdpa != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[a.sdpa]
        attn_ctx = lambda: sdpa_kernel([backend])
        print(f"attention: scaled_dot_product_attention restricted to {a.sdpa}")
    logf = open(a.log_out, "w") if a.log_out else None
    rows = []
    print(f"{'step':>5} {'lr':>10} {'dos loss':>10} {'torch loss':>10} {'diff':>9}  {'dos gnorm':>10} {'torch gnorm':>11}")
    for i, rec in enumerate(log):
        step = i + 1
        pos, x, y = batches.next()
        if "pos" in rec and rec["pos"] is not None and int(rec["pos"]) != pos:
            print(f"oracle: error: step {step}: dos read its batch at token {rec['pos']}, the oracle at {pos}: "
                  f"the data order differs (--val-fraction? the shard?), the curves cannot be compared", file=sys.stderr)
            sys.exit(2)
        x = torch.tensor(x, dtype=torch.long, device=dev)
        y = torch.tensor(y, dtype=torch.long, device=dev)
        if rounded:  # the fp32 masters aside, bf16 values in the model
            masters = [p.data.clone() for p in rounded]
            for p in rounded:
                p.data.copy_(p.data.bfloat16().float())
        with torch.autocast(dev.type, dtype=torch.bfloat16), attn_ctx():
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits[..., :Vloss].float().reshape(-1, Vloss), y.reshape(-1))
        loss.backward()
        if rounded:
            for p, m in zip(rounded, masters):
                p.data.copy_(m)
            del masters
        if a.bf16_params in ("all", "grads"):
            for p in params:
                if p.grad is not None:
                    p.grad.copy_(p.grad.bfloat16().float())
        if a.max_grad_norm > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        else:
            gnorm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params if p.grad is not None]))
        lr = float(rec["lr"])
        skipped = bool(rec.get("skipped", False))
        if not skipped:
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
        opt.zero_grad(set_to_none=True)
        del logits
        r = {"step": step, "lr": lr, "pos": pos, "dos_loss": num(rec["loss"]), "torch_loss": loss.item(),
             "dos_grad_norm": num(rec.get("grad_norm")), "torch_grad_norm": gnorm.item(), "skipped": skipped}
        r["diff"] = r["dos_loss"] - r["torch_loss"]
        rows.append(r)
        if logf:
            logf.write(json.dumps({"step": step, "loss": r["torch_loss"], "lr": lr, "grad_norm": r["torch_grad_norm"],
                                   "skipped": skipped, "pos": pos}) + "\n")
        note = "  (skipped by dos and here)" if skipped else ""
        if not math.isfinite(r["torch_grad_norm"]) and not skipped:
            note = "  (torch's gradient is not finite, dos did not skip)"
        print(f"{step:5d} {lr:10.3e} {r['dos_loss']:10.4f} {r['torch_loss']:10.4f} {r['diff']:+9.4f}  "
              f"{r['dos_grad_norm']:10.4f} {r['torch_grad_norm']:11.4f}{note}", flush=True)

    if logf:
        logf.close()
    if batches.wrapped:
        print(f"note: the data wrapped to token 0 {batches.wrapped} time(s) (an epoch is {ntrain} tokens)")
    ok, max_diff, at, end = judge([r["dos_loss"] for r in rows], [r["torch_loss"] for r in rows], a.tol_step, a.tol_end)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"pass": ok, "max_abs_diff": max_diff, "max_abs_diff_step": at, "end_rel_diff": end,
                       "tol_step": a.tol_step, "tol_end": a.tol_end, "params": nparams, "args": vars(a), "steps": rows},
                      f, indent=1, allow_nan=True)
            f.write("\n")
    print(f"oracle: {'PASS' if ok else 'FAIL'} max |diff| {max_diff:.4f} at step {at}, end diff {100 * end:.3f}% "
          f"(tolerances {a.tol_step:g} nats every step, {100 * a.tol_end:g}% at step {len(rows)})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
