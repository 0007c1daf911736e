#!/usr/bin/env bash
# Issue 17's end-to-end comparison in one call on the GPU machine: whole training iterations of dos against what
# a PyTorch user picks today, under the same device memory cap. From the repository root, after `make gpu-bins`
# and `make python` here (carry bin/ and python/dos/libdos.so):
#
#   OUT=$OUT bash bench/e2e_offload.sh
#
# For each RUNS entry MODEL:CAP_GiB:BATCH (default "gpt2-xl:24:8"), T = 1024, STEPS iterations (default 12;
# dos's tokens/s leave the first out):
#   dos-model   bin/dos train --device cuda --model MODEL --batch BATCH --gpu-memory CAP --replan
#               (the performance model's schedule from the start-up calibration, corrected online)
#   dos-cpu     the same with --schedule cpu (every subgroup on the CPU: ZeRO-Offload's placement)
#   dos-static  the same with --schedule static (as many subgroups resident as the budget holds: TwinFlow's)
#   fsdp2       python3 bench/torch_offload.py --mode fsdp2 --cap-gib CAP (FSDP2 with CPUOffloadPolicy, one rank)
#   gpu         python3 bench/torch_offload.py --mode gpu --cap-gib CAP (all on the GPU, where it fits)
# RECOMPUTE=1 adds --recompute to the dos runs (activation checkpointing, for caps the activations pass).
# Prints one line per run and a table: tokens/s, ms per iteration, dos's update phase (measured, predicted),
# and each against fsdp2. Logs and summaries go to OUT (default /tmp/e2e).
# Written before it could run on a GPU (issue 17): check its first output.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 2
out=${OUT:-/tmp/e2e}
mkdir -p "$out"
steps=${STEPS:-12}
runs=${RUNS:-"gpt2-xl:24:8"}
recompute=""
[ "${RECOMPUTE:-0}" = 1 ] && recompute="--recompute"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"

echo "e2e_offload: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'), $(bin/dos version 2>&1 | head -1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1
rows=()
for run in $runs; do
	IFS=: read -r model cap batch <<<"$run"
	for strat in dos-model dos-cpu dos-static; do
		flags=(--device cuda --model "$model" --batch "$batch" --gpu-memory "$cap" --steps "$steps"
			--log-every 1 --sample 0 --eval-every 0 --eval-batches 1)
		[ -n "$recompute" ] && flags+=("$recompute")
		case $strat in
		dos-model) flags+=(--replan) ;;
		dos-cpu) flags+=(--schedule cpu) ;;
		dos-static) flags+=(--schedule static) ;;
		esac
		log="$out/$model-$strat.log"
		sum="$out/$model-$strat.json"
		if bin/dos train "${flags[@]}" --summary-json "$sum" >"$log" 2>&1; then
			line=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(f"{s[\"tokens_per_s\"]:.0f} {1e3*s.get(\"update_s\",0):.1f} {1e3*s.get(\"update_predicted_s\",0):.1f}")' "$sum")
			read -r tps upd pred <<<"$line"
			ms=$(python3 -c "print(f'{1e3*$batch*1024/$tps:.1f}')")
		else
			tps=0 upd=- pred=- ms=-
			echo "  $model $strat failed: $(tail -1 "$log")"
		fi
		echo "$model cap ${cap} GiB B $batch $strat: $tps tokens/s, $ms ms/iter, update $upd ms (predicted $pred)"
		rows+=("$model|$cap|$batch|$strat|$tps|$ms|$upd|$pred")
	done
	for mode in fsdp2 gpu; do
		log="$out/$model-$mode.log"
		python3 bench/torch_offload.py --mode "$mode" --model "$model" --batch "$batch" --steps "$steps" --cap-gib "$cap" >"$log" 2>&1
		line=$(grep '^torch_offload ' "$log" | tail -1 | sed 's/^torch_offload //')
		tps=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1] or "{}"); print(f"{d.get(\"tokens_per_s\",0):.0f}")' "$line")
		ms=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1] or "{}"); print(d.get("ms_per_iter","-"))' "$line")
		echo "$model cap ${cap} GiB B $batch $mode: $tps tokens/s, $ms ms/iter $(python3 -c 'import json,sys; d=json.loads(sys.argv[1] or "{}"); print(d.get("error",""))' "$line")"
		rows+=("$model|$cap|$batch|$mode|$tps|$ms|-|-")
	done
done

echo
echo "| model | cap GiB | B | strategy | tokens/s | ms/iter | update ms (predicted) | vs fsdp2 |"
echo "|---|---:|---:|---|---:|---:|---:|---:|"
for r in "${rows[@]}"; do
	IFS='|' read -r model cap batch strat tps ms upd pred <<<"$r"
	ref=0
	for q in "${rows[@]}"; do
		IFS='|' read -r m2 c2 _ s2 t2 _ _ _ <<<"$q"
		[ "$m2|$c2|$s2" = "$model|$cap|fsdp2" ] && ref=$t2
	done
	ratio=$(python3 -c "print(f'{$tps/$ref:.2f}x' if $ref > 0 else '-')")
	echo "| $model | $cap | $batch | $strat | $tps | $ms | $upd ($pred) | $ratio |"
done
