#!/usr/bin/env bash
# Issue 31's calls on the GPU machine, one PART a call (each fits the device's 600 s a command), from the
# repository root after `make gpu-bins` here (carry bin and the ignored .torchao with torchao's
# cpu_offload.py: bench/e2e_offload.sh says how):
#
#   PART=tests OUT=$OUT bash bench/issue31.sh   # trainer.test -test.run TestGPU, DOS_REQUIRE_GPU=1; adam.test's StepSave bench (step, save, step-to)
#   PART=xl    ...                              # gpt2-xl under 24 GiB: dos (old defaults, --resident-first, and both with --speculate 12), torchao, FSDP2 without clipping
#   PART=b40   ...                              # 4.24B (36 x 3072) under 40 GiB: dos --replan, --resident-first --speculate 16 and 24 (auto's), torchao, FSDP2
#   PART=b24   ...                              # 4.24B under 24 GiB, blocks streamed: dos --replan, --resident-first --speculate 24 and 32, FSDP2 (torchao peaks at 29 GiB)
#   PART=clip  ...                              # gpt2-xl under 24 GiB with --clip 1 from step 1: the speculation must cost nothing
#   PART=b16   ...                              # issue 30: 4.24B under 16 GiB (most blocks streamed): dos --replan and the defaults' flags, FSDP2 without clipping
#   PART=b56   ...                              # issue 30: 5.60B (48 x 3072) under 24 GiB, the largest run on this host: dos with the defaults' flags, FSDP2 without clipping
#   PART=fsdp2clip ...                          # FSDP2 with clip_grad_norm_ at gpt2-xl and 4.24B under 24 GiB (each alone: about 0.8 s more an iteration)
#   PART=soak  ...                              # 300 iterations of gpt2-xl under 24 GiB with the speculation: drift and memory
#   PART=verify ...                             # the GPU tests of the held gradients' sums and the host memory's peak, then 4.24B under CAP GiB
#                                               # (default 24, streamed) with bin/dos and with each older binary DOS_OLD names (NAME=PATH ...,
#                                               # or one PATH), the same profile; VERIFY_TESTS=0 skips the tests
#   PART=leave ...                              # TestGPUPlanIterationBitwise, then the leave on one plan: 4.24B under 24 GiB, 18 blocks
#                                               # streamed, --subgroup-size 25000000 (forced counts take the size as given), --schedule
#                                               # SCHEDULE (default 46,59,19: an H100's --replan plan of 2026-12-07), with and without it
#   PART=specgpu ...                            # TestGPUSpeculateGPUBitwise, then --speculate-gpu on one plan: 4.24B under 24 GiB, 18 blocks
#                                               # streamed, --subgroup-size 25000000, --schedule SCHEDULE (default 46,59,19), --speculate SPEC
#                                               # (default 24), with and without it (SPECGPU_STRATS: other strategies; SPECGPU_TESTS=0: no test)
#   PART=b24sweep ...                           # 4.24B under 24 GiB with --speculate 24 and --stream-blocks 15, 17, 19, 21 (dos plan's model
#                                               # predicts more blocks faster; StreamSweep's auto weighs the update phase alone)
#   PART=wait  ...                              # internal/cuda's TestHostWait, perfmodel's BenchmarkHostPages (huge against small pages) and
#                                               # BenchmarkHostUpdate under each wait and on small pages (WAIT_BENCH=0 skips these), then
#                                               # 4.24B runs on one plan a cap: under 24 GiB (18 blocks streamed, --schedule SCHEDULE, default
#                                               # 46,59,19, 25M subgroups) and under 40 GiB (--schedule SCHEDULE40, default 45,15,25, 50M
#                                               # subgroups), --speculate 24, --timeline-at 6; WAIT_CAPS (default 24) and WAIT_MODES (default
#                                               # "old spin-small spin sleep": DOS_CUDA_WAIT's value, a -t15 suffix for --threads 15, a
#                                               # -small suffix for DOS_HUGE_PAGES=off; old: DOS_OLD_BIN, default bin/dos-old, e.g. built at
#                                               # 655f309, before the tenth session) choose the runs, WAIT_STRAT the strategies
#
# EXTRA_FLAGS adds dos train flags to every dos run (e.g. --timeline-at 5, to draw the next forward beside a phase).
# Every e2e part shares one `dos calibrate --json` profile (OUT/P.json) and runs every dos strategy with --clip 0
# (CLIP overrides it), T = 1024, B = 8, STEPS iterations (default 6). dos train's defaults now include
# --resident-first and --speculate auto; the strategies name their flags, so "dos-model" here is
# `--replan --resident-first=false --speculate 0` (the defaults before 2026-12-07). Results and logs go to OUT
# (default /tmp/issue31), the tables last; BENCHMARKS.md "Session of 2026-12-07 (fifth)" has the last figures
# (with --speculate 12 and 16 at 40 GiB, 16 and 24 at 24 GiB: --speculate auto took 16 GiB then, 24 now).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export DOS_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
out=${OUT:-/tmp/issue31}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1
profile() { [ -s "$out/P.json" ] || bin/dos calibrate --json "$out/P.json" >"$out/calibrate.log" 2>&1; }
e2e() { # SUBDIR RUNS STRATS MODES
	profile
	OUT="$out/$1" TOKENIZER=gpt2 GPU_NOCAP=0 STEPS=${STEPS:-6} RUNS="$2" STRATS="$3" MODES="$4" RUN_TIMEOUT=${RUN_TIMEOUT:-300} \
		DOS_FLAGS="--profile $out/P.json --clip ${CLIP:-0} --resident-first=false --speculate 0 ${EXTRA_FLAGS:-}" bash bench/e2e_offload.sh 2>&1 | tail -n 12
}
case ${PART:?PART: tests, xl, b40, b24, clip, soak, b16, b56, fsdp2clip, verify, leave, specgpu, b24sweep or wait} in
tests)
	(cd trainer && ../bin/test/trainer.test -test.run TestGPU -test.v) >"$out/trainer-gpu.log" 2>&1
	echo "trainer.test TestGPU: $(grep -c '^--- PASS' "$out/trainer-gpu.log") pass, $(grep -c '^--- FAIL' "$out/trainer-gpu.log") fail, $(grep -c '^--- SKIP' "$out/trainer-gpu.log") skip"
	(cd adam && ../bin/test/adam.test -test.run XXX -test.bench StepSave -test.benchtime 10x -test.count 2) 2>&1 | tee "$out/adam-bench.log" | grep Benchmark
	;;
