#!/usr/bin/env bash
# dos's GPU kernels and pinned copies against PyTorch in one call, on the GPU
# machine after `make gpu-bins`, from the repository root: the kernels
# package's BenchmarkGPU* (fused AdamW on 2^28 fp32 elements and on 128
# tensors of 2M, the 1 GiB device-to-device copy, pinned 1 GiB H2D / D2H /
# both) and bench/torch_gpu.py on the same sizes. Prints both, then a table
# of ratios against the issue's bars.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
log="$(mktemp)"
cd "$root/internal/kernels"
DOS_REQUIRE_GPU=1 ../../bin/test/internal_kernels.test -test.run '^$' -test.bench 'BenchmarkGPU' -test.benchtime 20x -test.count 3 | tee -a "$log"
python3 ../../bench/torch_gpu.py --reps 20 | tee -a "$log"
python3 - "$log" <<'PY'
import re, statistics, sys
dos, torch = {}, {}
for line in open(sys.argv[1]):
    m = re.match(r"(BenchmarkGPU\S+?)(-\d+)?\s+\d+\s+[\d.]+ ns/op\s+([\d.]+) MB/s(?:\s+([\d.]+) Gparam/s)?", line)
    if m:
        dos.setdefault(m[1], []).append((float(m[3]) / 1e3, float(m[4]) if m[4] else None))
    m = re.match(r"torch (\S+): ([\d.]+) (\S+)", line)
    if m:
        torch[m[1]] = float(m[2])
def med(name, i):
    return statistics.median(x[i] for x in dos[name])
rows = [
    ("fused AdamW, 2^28 fp32 (Gparam/s)", med("BenchmarkGPUAdamW", 1), torch["adamw_fused_268M"], 1.15),
    ("fused AdamW, 128 x 2M (Gparam/s)", med("BenchmarkGPUAdamWMulti", 1), torch["adamw_fused_128x2M"], 1.0),
    ("pinned H2D 1 GiB (GB/s)", med("BenchmarkGPUPinned/HostAlloc/H2D", 0), torch["pinned_h2d_1GiB"], 0.97),
    ("pinned D2H 1 GiB (GB/s)", med("BenchmarkGPUPinned/HostAlloc/D2H", 0), torch["pinned_d2h_1GiB"], 0.97),
    ("pinned H2D+D2H (GB/s)", med("BenchmarkGPUPinned/HostAlloc/H2D+D2H", 0), torch["pinned_h2d+d2h_1GiB"], 0.95),
    ("registered H2D 1 GiB (GB/s)", med("BenchmarkGPUPinned/HostRegister/H2D", 0), torch["pinned_h2d_1GiB"], 0.97),
    ("registered D2H 1 GiB (GB/s)", med("BenchmarkGPUPinned/HostRegister/D2H", 0), torch["pinned_d2h_1GiB"], 0.97),
]
print("\n%-38s %10s %10s %7s %6s %s" % ("what", "dos", "torch", "ratio", "bar", ""))
for name, d, t, bar in rows:
    print("%-38s %10.2f %10.2f %6.2fx %5.2fx %s" % (name, d, t, d / t, bar, "ok" if d / t >= bar else "BELOW"))
adam_gbs = med("BenchmarkGPUAdamW", 0)
copy_gbs = med("BenchmarkGPUCopyDtoD", 0)
print("%-38s %10.1f %10.1f %6.2fx %5.2fx %s" % ("AdamW GB/s (28 B/param) vs dos DtoD copy", adam_gbs, copy_gbs, adam_gbs / copy_gbs, 0.85, "ok" if adam_gbs / copy_gbs >= 0.85 else "BELOW"))
print("%-38s %10.1f %10.1f" % ("DtoD copy GB/s, dos vs torch", copy_gbs, torch["copy_dtod_1GiB"]))
PY
rm -f "$log"
