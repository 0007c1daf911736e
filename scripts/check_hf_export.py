#!/usr/bin/env python3
"""Compare transformers' GPT-2 on a `dos export --hf` directory with dos's own logits.

    python3 scripts/check_hf_export.py EXPORT_DIR LOGITS.safetensors [--tol 1e-4]

EXPORT_DIR is what `dos export --ckpt CKPT --hf EXPORT_DIR` wrote; LOGITS.safetensors what
`dos eval --ckpt CKPT --logits LOGITS.safetensors` wrote (tokens I32 [T], logits F64 [T, V],
computed by dos in float64). The script loads the export with
transformers.GPT2LMHeadModel.from_pretrained in float32 on the CPU (and in float64), runs the
same tokens, and prints the max absolute difference of the logits. Exit status 1 when the
float32 difference exceeds --tol.
"""
import argparse
import sys

import torch
from safetensors.torch import load_file
import transformers
from transformers import GPT2LMHeadModel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("logits")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    ours = load_file(a.logits)
    tokens = ours["tokens"].long().unsqueeze(0)
    want = ours["logits"]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    worst = {}
    for dtype in (torch.float32, torch.float64):
        try:
            model = GPT2LMHeadModel.from_pretrained(a.export_dir, dtype=dtype)  # transformers >= 4.56
        except TypeError:
            model = GPT2LMHeadModel.from_pretrained(a.export_dir, torch_dtype=dtype)
        model = model.to(dtype).eval()
        with torch.no_grad():
            got = model(tokens).logits[0].double()
        worst[dtype] = (got - want).abs().max().item()
        print(f"transformers GPT2LMHeadModel {str(dtype):14s} vs dos (float64): max |logit diff| = {worst[dtype]:.3e} "
              f"over {tuple(want.shape)} logits (|logit| up to {want.abs().max().item():.2f})")
    ok = worst[torch.float32] <= a.tol
    print(("OK" if ok else "FAIL") + f" float32 max abs diff {worst[torch.float32]:.3e} (tolerance {a.tol:g})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
