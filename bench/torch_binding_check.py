#!/usr/bin/env python3
"""dos.torch.AdamW on the GPU against torch.optim.AdamW(fused=True) (issue 18, "Tests", the GPU call).

    PYTHONPATH=python python3 bench/torch_binding_check.py [--model gpt2-medium] [--batch 8] [--steps 50]
        [--placements cpu auto:4 static:4 0,0,ALL] [--tol 0.02]

transformers' GPT2LMHeadModel (bench/torch_gpt2.py's build: random init from --seed, fp32 parameters on cuda:0,
SDPA, no dropout) is copied once per run, so every run starts from the same weights; each trains --steps steps
on the same batches (random tokens from --seed) with bf16 autocast, the mean cross-entropy from fp32 logits,
clip_grad_norm_(1.0) and lr 6e-4 warmed up linearly over the steps: first with torch.optim.AdamW(fused=True),
the reference, then with dos.torch.AdamW(device="cuda") once per placement:
  cpu           every subgroup updated on the CPU workers (ZeRO-Offload's placement)
  auto:G        the performance model's choice within G GiB of device memory (a short calibration)
  static:G      as many subgroups resident as G GiB holds, the rest on the CPU
  C,G,R         forced counts; ALL in R means every subgroup resident
float32 parameters: dos steps its fp32 master weights kept on the device, so each step is torch's fp32 AdamW
up to the order of the fused kernel's floating-point operations. Every step's loss must agree with the
reference's within --tol nats (the issue's 0.02); the script prints the worst step, the time per step (median
after 3) and placement(), and last one line per placement:
  torch_binding_check PLACEMENT {"pass": ..., "max_abs_diff": ..., "at_step": ..., "ms_per_step": ..., ...}
Exit status 0 when every placement passes, 1 otherwise, 2 when it cannot run.
"""
import argparse
import copy
import json
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from torch_gpt2 import MODELS, VOCAB, make_model, train_step  # noqa: E402  (the same model and step as the speed reference)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2-medium")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--placements", nargs="+", default=["cpu", "auto:4", "static:4", "0,0,ALL"],
                    help="space-separated; see the doc")
    ap.add_argument("--sub-group-size", type=int, default=50_000_000)
    ap.add_argument("--tol", type=float, default=0.02, help="max |loss diff| in nats at every step")
    a = ap.parse_args()
    try:
        import torch
        from transformers import GPT2Config

        import dos.torch as dt
    except ImportError as e:
        print(f"torch_binding_check: needs torch, transformers and dos (PYTHONPATH=python after make python): {e}",
              file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("torch_binding_check: no CUDA device", file=sys.stderr)
        sys.exit(2)
    dev = torch.device("cuda", 0)
    L, C, H = MODELS[a.model]
    B, T = a.batch, a.seq
    torch.manual_seed(a.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=C, n_layer=L, n_head=H, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=True)
    with torch.device(dev):
        base = make_model(config)
    base = base.to(device=dev, dtype=torch.float32)
    init = copy.deepcopy(base.state_dict())
    n = sum(p.numel() for p in base.parameters())
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}; {a.model}: {n / 1e6:.1f}M parameters, "
          f"B {B} x T {T}, {a.steps} steps, lr {a.lr} warmed up over them")
    g = torch.Generator(device=dev)
    g.manual_seed(a.seed)
    data = [torch.randint(0, 50257, (B, T + 1), generator=g, device=dev) for _ in range(a.steps)]

    def train(make_opt):
        model = base
        model.load_state_dict(init)
        model.train()
        params = list(model.parameters())
        opt = make_opt(params)
        losses, times = [], []
        for i, d in enumerate(data):
            for grp in opt.param_groups:
                grp["lr"] = a.lr * (i + 1) / len(data)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = train_step(model, opt, params, d, VOCAB)
            losses.append(loss.item())  # waits for the step
            times.append(time.perf_counter() - t0)
        return losses, 1e3 * statistics.median(times[3:] or times), opt

    ref, ref_ms, _ = train(lambda ps: torch.optim.AdamW(ps, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                                         fused=True))
    print(f"torch.optim.AdamW(fused=True): loss {ref[0]:.4f} -> {ref[-1]:.4f}, {ref_ms:.1f} ms/step")
    ok = True
    for spec in a.placements:
        kw = dict(device="cuda", sub_group_size=a.sub_group_size)
        if spec == "cpu":
            kw["schedule"] = "cpu"
        elif spec.startswith(("auto:", "static:")):
            sched, gib = spec.split(":")
            kw.update(schedule=sched, gpu_budget=int(float(gib) * 2**30))
        else:
            kw["schedule"] = spec
        if "ALL" in spec:  # every subgroup resident: the count, and the budget it needs
            count = -(-n // a.sub_group_size)
            kw["schedule"] = spec.replace("ALL", str(count))
        box = {}

        def make(ps, kw=kw):
            box["opt"] = dt.AdamW(ps, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
            return box["opt"]

        try:
            losses, ms, opt = train(make)
        except Exception as e:  # a placement that cannot run: say why, go on
            print(f"torch_binding_check {spec} " + json.dumps({"pass": False, "error": str(e)}))
            ok = False
            continue
        diffs = [abs(x - y) for x, y in zip(losses, ref)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        res = {"pass": diffs[worst] <= a.tol, "max_abs_diff": diffs[worst], "at_step": worst + 1,
               "steps_within_1e-3": sum(d <= 1e-3 for d in diffs), "end_loss": losses[-1], "ms_per_step": ms,
               "torch_ms_per_step": ref_ms, "placement": opt.placement()}
        ok &= res["pass"]
        print(f"dos {spec}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, worst |diff| {diffs[worst]:.5f} at step "
              f"{worst + 1}, {ms:.1f} ms/step; placement {res['placement']}")
        print(f"torch_binding_check {spec} " + json.dumps(res), flush=True)
        opt.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
