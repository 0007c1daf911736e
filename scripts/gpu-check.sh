#!/usr/bin/env bash
# The foundation's checks on the GPU machine (python3 with torch and
# safetensors there; no Go). Build first, here: make gpu-bins. Then run this
# there from the repository root. Logs go to $OUT (or bin/out).
#
#  1. regenerate the PyTorch reference cases and compare them byte for byte
#     with testdata/adam-cases;
#  2. dos selftest on the committed cases and on the regenerated ones;
#  3. write a checkpoint with the Go code and read it with Python's
#     safetensors (scripts/check_safetensors.py --expect);
#  4. every test binary with DOS_REQUIRE_GPU=1 (scripts/gpu-test.sh);
#  5. dos train, dos export --hf, and transformers.GPT2LMHeadModel's logits
#     on the export against dos eval's (scripts/check_hf_export.py);
#  6. the CPU update rate against PyTorch's fused CPU AdamW (bench/cpu_adamw.sh)
#     and the GPU kernels and pinned copies against PyTorch (bench/gpu.sh);
#  7. dos calibrate against PyTorch's measurements (bench/calibrate.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/bin/out}
mkdir -p "$out"
work=$(mktemp -d)
summary=""
note() { summary+="$1"$'\n'; }

python3 -c 'import torch, safetensors; print("torch", torch.__version__, "safetensors", safetensors.__version__)'

python3 scripts/gen_adam_cases.py --out "$work/cases" >"$out/gen_cases.log" 2>&1
rc=$?; tail -3 "$out/gen_cases.log"
diffs=0
for f in testdata/adam-cases/*.safetensors; do
	cmp -s "$f" "$work/cases/$(basename "$f")" || { echo "differs: $f"; diffs=$((diffs + 1)); }
done
note "gen_adam_cases.py rc=$rc, files differing from testdata: $diffs"

bin/dos selftest >"$out/selftest.log" 2>&1; rc=$?
note "dos selftest (embedded): rc=$rc $(tail -1 "$out/selftest.log")"
bin/dos selftest --cases "$work/cases" >"$work/selftest_regen.log" 2>&1; rc=$?
note "dos selftest (regenerated): rc=$rc $(tail -1 "$work/selftest_regen.log")"

(cd offload && DOS_CKPT_EXPORT="$work/ck" ../bin/test/offload.test -test.run '^TestExportForPython$' -test.v) >"$out/check_safetensors.log" 2>&1
rc=$?
ck=$(ls -d "$work"/ck/ckpt/step-* 2>/dev/null | head -1)
python3 scripts/check_safetensors.py "$ck" --expect "$work/ck/expect.json" >>"$out/check_safetensors.log" 2>&1
note "checkpoint export rc=$rc; check_safetensors.py rc=$? $(tail -1 "$out/check_safetensors.log")"

DOS_TEST_LOGS="$work/testlogs" bash scripts/gpu-test.sh >"$out/gpu_test.log" 2>&1
note "test binaries with DOS_REQUIRE_GPU=1: rc=$?"
tar -C "$work" -czf "$out/test-logs.tar.gz" testlogs
sed -n '/==/,$p' "$out/gpu_test.log"

# 5b. dos train, export to Hugging Face, and transformers' logits against dos's.
{
	bin/dos train --steps 60 --ckpt-dir "$work/train" --sample 0 --log-every 20 --eval-every 0 --summary-json "$work/summary.json" &&
		cat "$work/summary.json" &&
		bin/dos export --ckpt "$work/train" --hf "$work/hf" &&
		bin/dos eval --ckpt "$work/train" --text "Of the Refractions of Light, and their Colours, by Prisms." --logits "$work/logits.safetensors" &&
		python3 scripts/check_hf_export.py "$work/hf" "$work/logits.safetensors"
} >"$out/train_export.log" 2>&1
note "dos train + export + transformers logits: rc=$? $(tail -1 "$out/train_export.log")"
grep -E 'max \|logit' "$out/train_export.log"

# 6. the CPU update rate (SIMD paths) against PyTorch's fused CPU AdamW at 1, 2
#    and all threads, and the GPU kernels and pinned copies against PyTorch.
bash bench/cpu_adamw.sh >"$out/bench_cpu.log" 2>&1
sed -n '/^threads/,$p' "$out/bench_cpu.log"
bash bench/gpu.sh >"$out/bench_gpu.log" 2>&1
sed -n '/^what/,$p' "$out/bench_gpu.log"
OUT="$out/calibrate" bash bench/calibrate.sh >"$out/bench_calibrate.log" 2>&1
note "bench/calibrate.sh (dos calibrate within 10 % of PyTorch): rc=$?"
sed -n '/^calibrate vs torch/,$p' "$out/bench_calibrate.log"

echo "== summary =="
printf '%s' "$summary"
