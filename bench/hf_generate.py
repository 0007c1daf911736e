#!/usr/bin/env python3
"""Load a `dos export --hf DIR` of a GPT-2-tokenized model with transformers (model and tokenizer, offline) and
generate from a prompt.

    python3 bench/hf_generate.py DIR [PROMPT] [--tokens N] [--device cuda|cpu]

Prints the continuation (greedy, then sampled at temperature 0.8 with a fixed seed) and exits 1 when the export
does not load or generates nothing.
"""
import argparse
import sys

import torch
import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("prompt", nargs="?", default="Light is")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    tok = transformers.AutoTokenizer.from_pretrained(a.dir)
    model = transformers.GPT2LMHeadModel.from_pretrained(a.dir).to(a.device).eval()
    ids = tok(a.prompt, return_tensors="pt").input_ids.to(a.device)
    print(f"hf_generate: {a.dir}: {sum(p.numel() for p in model.parameters())} params, tokenizer {type(tok).__name__} "
          f"({len(tok)} tokens), prompt {a.prompt!r} -> {ids[0].tolist()}")
    torch.manual_seed(0)
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=a.tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        sampled = model.generate(ids, max_new_tokens=a.tokens, do_sample=True, temperature=0.8, pad_token_id=tok.eos_token_id)
    g = tok.decode(greedy[0][ids.shape[1]:])
    s = tok.decode(sampled[0][ids.shape[1]:])
    print(f"greedy:  {a.prompt}{g!r}")
    print(f"sampled: {a.prompt}{s!r}")
    if greedy.shape[1] <= ids.shape[1]:
        print("hf_generate: FAIL nothing generated")
        return 1
    print("hf_generate: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
