#!/usr/bin/env python3
"""Check that a dos checkpoint directory loads with Hugging Face's `safetensors` package.

    python3 scripts/check_safetensors.py CKPT_DIR [--expect EXPECT.json] [--show N]

CKPT_DIR is one checkpoint directory written by dos's `checkpoint.Save`
(`root/step-%09d/`, holding `rank-%05d.safetensors`, `index.json` and `manifest.json`).

For every `*.safetensors` file in CKPT_DIR, the script opens it with
`safetensors.safe_open(path, framework="numpy")` (framework="pt" when numpy is not
installed), prints each tensor's name, dtype, shape and first few values, and checks
that the tensors, dtypes and shapes are exactly those that `manifest.json` lists for
that file. It recomputes nothing else (no checksums: `dos ckpt verify` does that).

numpy has no bfloat16, so BF16 values are read through torch when it is installed,
and otherwise decoded from the file's bytes (the upper 16 bits of a float32).

With --expect, EXPECT.json maps tensor names to what they must hold:

    {"model.w": {"shape": [3, 4], "first": [0.25, -1.5, 3.0]}, ...}

and the script checks each listed tensor's shape and its first len(first) values,
in row-major order, converted to float64 (equal within a relative 1e-6; NaN matches
NaN). Tensors of the checkpoint not listed in EXPECT.json are only printed.

Exit status 0 and a last line "OK n tensors" when every check passes; otherwise
exit status 1 and a last line "FAIL ..." naming the first failure and the count.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import struct
import sys

try:
    from safetensors import safe_open
except ImportError:
    sys.exit("check_safetensors.py: Python's safetensors package is not installed here "
             "(pip install safetensors; Debian 12 does not package it): "
             "dos ckpt verify DIR checks a checkpoint without it")

try:
    import numpy as np

    FRAMEWORK = "numpy"
except ImportError:  # pragma: no cover - depends on the machine
    np = None
    FRAMEWORK = "pt"

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None


def raw_header(path):
    """Return the parsed JSON header and the data section's file offset."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def bf16_from_bytes(path, name, count):
    """Decode the first `count` values of the BF16 tensor `name` from the file itself."""
    header, data_start = raw_header(path)
    begin, end = header[name]["data_offsets"]
    count = min(count, (end - begin) // 2)
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        raw = f.read(2 * count)
    out = []
    for i in range(count):
        (h,) = struct.unpack_from("<H", raw, 2 * i)
        (v,) = struct.unpack("<f", struct.pack("<I", h << 16))
        out.append(v)
    return out


def first_values(handle, path, name, dtype, count):
    """Return the first `count` values of tensor `name`, row-major, as Python floats."""
    if count == 0:
        return []
    if FRAMEWORK == "pt":
        t = handle.get_tensor(name)
        return [float(v) for v in t.flatten()[:count].to(torch.float64).tolist()]
    if dtype == "BF16":
        if torch is not None:
            with safe_open(path, framework="pt") as pt:
                t = pt.get_tensor(name)
            return [float(v) for v in t.flatten()[:count].to(torch.float64).tolist()]
        return bf16_from_bytes(path, name, count)
    a = handle.get_tensor(name)
    return [float(v) for v in np.asarray(a).reshape(-1)[:count].astype(np.float64)]


def close_enough(got, want):
    if want is None or (isinstance(want, float) and math.isnan(want)):
        return math.isnan(got)
    if math.isinf(want) or math.isinf(got):
        return got == want
    return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt_dir", help="a checkpoint directory, root/step-%%09d")
    ap.add_argument("--expect", help="JSON file: tensor name -> {shape, first}")
    ap.add_argument("--show", type=int, default=4, help="values printed per tensor (default 4)")
    args = ap.parse_args(argv)

    failures = []

    def fail(msg):
        failures.append(msg)
        print("  MISMATCH: " + msg)

    manifest_path = os.path.join(args.ckpt_dir, "manifest.json")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        print(f"FAIL cannot read {manifest_path}: {e}")
        return 1
    listed = {}  # file -> {name: entry}
    for t in manifest.get("tensors", []):
        listed.setdefault(t["file"], {})[t["name"]] = t

    expect = {}
    if args.expect:
        with open(args.expect) as f:
            expect = json.load(f)

    paths = sorted(glob.glob(os.path.join(args.ckpt_dir, "*.safetensors")))
    if not paths:
        print(f"FAIL no *.safetensors file in {args.ckpt_dir}")
        return 1
    for name in manifest.get("files", []):
        if not os.path.exists(os.path.join(args.ckpt_dir, name)):
            fail(f"manifest lists {name}, which is missing")

    print(f"framework={FRAMEWORK} step={manifest.get('step')} rank={manifest.get('rank')}")
    seen = set()
    n = 0
    for path in paths:
        base = os.path.basename(path)
        want_here = listed.get(base, {})
        print(f"{base}:")
        try:
            handle = safe_open(path, framework=FRAMEWORK)
        except Exception as e:  # the package raises its own error types
            fail(f"{base}: safe_open failed: {e}")
            continue
        with handle:
            meta = handle.metadata() or {}
            print(f"  metadata {meta}")
            names = list(handle.keys())
            for name in names:
                n += 1
                seen.add(name)
                sl = handle.get_slice(name)
                dtype = sl.get_dtype()
                shape = list(sl.get_shape())
                count = math.prod(shape)
                want = expect.get(name, {})
                k = max(args.show, len(want.get("first") or []))
                try:
                    vals = first_values(handle, path, name, dtype, min(k, count))
                except Exception as e:
                    fail(f"{base}: tensor {name!r}: reading values failed: {e}")
                    vals = []
                shown = ", ".join(f"{v:.6g}" for v in vals[: args.show])
                more = ", ..." if count > args.show else ""
                print(f"  {name}  {dtype}  {shape}  [{shown}{more}]")

                entry = want_here.get(name)
                if entry is None:
                    fail(f"{base}: tensor {name!r} is not in manifest.json")
                else:
                    if list(entry["shape"]) != shape:
                        fail(f"{base}: tensor {name!r}: shape {shape}, manifest {entry['shape']}")
                    if entry["dtype"] != dtype:
                        fail(f"{base}: tensor {name!r}: dtype {dtype}, manifest {entry['dtype']}")

                if want:
                    if "shape" in want and list(want["shape"]) != shape:
                        fail(f"tensor {name!r}: shape {shape}, expected {want['shape']}")
                    first = want.get("first") or []
                    if len(vals) < len(first):
                        fail(f"tensor {name!r}: holds {len(vals)} values, expected at least {len(first)}")
                    for i, (g, w) in enumerate(zip(vals, first)):
                        if not close_enough(g, w):
                            fail(f"tensor {name!r}: value {i} is {g!r}, expected {w!r}")
                            break
            for name in want_here:
                if name not in names:
                    fail(f"{base}: manifest lists tensor {name!r}, which the file lacks")

    for name in expect:
        if name not in seen:
            fail(f"expected tensor {name!r} is not in the checkpoint")

    if failures:
        print(f"FAIL {failures[0]} ({len(failures)} mismatches)")
        return 1
    print(f"OK {n} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
