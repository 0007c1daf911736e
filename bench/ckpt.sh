#!/usr/bin/env bash
# The lazy checkpointer against a synchronous save, dd with O_DIRECT and
# (where torch and safetensors are installed) Python's
# safetensors.torch.save_file, on the same disk in one call.
#
#   bash bench/ckpt.sh [GiB] [DIR]     (defaults: 1 GiB, a directory under /tmp)
#
# Run from the repository root after `make gpu-bins` (bin/test/offload.test)
# or with Go installed (it then runs `go test`). Prints each measurement and
# removes what it wrote.
set -uo pipefail
gib=${1:-1}
dir=${2:-$(mktemp -d /tmp/dos-ckpt-bench.XXXXXX)}
mkdir -p "$dir"
root="$(cd "$(dirname "$0")/.." && pwd)"
bytes=$(python3 -c "print(int($gib * (1 << 30)))")
echo "== dd of $gib GiB with oflag=direct (bs 8 MiB) to $dir, then fsync"
count=$(( bytes / (8 << 20) ))
dd if=/dev/zero of="$dir/dd.bin" bs=8M count="$count" oflag=direct conv=fsync 2>&1 | tail -1
rm -f "$dir/dd.bin"
echo "== dos: no checkpoint, a synchronous save, a lazy save (BenchmarkCheckpointBlocking)"
if [ -x "$root/bin/test/offload.test" ]; then
	(cd "$root/offload" && DOS_CKPT_GIB=$gib DOS_CKPT_DIR="$dir" ../bin/test/offload.test -test.run '^$' -test.bench CheckpointBlocking -test.benchtime 1x | grep -v '^PASS')
else
	(cd "$root" && DOS_CKPT_GIB=$gib DOS_CKPT_DIR="$dir" go test -run '^$' -bench CheckpointBlocking -benchtime 1x ./offload/ | grep -v '^PASS\|^ok\|^goos\|^goarch\|^pkg\|^cpu')
fi
rm -rf "$dir/sync" "$dir/lazy"
if python3 -c 'import torch, safetensors' 2>/dev/null; then
	echo "== Python safetensors.torch.save_file of the same state (64 parameters x 3 fp32 tensors), then fsync"
	python3 - "$dir" "$gib" <<'PY'
import os, sys, time
import torch
from safetensors.torch import save_file
d, gib = sys.argv[1], float(sys.argv[2])
per = int(gib * (1 << 30) / 12) // 64
tensors = {}
for i in range(64):
    for k in ("master", "exp_avg", "exp_avg_sq"):
        tensors[f"layers.{i}.weight.{k}"] = torch.full((per,), 1e-3)
path = os.path.join(d, "py.safetensors")
t0 = time.perf_counter()
save_file(tensors, path)
t1 = time.perf_counter()
fd = os.open(path, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
t2 = time.perf_counter()
size = os.path.getsize(path)
print(f"torch {torch.__version__}: save_file {t1 - t0:.3f} s, + fsync {t2 - t1:.3f} s: {size / (t2 - t0) / 1e9:.2f} GB/s ({size} bytes)")
os.remove(path)
PY
fi
rmdir "$dir" 2>/dev/null || true
