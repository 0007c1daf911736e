#!/usr/bin/env bash
# Runs every test binary that `make gpu-bins` built, and the Python package's
# GPU tests where its library was carried, on the GPU machine, with
# DOS_REQUIRE_GPU=1 so that a GPU test that would skip fails instead. Each
# binary runs in its package's directory (so testdata/ resolves). Full logs go
# to $OUT (or ./bin/logs) and a table is printed last.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
logs=${DOS_TEST_LOGS:-${OUT:-$root/bin/logs}}
mkdir -p "$logs"
export DOS_REQUIRE_GPU=1
status=0
table=""
for bin in "$root"/bin/test/*.test; do
	[ -e "$bin" ] || { echo "no test binaries in bin/test: run make gpu-bins first"; exit 1; }
	name=$(basename "$bin" .test)
	dir="$root/$(echo "$name" | tr _ /)"
	[ "$name" = "." ] && dir=$root
	start=$(date +%s)
	(cd "$dir" && "$bin" -test.count=1 -test.v "$@") >"$logs/test_$name.log" 2>&1
	rc=$?
	secs=$(( $(date +%s) - start ))
	pass=$(grep -c '^--- PASS' "$logs/test_$name.log")
	fail=$(grep -c '^--- FAIL' "$logs/test_$name.log")
	skip=$(grep -c '^--- SKIP' "$logs/test_$name.log")
	[ $rc -ne 0 ] && status=1
	table+=$(printf '%-22s rc=%-3s pass=%-4s fail=%-4s skip=%-4s %ss' "$name" "$rc" "$pass" "$fail" "$skip" "$secs")$'\n'
done
# The Python package's tests, all of them (test_cuda.py's GPU tests,
# test_example.py's transformers example, and the CPU tests under this
# machine's newer torch: FSDP2, torch.distributed.checkpoint's helpers),
# where make python's library was carried (python/dos/libdos.so) and
# python3 has torch and pytest.
if [ -e "$root/python/dos/libdos.so" ] && python3 -c 'import torch, pytest' 2>/dev/null; then
	start=$(date +%s)
	(cd "$root" && PYTHONPATH=python python3 -m pytest -q -rfEs --durations=25 -p no:cacheprovider python/tests) >"$logs/test_python.log" 2>&1
	rc=$?
	[ $rc -ne 0 ] && status=1
	table+=$(printf '%-22s rc=%-3s %s %ss' "python (pytest)" "$rc" "$(tail -1 "$logs/test_python.log")" "$(($(date +%s) - start))")$'\n'
else
	table+="python (pytest)        not run: no python/dos/libdos.so (make python, and carry it) or no torch and pytest"$'\n'
fi
echo "== GPU machine test binaries (DOS_REQUIRE_GPU=1) =="
printf '%s' "$table"
exit $status
