#!/usr/bin/env bash
# dos's CPU AdamW (adam.Pool on each SIMD path) against
# torch.optim.AdamW(fused=True) on CPU tensors of the same size (16M fp32
# parameters), at 1, 2 and all threads, in one call, alternating the two
# three times per thread count so that drift on a shared host hits both.
# Prints every measurement, then a table of medians and the ratio. Run on
# the GPU machine's host after `make gpu-bins` (bin/test/adam.test), from
# the repository root. Bytes per parameter: 28 (fp32 p, g, m, v).
set -uo pipefail
threads="1 2 $(nproc)"
root="$(cd "$(dirname "$0")/.." && pwd)"
log="$(mktemp)"
cd "$root/adam"
for t in $threads; do
	for rep in 1 2 3; do
		../bin/test/adam.test -test.run '^$' -test.bench 'BenchmarkStep/pool-[0-9]+/(avx2|avx512)/grad=f32' \
			-test.benchtime 10x -test.count 2 -test.cpu "$t" | grep Benchmark | tee -a "$log"
		python3 ../bench/torch_adamw_cpu.py --threads "$t" --reps 9 | grep fused | tee -a "$log"
	done
done
python3 - "$log" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"BenchmarkStep/pool-(\d+)/(\w+)/grad=f32\S*\s.*?([\d.]+) Gparam/s", line)
    if m:
        rows.setdefault(int(m[1]), {}).setdefault(m[2], []).append(float(m[3]))
    m = re.search(r"fused\s+n=\d+ threads=(\d+): ([\d.]+) Gparam/s", line)
    if m:
        rows.setdefault(int(m[1]), {}).setdefault("torch", []).append(float(m[2]))
print("\nthreads | dos avx2 | dos avx512 | torch fused | avx512/torch | avx2/torch   (medians, Gparam/s)")
for t in sorted(rows):
    r = {k: statistics.median(v) for k, v in rows[t].items()}
    print(f"{t:7d} | {r.get('avx2', 0):8.3f} | {r.get('avx512', 0):10.3f} | {r['torch']:11.3f} | "
          f"{r.get('avx512', 0) / r['torch']:11.2f}x | {r.get('avx2', 0) / r['torch']:9.2f}x")
PY
rm -f "$log"
