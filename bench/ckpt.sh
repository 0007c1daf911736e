#!/usr/bin/env bash
# The lazy checkpointer against a synchronous save, dd with O_DIRECT and
# (where torch and safetensors are installed) Python's
# safetensors.torch.save_file, on the same disk in one call, ROUNDS times
# interleaved (the disk of a shared machine drifts: each ratio compares
# figures of the same round), then a summary with the medians.
#
#   bash bench/ckpt.sh [GiB] [DIR]     (defaults: 1 GiB, a directory under /tmp)
#
# Environment: ROUNDS (default 3); SCHEDULE=C,G,R runs the update on GPU 0
# with C CPU, G streamed and R resident subgroups (BenchmarkCheckpointBlocking's
# DOS_CKPT_SCHEDULE), so that the lazy save also moves resident state D2H.
#
# Run from the repository root after `make gpu-bins` (bin/test/offload.test)
# or with Go installed (it then runs `go test`). Prints each measurement and
# removes what it wrote.
set -uo pipefail
gib=${1:-1}
dir=${2:-$(mktemp -d /tmp/dos-ckpt-bench.XXXXXX)}
rounds=${ROUNDS:-3}
mkdir -p "$dir"
root="$(cd "$(dirname "$0")/.." && pwd)"
bytes=$(python3 -c "print(int($gib * (1 << 30)))")
count=$((bytes / (8 << 20)))
results=$(mktemp)
havepy=0
python3 -c 'import torch, safetensors' 2>/dev/null && havepy=1

for r in $(seq 1 "$rounds"); do
	echo "== round $r: dd of $gib GiB with oflag=direct (bs 8 MiB) to $dir, then fsync"
	line=$(dd if=/dev/zero of="$dir/dd.bin" bs=8M count="$count" oflag=direct conv=fsync 2>&1 | tail -1)
	rm -f "$dir/dd.bin"
	echo "$line"
	# "8589934592 bytes (8.6 GB, 8.0 GiB) copied, 5.1 s, 1.7 GB/s": bytes / seconds.
	echo "$line" | awk -v r="$r" '{for (i = 1; i < NF; i++) if ($(i+1) == "s,") printf "%s dd %.3f\n", r, $1 / $i / 1e9}' >>"$results"

	echo "== round $r: dos, no checkpoint, a synchronous save, a lazy save (BenchmarkCheckpointBlocking)"
	if [ -x "$root/bin/test/offload.test" ]; then
		out=$(cd "$root/offload" && DOS_CKPT_SCHEDULE=${SCHEDULE:-} DOS_CKPT_GIB=$gib DOS_CKPT_DIR="$dir" ../bin/test/offload.test -test.run '^$' -test.bench CheckpointBlocking -test.benchtime 1x 2>&1)
	else
		out=$(cd "$root" && DOS_CKPT_SCHEDULE=${SCHEDULE:-} DOS_CKPT_GIB=$gib DOS_CKPT_DIR="$dir" go test -run '^$' -bench CheckpointBlocking -benchtime 1x ./offload/ 2>&1)
	fi
	echo "$out" | grep -v '^PASS\|^ok\|^goos\|^goarch\|^pkg\|^cpu'
	rm -rf "$dir/sync" "$dir/lazy"
	# The benchmark's metrics: blocked/sync and flush-GB/s.
	echo "$out" | awk -v r="$r" '/^BenchmarkCheckpointBlocking/ {for (i = 2; i <= NF; i++) {if ($i == "blocked/sync") printf "%s blocked %.4f\n", r, $(i-1); if ($i == "flush-GB/s") printf "%s dos %.3f\n", r, $(i-1)}}' >>"$results"

	if [ "$havepy" = 1 ]; then
		echo "== round $r: Python safetensors.torch.save_file of the same state (64 parameters x 3 fp32 tensors), then fsync"
		python3 - "$dir" "$gib" "$r" "$results" <<'PY'
import os, sys, time
import torch
from safetensors.torch import save_file
d, gib, r, results = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
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
with open(results, "a") as f:
    f.write(f"{r} python {size / (t2 - t0) / 1e9:.3f}\n")
PY
	fi
done

echo "== summary: $gib GiB, $rounds rounds, $dir${SCHEDULE:+, schedule $SCHEDULE}"
python3 - "$results" <<'PY'
import statistics, sys
rounds = {}
for line in open(sys.argv[1]):
    r, k, v = line.split()
    rounds.setdefault(r, {})[k] = float(v)
print("| round | dd O_DIRECT GB/s | dos lazy flush GB/s | Python save_file + fsync GB/s | flush / dd | flush / Python | blocked / sync save |")
print("|---|---|---|---|---|---|---|")
cols = {"dd": [], "dos": [], "python": [], "fdd": [], "fpy": [], "blocked": []}
def cell(x, fmt):
    return fmt % x if x is not None else "-"
for r in sorted(rounds, key=int):
    m = rounds[r]
    dd, dos, py, bl = m.get("dd"), m.get("dos"), m.get("python"), m.get("blocked")
    fdd = dos / dd if dd and dos else None
    fpy = dos / py if py and dos else None
    for k, v in (("dd", dd), ("dos", dos), ("python", py), ("fdd", fdd), ("fpy", fpy), ("blocked", bl)):
        if v is not None:
            cols[k].append(v)
    print(f"| {r} | {cell(dd, '%.2f')} | {cell(dos, '%.2f')} | {cell(py, '%.2f')} | {cell(fdd, '%.2fx')} | {cell(fpy, '%.2fx')} | {cell(bl and 100 * bl, '%.1f %%')} |")
med = {k: statistics.median(v) if v else None for k, v in cols.items()}
print(f"| median | {cell(med['dd'], '%.2f')} | {cell(med['dos'], '%.2f')} | {cell(med['python'], '%.2f')} | {cell(med['fdd'], '%.2fx')} | {cell(med['fpy'], '%.2fx')} | {cell(med['blocked'] and 100 * med['blocked'], '%.1f %%')} |")
PY
rm -f "$results"
rmdir "$dir" 2>/dev/null || true
