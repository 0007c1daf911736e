#!/usr/bin/env bash
# memory_matrix.sh: issue 30's matrix of runs on one GPU (sizes × caps ×
# batches): each either trains or is refused before anything is allocated,
# naming what would fit; none may fail with an allocation error. For a
# refusal that names what fits, the first suggestion is run too (its flags
# appended: the last of a repeated flag wins), and it must train.
#
#   bash bench/memory_matrix.sh [CASES]     (on the GPU machine, bin/dos built here)
#
# CASES is a file of lines "NAME|FLAGS[|noadvice]" (default: the list
# below). Each run is `dos train --device cuda FLAGS --steps $STEPS
# --sample 0 --eval-every 0`, under `timeout $RUN_TIMEOUT`; the script
# stops starting runs after $DEADLINE seconds and lists those not run.
# nvidia-smi's peak memory of the process is sampled every 0.5 s (it
# includes the CUDA context, which --gpu-memory does not cap).
# Outcomes: trained (rc 0), refused (rc != 0, dos's device-memory
# refusal, nothing allocated: the GPU was not touched), FAILED (anything
# else: an allocation error, a crash, a time-out). Logs and a table in
# $OUT (default /tmp/matrix); the exit status is 1 when any run FAILED.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 2
out=${OUT:-/tmp/matrix}
mkdir -p "$out"
dos=${DOS_BIN:-bin/dos}
steps=${STEPS:-3}
deadline=${DEADLINE:-100000}
xl="--model gpt2-xl"
b42="--layers 36 --embd 3072 --heads 24 --ctx 1024 --tokenizer gpt2"
b56="--layers 48 --embd 3072 --heads 24 --ctx 1024 --tokenizer gpt2"
cases=${1:-}
if [ -z "$cases" ]; then
	cases="$out/cases.txt"
	cat >"$cases" <<EOF
gpt2 4G b8 rc|--model gpt2 --gpu-memory 4 --batch 8 --recompute
gpt2 4G b8|--model gpt2 --gpu-memory 4 --batch 8
gpt2 24G b32|--model gpt2 --gpu-memory 24 --batch 32
gpt2-medium 8G b8 rc|--model gpt2-medium --gpu-memory 8 --batch 8 --recompute
gpt2-medium 8G b8|--model gpt2-medium --gpu-memory 8 --batch 8
gpt2-large 8G b8 rc|--model gpt2-large --gpu-memory 8 --batch 8 --recompute
gpt2-large 16G b8|--model gpt2-large --gpu-memory 16 --batch 8
gpt2-large 4G b32 rc|--model gpt2-large --gpu-memory 4 --batch 32 --recompute
gpt2-xl 8G b13 rc (edge)|$xl --gpu-memory 8 --batch 13 --recompute
gpt2-xl 8G b14 rc (edge+1)|$xl --gpu-memory 8 --batch 14 --recompute
gpt2-xl 8G b2 (edge)|$xl --gpu-memory 8 --batch 2
gpt2-xl 8G b3 (edge+1)|$xl --gpu-memory 8 --batch 3|noadvice
gpt2-xl 16G b8 rc|$xl --gpu-memory 16 --batch 8 --recompute
gpt2-xl 16G b32 rc|$xl --gpu-memory 16 --batch 32 --recompute
gpt2-xl 24G b8|$xl --gpu-memory 24 --batch 8
gpt2-xl 4G b8 rc|$xl --gpu-memory 4 --batch 8 --recompute
4.24B 8G b8 rc|$b42 --gpu-memory 8 --batch 8 --recompute|noadvice
4.24B 24G b32 rc|$b42 --gpu-memory 24 --batch 32 --recompute|noadvice
4.24B 24G b8|$b42 --gpu-memory 24 --batch 8|noadvice
4.24B 24G b8 rc (streamed)|$b42 --gpu-memory 24 --batch 8 --recompute
5.60B 8G b8 rc|$b56 --gpu-memory 8 --batch 8 --recompute|noadvice
EOF
fi
: >"$out/results.tsv"
t0=$(date +%s)
n=0
failed=0
notrun=()

# run NAME FLAGS...: one dos train; appends NAME, outcome, rc, wall, peak
# MiB, dos's last GPU figure and the message to results.tsv; sets
# $outcome and $advice.
run() {
	local name=$1
	shift
	n=$((n + 1))
	local log="$out/run$n.log"
	local start
	start=$(date +%s)
	timeout "${RUN_TIMEOUT:-240}" "$dos" train --device cuda "$@" --steps "$steps" --sample 0 --eval-every 0 --log-every 1 >"$log" 2>&1 &
	local pid=$!
	local peak=0
	while kill -0 "$pid" 2>/dev/null; do
		local m
		m=$(nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1)
		[[ $m =~ ^[0-9]+$ ]] && [ "$m" -gt "$peak" ] && peak=$m
		sleep 0.5
	done
	wait "$pid"
	local rc=$?
	local wall=$(($(date +%s) - start))
	local gpu msg
	gpu=$(grep -o 'GPU [0-9.]* GiB' "$log" | tail -1)
	advice=""
	if [ $rc -eq 0 ]; then
		outcome=trained
		msg=$(grep '^done:' "$log" | tail -1)
	elif grep -q 'of device memory before the update phase\|of device memory for the activations alone' "$log" &&
		! grep -qi 'out of memory\|CUDA_ERROR' "$log"; then
		outcome=refused
		msg=$(grep -m1 'device memory' "$log")
		advice=$(grep -o 'what fits: [^,;]*' "$log" | head -1 | sed 's/^what fits: //')
	else
		outcome=FAILED
		failed=$((failed + 1))
		msg=$(tail -n 2 "$log" | tr '\n' ' ')
	fi
	printf '%s\t%s\t%d\t%d\t%d\t%s\t%s\n' "$name" "$outcome" "$rc" "$wall" "$peak" "$gpu" "${msg:0:400}" >>"$out/results.tsv"
	printf '%-28s %-8s rc %-3d %4ds  peak %6d MiB  %s\n' "$name" "$outcome" "$rc" "$wall" "$peak" "$gpu"
}

while IFS='|' read -r name flags opt; do
	[ -z "$name" ] && continue
	if [ $(($(date +%s) - t0)) -ge "$deadline" ]; then
		notrun+=("$name")
		continue
	fi
	# shellcheck disable=SC2086 # flags are words
	run "$name" $flags
	if [ "$outcome" = refused ] && [ -n "$advice" ] && [ "$opt" != noadvice ]; then
		# shellcheck disable=SC2086
		run "$name + $advice" $flags $advice
	fi
done <"$cases"

echo
echo "memory matrix: $n runs, $failed FAILED, $(($(date +%s) - t0)) s; bin: $("$dos" version 2>&1 | head -1)"
[ ${#notrun[@]} -gt 0 ] && echo "not run (past DEADLINE $deadline s): ${notrun[*]}"
echo "| run | outcome | wall s | peak MiB (nvidia-smi) | dos's GPU figure | message |"
echo "|---|---|---:|---:|---|---|"
while IFS=$'\t' read -r name outcome rc wall peak gpu msg; do
	echo "| $name | $outcome | $wall | $peak | $gpu | ${msg:0:160} |"
done <"$out/results.tsv"
[ $failed -eq 0 ]
