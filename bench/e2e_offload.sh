#!/usr/bin/env bash
# Issue 17's end-to-end comparison in one call on the GPU machine: whole training iterations of dos against what
# a PyTorch user picks today, under the same device memory cap. From the repository root, after `make gpu-bins`
# and `make python` here (carry bin/ and python/dos/libdos.so):
#
#   OUT=$OUT bash bench/e2e_offload.sh
#
# RUNS is a space-separated list of MODEL,CAP_GiB,BATCH (default "gpt2-xl,24,8"); MODEL is a GPT-2 preset or
# LAYERS:EMBD:HEADS (dos's vocabulary: TOKENIZER, default byte; gpt2 gives PyTorch's model's 50304). T = 1024, STEPS iterations (default 12; the medians leave the first 2 out, and dos's iterations that moved state for a re-plan, as the trainer's steady mean does: the replans column counts them). For each:
#   dos-model   bin/dos train --device cuda --gpu-memory CAP --replan (the performance model's schedule from the
#               start-up calibration, corrected online)
#   dos-nooverlap  dos-model with --no-overlap (nothing of the update phase during backward): what the overlap
#               with backward gains
#   dos-first, dos-first-spec-G  dos-model, dos-spec-G with --resident-first (the resident subgroups are the first
#               blocks: the speculation starts with the backward)
#   dos-first-spec-G-leave  dos-first-spec-G with --speculate-leave (every other CPU update of the last blocks left to
#               the phase, beside the next forward): what leaving some gains
#   dos-fixed-spec-G, dos-fixed-spec-G-leave  the same without --replan, under --schedule SCHEDULE (CPU,GPU,RESIDENT
#               counts): the leave compared on one plan (a --replan run's plan varies with its first steps' rates)
#   dos-fixed-spec-G-gpu, dos-first-spec-G-gpu  dos-fixed-spec-G and dos-first-spec-G with --speculate-gpu (the
#               streamed subgroups speculated on too, on the GPU during the backward)
#   dos-nofwd   dos-model with --no-overlap-forward (each forward after the update phase): what running the next
#               forward over the update's tail gains
#   dos-cpu     the same with --schedule cpu (every subgroup on the CPU: ZeRO-Offload's placement)
#   dos-static  the same with --schedule static (as many subgroups resident as the budget holds: TwinFlow's),
#               subgroups of 1e8 (the static split skips the calibration that chooses the size)
#   dos-static-25M  the static split in subgroups of 2.5e7, the finest size dos-model may choose (it packs the
#               budget best): the static split at its best
#   dos-stream-N  dos-model with --stream-blocks N: the first N blocks' weights and gradients in host memory,
#               streamed to the GPU block by block (dos-model streams as few as the cap needs: --stream-blocks auto)
#   dos-spec-G  dos-model with --speculate G: G GiB of host memory for the CPU's speculative updates during the
#               backward (kept when the step neither clips nor is skipped; give DOS_FLAGS=--clip 0 to see them all kept)
#   fsdp2       python3 bench/torch_offload.py --mode fsdp2 --cap-gib CAP (FSDP2 with CPUOffloadPolicy, one rank,
#               bf16 mixed precision, clip_grad_norm_(1.0) as dos clips)
#   fsdp2-noclip  the same without clip_grad_norm_ (the "vs fsdp2" column is against it where it ran, else fsdp2);
#               any MODE-noclip passes --no-clip
#   dos         python3 bench/torch_offload.py --mode dos --cap-gib CAP (dos.torch.AdamW on the same PyTorch model:
#               issue 18's binding, DOS_TORCH_BUDGET_GIB of update-phase budget, default 8, inside the cap)
#   gpu         python3 bench/torch_offload.py --mode gpu --cap-gib CAP (all on the GPU: the ceiling, where it fits)
#   torchao     python3 bench/torch_offload.py --mode torchao --cap-gib CAP (torchao's CPUOffloadOptimizer, which
#               cannot clip; TORCHAO_CPU_OFFLOAD, default .torchao/cpu_offload.py: a copy of its one file, fetched
#               for the run and carried, never committed)
# dos train's defaults include --resident-first and --speculate auto (since 2026-12-07), so every dos strategy
# runs with them unless DOS_FLAGS says "--resident-first=false --speculate 0" (the strategies' own flags come
# after DOS_FLAGS and win; bench/issue31.sh does this).
# RECOMPUTE=1 (the default) runs both sides with activation checkpointing (dos --recompute, transformers'
# gradient_checkpointing_enable), so the two do the same work under the cap; RECOMPUTE=0 runs neither.
# STRATS (default "dos-model dos-nooverlap dos-cpu dos-static dos-static-25M"; set and empty: none) picks the dos runs, MODES (default
# "fsdp2 dos gpu"; set and empty: none) the PyTorch runs; DOS_BIN (default bin/dos) the dos binary; DOS_FLAGS
# (default none) more flags for every dos run, e.g. "--profile P.json" so that the runs of one call share one
# `dos calibrate --json` profile instead of each calibrating afresh (each calibration plans a little differently);
# RUN_TIMEOUT (seconds, default 0: none) stops any one run there, so that one slow run leaves the call's others. GPU_NOCAP=1 (the default) adds the all-on-GPU run without a cap, as the reference ceiling.
# Every dos run draws its last iteration with --timeline to OUT/MODEL-CAP-bBATCH-STRATEGY-timeline.svg (the Chrome
# trace beside it). Prints one line per run and a markdown table: tokens/s, ms per iteration, forward+backward and update (medians),
# dos's predicted update, TFLOP/s and each run against fsdp2 and torchao. Logs, JSON and summaries go to OUT (default /tmp/e2e).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 2
out=${OUT:-/tmp/e2e}
mkdir -p "$out"
steps=${STEPS:-12}
runs=${RUNS:-"gpt2-xl,24,8"}
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export TORCHAO_CPU_OFFLOAD=${TORCHAO_CPU_OFFLOAD:-$root/.torchao/cpu_offload.py}
dosrc=()
torchrc=()
dosbin=${DOS_BIN:-bin/dos}
if [ "${RECOMPUTE:-1}" = 1 ]; then dosrc=(--recompute); torchrc=(--checkpointing); fi

