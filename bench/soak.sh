#!/usr/bin/env bash
# soak.sh: one long dos train run, its host and device memory sampled
# while it trains, and whether memory or the iteration time drift.
#
#   bash bench/soak.sh DOS-TRAIN-FLAGS...     (on the GPU machine, bin/dos built here)
#
# e.g. issue 30's: bash bench/soak.sh --device cuda --layers 36 --embd 3072 --heads 24 --ctx 1024
#   --tokenizer gpt2 --batch 8 --gpu-memory 24 --recompute --replan --steps 300 --sample 0 --eval-every 0
#
# Every $EVERY seconds (default 2) it records the process's VmRSS and VmHWM
# (/proc/PID/status: the pinned host memory counts), nvidia-smi's memory
# of the process (the CUDA context included) and how many iterations had
# ended (soak.jsonl's lines). dos's --log-json gives each
# iteration's time and update phase. The summary compares the first and
# the last quarter of the iterations after the tenth (medians) and the
# memory at those times; the files (soak.jsonl, memory.tsv, train.log)
# are in $OUT (default /tmp/soak).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 2
out=${OUT:-/tmp/soak}
mkdir -p "$out"
dos=${DOS_BIN:-bin/dos}
rm -f "$out/soak.jsonl"
"$dos" train "$@" --log-every 25 --log-json "$out/soak.jsonl" >"$out/train.log" 2>&1 &
pid=$!
t0=$(date +%s.%N)
since() { awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { printf "%.1f", a - b }'; }
printf 't_s\trss_kib\thwm_kib\tgpu_mib\titers\n' >"$out/memory.tsv"
while kill -0 "$pid" 2>/dev/null; do
	rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null)
	hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null)
	gpu=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null | awk -F', *' -v p="$pid" '$1 == p {print $2}')
	iters=0
	[ -f "$out/soak.jsonl" ] && iters=$(wc -l <"$out/soak.jsonl")
	printf '%s\t%s\t%s\t%s\t%s\n' "$(since)" "${rss:-}" "${hwm:-}" "${gpu:-}" "${iters// /}" >>"$out/memory.tsv"
	sleep "${EVERY:-2}"
done
wait "$pid"
rc=$?
echo "soak: dos train exited $rc after $(since) s; its last lines:"
tail -n 4 "$out/train.log"
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
steps = [json.loads(l) for l in open(out + "/soak.jsonl")]
mem = []  # (t, rss KiB, hwm KiB, gpu MiB or None, iterations ended)
for l in list(open(out + "/memory.tsv"))[1:]:
    f = l.rstrip("\n").split("\t")
    if f[1]:
        mem.append((float(f[0]), int(f[1]), int(f[2] or 0), int(f[3]) if f[3] else None, int(f[4] or 0)))
if len(steps) < 20:
    print(f"soak: {len(steps)} iterations: too few to compare quarters")
    sys.exit(0)
body = steps[10:]
q = max(1, len(body) // 4)
first, last = body[:q], body[-q:]
def med(xs, k): return 1e3 * statistics.median(x[k] for x in xs)
print(f"soak: {len(steps)} iterations; iterations {11}-{10 + q} against {len(steps) - q + 1}-{len(steps)} (medians):")
print(f"  iteration {med(first, 'seconds'):.0f} ms -> {med(last, 'seconds'):.0f} ms ({med(last, 'seconds') / med(first, 'seconds') - 1:+.1%}); "
      f"update phase {med(first, 'update_s'):.0f} ms -> {med(last, 'update_s'):.0f} ms ({med(last, 'update_s') / med(first, 'update_s') - 1:+.1%})")
print(f"  re-plans: {sum(1 for s in steps if s.get('replanned'))} at iterations {[s['step'] for s in steps if s.get('replanned')]}")
# The samples taken while iterations 11 to the last ran (the memory is
# allocated by then; the final evaluation and the teardown are left out).
n = len(steps)
during = [m for m in mem if 10 <= m[4] < n]
if during:
    r = [m[1] for m in during]
    early = [m[1] for m in during if m[4] < 10 + q]
    late = [m[1] for m in during if m[4] >= n - q]
    drift = f"; median {statistics.median(early) / 2**20:.3f} GiB in the first quarter, {statistics.median(late) / 2**20:.3f} in the last" if early and late else ""
    print(f"  host RSS while iterations 11-{n} ran ({len(during)} samples): {min(r) / 2**20:.3f} to {max(r) / 2**20:.3f} GiB{drift}; peak VmHWM {max(m[2] for m in mem) / 2**20:.2f} GiB")
    g = [m[3] for m in during if m[3] is not None]
    if g:
        print(f"  device memory (nvidia-smi) then: {min(g)} to {max(g)} MiB")
else:
    print("  no memory sample while iterations 11 on ran (EVERY too long?)")
PY
exit $rc
