#!/usr/bin/env bash
# dos calibrate against PyTorch in one call, on the GPU machine after
# `make gpu-bins`, from the repository root. Runs `bin/dos calibrate` (the
# quick default: CPU pool and GPU 0), writing the profile and the plot to
# $OUT (or bin/out), then bench/torch_gpu.py, and prints a table comparing
# the quantities both measured: pinned H2D, D2H and both at once (GB/s), and
# the fused AdamW's memory traffic (GB/s at 28 B/param: fp32 p, m, v read and
# written, a bf16 gradient read and a bf16 copy written) against PyTorch's
# device-to-device copy rate (GB/s, read + write). The issue's bar: within
# 10 %.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out=${OUT:-$root/bin/out}
mkdir -p "$out"
cd "$root"
/usr/bin/time -f 'dos calibrate wall %e s' bin/dos calibrate --json "$out/profile.json" --plot "$out/calibrate.png" 2>&1 | tee "$out/calibrate.log"
python3 bench/torch_gpu.py --reps 20 | tee "$out/torch_gpu.log"
python3 - "$out/profile.json" "$out/torch_gpu.log" <<'PY'
import json, re, sys
p = json.load(open(sys.argv[1]))
torch = {}
for line in open(sys.argv[2]):
    m = re.match(r"torch (\S+): ([\d.]+)", line)
    if m:
        torch[m[1]] = float(m[2])
g = p["gpu"]
rows = [
    ("pinned H2D (GB/s)", g["h2d"]["rate"] / 1e9, torch["pinned_h2d_1GiB"]),
    ("pinned D2H (GB/s)", g["d2h"]["rate"] / 1e9, torch["pinned_d2h_1GiB"]),
    ("pinned H2D+D2H at once (GB/s)", (g["h2d_duplex"]["rate"] + g["d2h_duplex"]["rate"]) / 1e9, torch["pinned_h2d+d2h_1GiB"]),
    ("AdamW 28 B/param vs copy (GB/s)", 28 * g["update"]["rate"] / 1e9, torch["copy_dtod_1GiB"]),
]
print("\n%-34s %10s %10s %7s %s" % ("calibrate vs torch, same call", "dos", "torch", "ratio", "within 10 %"))
bad = 0
for name, d, t in rows:
    ok = abs(d / t - 1) <= 0.10
    bad += not ok
    print("%-34s %10.2f %10.2f %6.3fx %s" % (name, d, t, d / t, "ok" if ok else "NO"))
print("%-34s %10.2f Gparam/s (torch fused AdamW, fp32 grad: %.2f)" % ("dos Ug", g["update"]["rate"] / 1e9, torch["adamw_fused_268M"]))
sys.exit(1 if bad else 0)
PY
