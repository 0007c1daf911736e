#!/usr/bin/env bash
# Compiles internal/kernels/*.cu to PTX with nvcc (on the GPU machine) and stamps each
# .ptx with its source's SHA-256 on the first line; kernels' stamp test
# fails in CI when a .cu changes and its .ptx does not. Copies the results
# to $OUT when set, so they come back from the GPU machine to be committed.
#
# compute_80: native bf16 conversions; the driver JITs the PTX for the
# actual GPU (sm_90 on the H200). -fmad=false: no multiply-add contraction,
# so the kernels round like the CPU path.
set -euo pipefail
cd "$(dirname "$0")/../internal/kernels"
for cu in *.cu; do
	ptx="${cu%.cu}.ptx"
	sum=$(sha256sum "$cu" | cut -d' ' -f1)
	nvcc -ptx -arch=compute_80 -O3 -fmad=false -Xptxas -v -o "$ptx.tmp" "$cu"
	{ echo "// dos-source-sha256: $sum $cu"; cat "$ptx.tmp"; } >"$ptx"
	rm "$ptx.tmp"
	echo "built $ptx ($(wc -c <"$ptx") bytes) from $cu $sum"
	if [ -n "${OUT:-}" ]; then cp "$ptx" "$OUT/"; fi
done
