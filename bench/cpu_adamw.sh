#!/usr/bin/env bash
# dos's CPU AdamW (adam.Pool on each SIMD path) against torch.optim.AdamW on
# CPU tensors of the same size, at 1, 2 and all threads, in one call. Run on
# the GPU machine's host after `make gpu-bins` (bin/test/adam.test), from the
# repository root. Bytes per parameter: 28 (fp32 p, g, m, v).
set -uo pipefail
threads="1 2 $(nproc)"
cd "$(dirname "$0")/../adam"
for t in $threads; do
	../bin/test/adam.test -test.run '^$' -test.bench 'BenchmarkStep/pool-[0-9]+/(generic|avx2|avx512)/grad=f32' \
		-test.benchtime 10x -test.count 3 -test.cpu "$t" | grep Benchmark
	python3 ../bench/torch_adamw_cpu.py --threads "$t" --reps 9 | grep fused
done