xl) e2e xl "gpt2-xl,24,8" "dos-model dos-first dos-first-spec-12" "torchao fsdp2-noclip" ;;
b40) e2e b40 "36:3072:24,40,8" "dos-first-spec-16 dos-first-spec-24 dos-first-spec-32" "torchao fsdp2-noclip" ;;
b24) e2e b24 "36:3072:24,24,8" "dos-model dos-first-spec-24 dos-first-spec-32" "fsdp2-noclip" ;;
clip) CLIP=1 STEPS=10 e2e clip "gpt2-xl,24,8" "dos-model dos-first dos-first-spec-12" "" ;;
b16) e2e b16 "36:3072:24,16,8" "dos-model dos-first-spec-24" "fsdp2-noclip" ;;
b56) e2e b56 "48:3072:24,24,8" "dos-first-spec-24" "fsdp2-noclip" ;;
fsdp2clip) e2e fsdp2clip "gpt2-xl,24,8 36:3072:24,24,8" "" "fsdp2" ;;
verify)
	[ "${VERIFY_TESTS:-1}" = 0 ] || for t in "internal/kernels internal_kernels TestGradPartialsTo|TestGradStats" "scheduler scheduler TestEngineHeldPartials|TestEngineHostHeld|TestSpeculateLeave" \
		"offload offload TestHostGradOnDevice|TestOffloadParam" "perfmodel perfmodel TestCalibrateGPU|TestBound" "trainer trainer TestGPUStreamBitwise"; do
		read -r dir bin run <<<"$t"
		(cd "$dir" && "$OLDPWD/bin/test/$bin.test" -test.run "$run" -test.v) >"$out/$bin.log" 2>&1
		echo "$bin.test $run: rc=$? $(grep -c -- '--- PASS' "$out/$bin.log") pass, $(grep -c -- '--- FAIL' "$out/$bin.log") fail"
	done
	profile
	grep -h "host memory\|contention" "$out/calibrate.log"
	e2e verify-new "36:3072:24,${CAP:-24},8" "dos-first-spec-24" ""
	for o in ${DOS_OLD:-}; do # NAME=BINARY ..., or one BINARY (named old)
		n=${o%%=*}; [ "$n" = "$o" ] && n=old
		(export DOS_BIN=${o#*=} && e2e "verify-$n" "36:3072:24,${CAP:-24},8" "dos-first-spec-24" "")
	done
	grep -h "iteration:\|leaves" "$out"/verify-*/*.log
	;;
specgpu)
	[ "${SPECGPU_TESTS:-1}" = 0 ] || {
		(cd trainer && ../bin/test/trainer.test -test.run TestGPUSpeculateGPUBitwise -test.v) >"$out/trainer-specgpu.log" 2>&1
		echo "trainer.test TestGPUSpeculateGPUBitwise: rc=$? $(grep -c -- '--- PASS' "$out/trainer-specgpu.log") pass, $(grep -c -- '--- FAIL' "$out/trainer-specgpu.log") fail"
	}
	profile
	sched=${SCHEDULE:-46,59,19}
	OUT="$out/specgpu-${sched//,/-}" TOKENIZER=gpt2 GPU_NOCAP=0 STEPS=${STEPS:-8} RUNS="36:3072:24,24,8" \
		STRATS="${SPECGPU_STRATS:-dos-fixed-spec-${SPEC:-24} dos-fixed-spec-${SPEC:-24}-gpu}" \
		SCHEDULE=$sched MODES="" RUN_TIMEOUT=${RUN_TIMEOUT:-150} \
		DOS_FLAGS="--profile $out/P.json --clip 0 --resident-first=false --speculate 0 --stream-blocks 18 --subgroup-size 25000000 ${EXTRA_FLAGS:-}" \
		bash bench/e2e_offload.sh 2>&1 | tail -n 3
	grep -h "iteration:\|CPU updates and" "$out/specgpu-${sched//,/-}"/*.log | head -20
	;;
b24sweep)
	for n in 15 17 19 21; do
		profile
		OUT="$out/b24sweep-$n" TOKENIZER=gpt2 GPU_NOCAP=0 STEPS=${STEPS:-6} RUNS="36:3072:24,24,8" STRATS="dos-first-spec-24" MODES="" RUN_TIMEOUT=${RUN_TIMEOUT:-150} \
			DOS_FLAGS="--profile $out/P.json --clip 0 --resident-first=false --speculate 0 --stream-blocks $n" bash bench/e2e_offload.sh 2>&1 | tail -n 1
	done
	;;
leave)
	(cd trainer && ../bin/test/trainer.test -test.run TestGPUPlanIterationBitwise -test.v) >"$out/trainer-planmove.log" 2>&1
	echo "trainer.test TestGPUPlanIterationBitwise: rc=$? $(grep -c -- '--- PASS' "$out/trainer-planmove.log") pass, $(grep -c -- '--- FAIL' "$out/trainer-planmove.log") fail"
	profile
	OUT="$out/leave" TOKENIZER=gpt2 GPU_NOCAP=0 STEPS=${STEPS:-8} RUNS="36:3072:24,24,8" STRATS="dos-fixed-spec-24 dos-fixed-spec-24-leave" \
		SCHEDULE=${SCHEDULE:-46,59,19} MODES="" RUN_TIMEOUT=${RUN_TIMEOUT:-150} \
		DOS_FLAGS="--profile $out/P.json --clip 0 --resident-first=false --speculate 0 --stream-blocks 18 --subgroup-size 25000000 ${EXTRA_FLAGS:-}" \
		bash bench/e2e_offload.sh 2>&1 | tail -n 3
	grep -h "iteration:\|leaves\|^iter  *[78]/" "$out"/leave/*.log
	;;
wait)
	[ "${WAIT_BENCH:-1}" = 0 ] || {
	(cd internal/cuda && ../../bin/test/internal_cuda.test -test.run TestHostWait -test.v) >"$out/cuda-wait.log" 2>&1
	echo "internal_cuda.test TestHostWait: rc=$? $(grep -c -- '--- PASS' "$out/cuda-wait.log") pass, $(grep -c -- '--- FAIL' "$out/cuda-wait.log") fail"
	grep -h "CPU (" "$out/cuda-wait.log"
	(cd perfmodel && ../bin/test/perfmodel.test -test.run XXX -test.bench HostPages -test.benchtime 10x -test.count 2) >"$out/hostpages.log" 2>&1
	grep -h "host memory\|Gparam/s" "$out/hostpages.log"
	for w in spin sleep spin-small; do # the speculation's update beside a waiting thread and beside copies (perfmodel's BenchmarkHostUpdate); spin-small: on 4 KiB pages
		hp=on; [ "$w" = spin-small ] && hp=off
		(cd perfmodel && DOS_HUGE_PAGES=$hp DOS_CUDA_WAIT=${w%-small} ../bin/test/perfmodel.test -test.run XXX -test.bench HostUpdate -test.benchtime 20x) >"$out/hostupdate-$w.log" 2>&1
		grep -h "host wait\|Gparam/s" "$out/hostupdate-$w.log" | sed 's/^/'"$w"': /'
	done
	}
	profile
	k=0
	for cap in ${WAIT_CAPS:-24}; do
		for w in ${WAIT_MODES:-old spin-small spin sleep}; do
			k=$((k + 1))
			if [ "$cap" = 24 ]; then
				sched=${SCHEDULE:-46,59,19} more="--stream-blocks 18 --subgroup-size 25000000"
			else
				sched=${SCHEDULE40:-45,15,25} more="--subgroup-size 50000000"
			fi
			m=$w thr="" hp=on bin=bin/dos # spin-t15: --threads 15 too (a core left to the trainer's thread); sleep-small: DOS_HUGE_PAGES=off
			[ "$m" = old ] && m=spin bin=${DOS_OLD_BIN:-bin/dos-old} # another binary, in its own defaults
			[ "${m%-small}" != "$m" ] && m=${m%-small} hp=off
			[ "${m#*-t}" != "$m" ] && thr="--threads ${m#*-t}" m=${m%-t*}
			prof=$out/P.json # a profile records the host memory's pages, and a run on the other kind refuses it
			if [ $hp = off ]; then
				prof=$out/P-small.json
				[ -s "$prof" ] || DOS_HUGE_PAGES=off bin/dos calibrate --json "$prof" >"$out/calibrate-small.log" 2>&1
			fi
			DOS_BIN=$bin DOS_HUGE_PAGES=$hp DOS_CUDA_WAIT=$m OUT="$out/wait-$cap-$k-$w" TOKENIZER=gpt2 GPU_NOCAP=0 STEPS=${STEPS:-8} RUNS="36:3072:24,$cap,8" \
				STRATS="${WAIT_STRAT:-dos-fixed-spec-24}" SCHEDULE=$sched MODES="" RUN_TIMEOUT=${RUN_TIMEOUT:-150} \
				DOS_FLAGS="--profile $prof --clip 0 --resident-first=false --speculate 0 $more --timeline-at 6 $thr ${EXTRA_FLAGS:-}" \
				bash bench/e2e_offload.sh 2>&1 | tail -n 1
			grep -h "iteration:\|speculated in the backward\|host waits" "$out/wait-$cap-$k-$w"/*.log | head -5
			grep -h "^iter " "$out/wait-$cap-$k-$w"/*.log | tail -2
		done
	done
	;;
soak)
	OUT="$out/soak" DOS_BIN=bin/dos bash bench/soak.sh --device cuda --model gpt2-xl --tokenizer gpt2 --batch 8 --gpu-memory 24 \
		--recompute --replan --speculate 12 --clip 0 --steps 300 --sample 0 --eval-every 0 2>&1 | tail -n 8
	;;
*)
	echo "issue31.sh: PART $PART: want tests, xl, b40, b24, clip, soak, b16, b56, fsdp2clip, verify, leave, specgpu, b24sweep or wait" >&2
	exit 2
	;;
esac