echo "e2e_offload: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'), $dosbin: $("$dosbin" version 2>&1 | head -1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1
: >"$out/results.jsonl"
for run in $runs; do
	IFS=, read -r model cap batch <<<"$run"
	tag=${model//:/x}
	if [[ $model == *:*:* ]]; then
		IFS=: read -r L C H <<<"$model"
		arch=(--layers "$L" --embd "$C" --heads "$H" --ctx 1024 --tokenizer "${TOKENIZER:-byte}")
	else
		arch=(--model "$model")
	fi
	for strat in ${STRATS-dos-model dos-nooverlap dos-cpu dos-static dos-static-25M}; do
		base="$out/$tag-$cap-b$batch-$strat"
		flags=(--device cuda "${arch[@]}" --batch "$batch" --gpu-memory "$cap" --steps "$steps" "${dosrc[@]}"
			--log-every 1 --sample 0 --eval-every 0 --eval-batches 1 --timeline "$base-timeline.svg")
		# shellcheck disable=SC2206 # DOS_FLAGS are words
		flags+=(${DOS_FLAGS:-})
		case $strat in
		dos-model) flags+=(--replan) ;;
		dos-nooverlap) flags+=(--replan --no-overlap) ;;
		dos-nofwd) flags+=(--replan --no-overlap-forward) ;;
		dos-cpu) flags+=(--schedule cpu) ;;
		dos-static) flags+=(--schedule static) ;;
		dos-static-25M) flags+=(--schedule static --subgroup-size 25000000) ;;
		dos-stream-*) flags+=(--replan --stream-blocks "${strat#dos-stream-}") ;;
		dos-spec-*) flags+=(--replan --speculate "${strat#dos-spec-}") ;;
		dos-first) flags+=(--replan --resident-first) ;;
		dos-fixed-spec-*-gpu) g=${strat#dos-fixed-spec-} && flags+=(--resident-first --speculate "${g%-gpu}" --speculate-gpu --schedule "${SCHEDULE:?dos-fixed-*: SCHEDULE=CPU,GPU,RESIDENT}") ;;
		dos-first-spec-*-gpu) g=${strat#dos-first-spec-} && flags+=(--replan --resident-first --speculate "${g%-gpu}" --speculate-gpu) ;;
		dos-fixed-spec-*-leave) g=${strat#dos-fixed-spec-} && flags+=(--resident-first --speculate "${g%-leave}" --speculate-leave --schedule "${SCHEDULE:?dos-fixed-*: SCHEDULE=CPU,GPU,RESIDENT}") ;;
		dos-fixed-spec-*) flags+=(--resident-first --speculate "${strat#dos-fixed-spec-}" --schedule "${SCHEDULE:?dos-fixed-*: SCHEDULE=CPU,GPU,RESIDENT}") ;;
		dos-first-spec-*-leave) g=${strat#dos-first-spec-} && flags+=(--replan --resident-first --speculate "${g%-leave}" --speculate-leave) ;;
		dos-first-spec-*) flags+=(--replan --resident-first --speculate "${strat#dos-first-spec-}") ;;
		esac
		rm -f "$base.jsonl"
		start=$(date +%s)
		timeout "${RUN_TIMEOUT:-0}" "$dosbin" train "${flags[@]}" --log-json "$base.jsonl" --summary-json "$base.json" >"$base.log" 2>&1
		rc=$?
		python3 - "$model" "$cap" "$batch" "$strat" "$base" "$rc" "$(($(date +%s) - start))" >>"$out/results.jsonl" <<'PY'
