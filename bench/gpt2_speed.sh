#!/usr/bin/env bash
# dos's GPU trainer against PyTorch eager on GPT-2 124M, 350M, 774M and 1.5B at T = 1024, in
# one call on the GPU machine (issue 16, "Speed"), from the repository root after
# `make gpu-bins` (bin/dos is carried; python3 with torch and transformers there):
#
#   bash bench/gpt2_speed.sh            # all four models
#   QUICK=1 bash bench/gpt2_speed.sh    # gpt2 and gpt2-xl, few steps: a smoke test
#
# For each MODEL:BATCH of CONFIGS (default "gpt2:16 gpt2-medium:16 gpt2-large:8 gpt2-xl:8"):
#   bin/dos train --device cuda --model M --batch B --steps DOS_STEPS \
#       --log-json $OUT/dos_M.jsonl --summary-json $OUT/dos_M.json $DOS_FLAGS
#   python3 bench/torch_gpt2.py --model M --batch B --steps TORCH_STEPS --warmup TORCH_WARMUP
# with their output in $OUT/dos_M.log and $OUT/torch_M.log, then prints a markdown table
# last: model, params, B, dos tokens/s, dos MFU, torch tokens/s, torch MFU, dos/torch.
#
# Environment: OUT (default /tmp), CONFIGS, DOS_STEPS (default 30; QUICK 10), TORCH_STEPS
# (default 20; QUICK 8), TORCH_WARMUP (default 5; QUICK 3), DOS_FLAGS (more dos train flags,
# e.g. "--profile P --gpu-budget 40"), RUN_TIMEOUT (seconds per command, default 300) and
# BUDGET (seconds for the whole script, default 560: a device call is cut at 600; what
# would start past it is skipped and marked so).
#
# dos's figures come from its --summary-json (tokens_per_s, mfu; a key that is missing
# prints n/a; an MFU that dos does not report is computed here from tokens_per_s with
# the same formula and marked *), PyTorch's from the `torch_gpt2 {json}` line.
set -uo pipefail
export PYTHONUNBUFFERED=1
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 2
out=${OUT:-/tmp}
mkdir -p "$out"
if [ "${QUICK:-0}" = 1 ]; then
	configs=${CONFIGS:-"gpt2:16 gpt2-xl:8"}
	dos_steps=${DOS_STEPS:-10} torch_steps=${TORCH_STEPS:-8} torch_warmup=${TORCH_WARMUP:-3}
else
	configs=${CONFIGS:-"gpt2:16 gpt2-medium:16 gpt2-large:8 gpt2-xl:8"}
	dos_steps=${DOS_STEPS:-30} torch_steps=${TORCH_STEPS:-20} torch_warmup=${TORCH_WARMUP:-5}
fi
run_timeout=${RUN_TIMEOUT:-300}
budget=${BUDGET:-560}
begin=$SECONDS

echo "gpt2_speed: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'), $(bin/dos version 2>&1 | head -1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1
echo "configs: $configs; dos --steps $dos_steps ${DOS_FLAGS:-}; torch --steps $torch_steps --warmup $torch_warmup; logs in $out"

# timed NAME LOG CMD...: runs CMD with a timeout, its output in LOG, unless the budget is spent.
timed() {
	local name=$1 log=$2
	shift 2
	if [ $((SECONDS - begin)) -ge "$budget" ]; then
		echo "== $name: skipped, the ${budget} s budget is spent" | tee "$log"
		return 124
	fi
	echo "== $name: $*"
	local t0=$SECONDS
	timeout -k 10 "$run_timeout" "$@" >"$log" 2>&1
	local rc=$?
	echo "   rc=$rc in $((SECONDS - t0)) s; last lines:"
	tail -4 "$log" | sed 's/^/   | /'
	return $rc
}

for mb in $configs; do
	m=${mb%%:*} b=${mb##*:}
	rm -f "$out/dos_$m.json" "$out/dos_$m.jsonl"
	# shellcheck disable=SC2086 # DOS_FLAGS is a list of flags
	timed "dos $m B=$b" "$out/dos_$m.log" bin/dos train --device cuda --model "$m" --batch "$b" --steps "$dos_steps" \
		--sample 0 --eval-every 0 --eval-batches 1 --log-every 10 \
		--log-json "$out/dos_$m.jsonl" --summary-json "$out/dos_$m.json" ${DOS_FLAGS:-}
	echo "dos_rc $?" >>"$out/dos_$m.log"
	timed "torch $m B=$b" "$out/torch_$m.log" python3 bench/torch_gpt2.py --model "$m" --batch "$b" \
		--steps "$torch_steps" --warmup "$torch_warmup"
done

echo "gpt2_speed: done in $((SECONDS - begin)) s"
python3 - "$out" "$configs" <<'PY'
import json, os, re, sys
out, configs = sys.argv[1], sys.argv[2].split()
PEAK = 989e12
SHAPES = {"gpt2": (12, 768), "gpt2-medium": (24, 1024), "gpt2-large": (36, 1280), "gpt2-xl": (48, 1600)}
T = 1024

def load_json(path):
    try:
        with open(path) as f:
            v = json.load(f)
        return v if isinstance(v, dict) else {}
    except (OSError, ValueError):
        return {}

def torch_result(path):
    try:
        for line in open(path):
            if line.startswith("torch_gpt2 {"):
                return json.loads(line[len("torch_gpt2 "):])
    except (OSError, ValueError):
        pass
    return {}

def number(d, k):
    v = d.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

def why(log):  # a short reason for a missing figure
    try:
        text = open(log).read()
    except OSError:
        return "no log"
    if "skipped, the" in text:
        return "skipped (time)"
    m = re.search(r"dos_rc (\d+)", text)
    if m and m[1] != "0":
        return f"rc {m[1]}"
    if "out of memory" in text.lower():
        return "OOM"
    return "n/a"

print()
print("| model | params | B | dos tokens/s | dos MFU | torch tokens/s | torch MFU | dos/torch |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
computed = False
for mb in configs:
    m, b = mb.split(":")
    d, t = load_json(f"{out}/dos_{m}.json"), torch_result(f"{out}/torch_{m}.log")
    params = number(t, "params") or number(d, "params")
    dt, tt = number(d, "tokens_per_s"), number(t, "tokens_per_s")
    dm, tm = number(d, "mfu"), number(t, "mfu")
    dm_s = f"{100 * dm:.1f}%" if dm is not None else "n/a"
    if dm is None and dt is not None and params and m in SHAPES:
        L, C = SHAPES[m]
        dm_s = f"{100 * (6 * params + 6 * L * C * T) * dt / PEAK:.1f}%*"
        computed = True
    cells = [
        m,
        f"{params / 1e6:.1f}M" if params else "n/a",
        b,
        f"{dt:,.0f}" if dt is not None else why(f"{out}/dos_{m}.log"),
        dm_s,
        f"{tt:,.0f}" if tt is not None else (str(t.get("error") or "")[:30] or why(f"{out}/torch_{m}.log")),
        f"{100 * tm:.1f}%" if tm is not None else "n/a",
        f"{dt / tt:.2f}x" if dt is not None and tt else "n/a",
    ]
    print("| " + " | ".join(str(c) for c in cells) + " |")
print()
print(f"T = {T}; MFU against {PEAK / 1e12:.0f} TFLOP/s bf16 dense with 6N + 6LCT FLOPs per token (llm.c's count); "
      "torch: median ms/iter after warm-up; dos: its summary's tokens_per_s.")
if computed:
    print("* dos's summary has no mfu: computed here from its tokens_per_s and the model's parameter count.")
PY
