#!/usr/bin/env bash
# Before/after check of a restructuring on the GPU machine, in one call:
# the CPU AdamW benchmark (adam.test BenchmarkStep, the pool at all threads,
# AVX2 and AVX-512, fp32 gradients) and `dos bench` (3.91B parameters,
# 50M subgroups, the H200 profile), old and new binaries alternated.
# OLD is a folder holding the old adam.test and dos (built from the commit
# before the change), NEW the new ones (bin/test/adam.test, bin/dos).
# Writes the dos bench JSONs to $OUT and prints the medians last.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
old=${OLD:-$root/bin/old}
out=${OUT:-$root/bin}
log="$(mktemp)"
t=$(nproc)
cd "$root/adam"
for rep in 1 2 3; do
	for which in old new; do
		bin=$old/adam.test
		[ $which = new ] && bin=$root/bin/test/adam.test
		"$bin" -test.run '^$' -test.bench "BenchmarkStep/pool-$t/(avx2|avx512)/grad=f32" -test.benchtime 10x -test.count 2 -test.cpu "$t" |
			grep Benchmark | sed "s/^/$which /" | tee -a "$log"
	done
done
cd "$root"
for which in old new; do
	bin=$old/dos
	[ $which = new ] && bin=$root/bin/dos
	"$bin" bench --profile testdata/profiles/h200.json --subgroup-size 50000000 --json "$out/bench-$which.json" >"$out/bench-$which.log" 2>&1
	echo "dos bench $which: rc=$?" | tee -a "$log"
done
python3 - "$log" "$out" <<'PY'
import json, re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(old|new) BenchmarkStep/pool-\d+/(\w+)/grad=f32\S*\s.*?([\d.]+) Gparam/s", line)
    if m:
        rows.setdefault(m[2], {}).setdefault(m[1], []).append(float(m[3]))
print("\nCPU AdamW (Gparam/s, medians of 6) | old | new | new/old")
for path, r in sorted(rows.items()):
    o, n = statistics.median(r["old"]), statistics.median(r["new"])
    print(f"{path:8s} | {o:.3f} | {n:.3f} | {n / o:.3f}")
print("\ndos bench 3.91B, 50M subgroups (measured s) | old | new | new/old")
res = {}
for which in ("old", "new"):
    try:
        rs = json.load(open(f"{sys.argv[2]}/bench-{which}.json"))["results"]
        res[which] = {f'{r["name"]} {r["cpu_subgroups"]}/{r["gpu_subgroups"]}/{r["resident_subgroups"]}': r["update_s"] for r in rs}
    except Exception as e:
        print(which, "no JSON:", e)
if len(res) == 2:
    for name, o in res["old"].items():
        n = res["new"].get(name)
        print(f"{name} | {o:.3f} | " + (f"{n:.3f} | {n / o:.3f}" if n else "- | -"))
PY
rm -f "$log"