import json, statistics, sys
model, cap, batch, strat, base, rc, wall = sys.argv[1:]
r = {"model": model, "cap_gib": float(cap), "batch": int(batch), "strategy": strat, "wall_s": int(wall)}
try:
    steps = [json.loads(l) for l in open(base + ".jsonl")]
    s = json.load(open(base + ".json"))
    # A re-plan's iteration moves subgroups' state between host and device
    # (about 0.6 s at gpt2-xl): left out, as the trainer's steady mean
    # leaves it out, so that two re-plans in six iterations do not make
    # the median (2026-12-07: 546.6 ms for a steady 269.5).
    timed = [x for x in steps[2:] if not x.get("replanned")] or steps[2:] or steps
    it = statistics.median(x["seconds"] for x in timed)
    upd = statistics.median(x["update_s"] for x in timed)
    pred = [x["predicted_s"] for x in timed if x.get("predicted_s")]
    r.update(ms_per_iter=round(1e3 * it, 1), fwd_bwd_ms=round(1e3 * (it - upd), 1), step_ms=round(1e3 * upd, 1),
             predicted_ms=round(1e3 * statistics.median(pred), 1) if pred else None,
             tokens_per_s=round(int(batch) * 1024 / it, 1), params=s["params"], mfu=s.get("mfu"),
             replans=sum(1 for x in steps if x.get("replanned")),
             iter_predicted_ms=round(1e3 * s["iteration_predicted_s"], 1) if s.get("iteration_predicted_s") else None,
             iter_bound_ms=round(1e3 * s["iteration_bound_s"], 1) if s.get("iteration_bound_s") else None,
             speculated=sum(x.get("speculated", 0) for x in timed))
except Exception as e:
    tail = open(base + ".log", errors="replace").read().strip().splitlines()[-1:] or [""]
    r["error"] = f"rc {rc}: {tail[0][:400]} ({type(e).__name__})"
print(json.dumps(r))
PY
		tail -n 1 "$out/results.jsonl"
	done
	modes=()
	for m in ${MODES-fsdp2 dos gpu}; do modes+=("$m,$cap"); done
	[ "${GPU_NOCAP:-1}" = 1 ] && modes+=("gpu,0")
	for mc in "${modes[@]}"; do
		IFS=, read -r mode c <<<"$mc"
		base="$out/$tag-$c-b$batch-$mode"
		clip=()
		[[ $mode == *-noclip ]] && clip=(--no-clip)
		timeout "${RUN_TIMEOUT:-0}" python3 bench/torch_offload.py --mode "${mode%-noclip}" --model "$model" --batch "$batch" --steps "$steps" --warmup 2 \
			--cap-gib "$c" --gpu-budget-gib "${DOS_TORCH_BUDGET_GIB:-8}" "${torchrc[@]}" "${clip[@]}" >"$base.log" 2>&1
		python3 - "$base.log" "$mode" "$cap" "$model" "$batch" "$c" >>"$out/results.jsonl" <<'PY'
import json, sys
lines = [l for l in open(sys.argv[1], errors="replace") if l.startswith("torch_offload ")]
r = json.loads(lines[-1][len("torch_offload "):]) if lines else {"error": "no result line: see the log"}
r["strategy"] = sys.argv[2] if float(sys.argv[6]) else sys.argv[2] + " (no cap)"
r["cap_gib"], r["model"], r["batch"] = float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
print(json.dumps(r))
PY
		tail -n 1 "$out/results.jsonl"
	done
done

echo
python3 - "$out/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]


def ref(r, *strategies):
    """The tokens/s of the first of strategies that ran on r's model and cap."""
    for s in strategies:
        for q in rows:
            if q["model"] == r["model"] and q["cap_gib"] == r["cap_gib"] and q["strategy"] == s and "error" not in q:
                return q.get("tokens_per_s", 0)
    return 0


print("| model | cap GiB | B | strategy | tokens/s | ms/iter | fwd+bwd ms | step ms (predicted) | TFLOP/s | vs fsdp2 | vs torchao |")
print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    fsdp, tao = ref(r, "fsdp2-noclip", "fsdp2"), ref(r, "torchao")
    tps = r.get("tokens_per_s", 0)
    tfl = r.get("tflops") or (round(r["mfu"] * 989, 1) if r.get("mfu") else "")
    pred = f" ({r['predicted_ms']})" if r.get("predicted_ms") else ""
    if "error" in r:
        print(f"| {r['model']} | {r['cap_gib']:g} | {r.get('batch', '')} | {r['strategy']} | failed: {r['error'][:120]} | | | | | | |")
        continue
    print(f"| {r['model']} | {r['cap_gib']:g} | {r['batch']} | {r['strategy']} | {tps:.0f} | {r['ms_per_iter']} | "
          f"{r['fwd_bwd_ms']} | {r['step_ms']}{pred} | {tfl} | {f'{tps / fsdp:.2f}x' if fsdp else '-'} | {f'{tps / tao:.2f}x' if tao else '-'} |")
PY
