#!/usr/bin/env bash
# The CUDA tests in one call with only two logs in $OUT: the whole suite on asyncio, then the
# backend's and the runtime's tests on uvloop (the device's image has no trio: carry its wheels
# in .whl/ to run them on trio too).   bash benchmarks/device_final.sh
# THREAD_POLLS=1: every event waiter the tests make leaves its polls to its thread
# (EventWaiter(loop_timer=False)) unless a test says otherwise (tests/conftest.py), so the
# whole suite runs that way too (the loop's own polls are the default).
# ONLY_ASYNCIO=1 leaves out the uvloop part; ASYNCIO_TIMEOUT and UVLOOP_TIMEOUT bound each part.
set -u
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh
[ -n "${THREAD_POLLS:-}" ] && export ARESIDENCY_TEST_LOOP_TIMER=0
run() {  # $1 log name, $2 timeout, $3 -k expression, then the test paths
  local log=$1 limit=$2 k=$3
  shift 3
  timeout -s INT -k 20 "$limit" python3 -m pytest "$@" -v -rfE --tb=short -p no:cacheprovider \
    -p no:asyncio -p aresidency.testing.plugin -m "cuda or cuda2" -k "$k" --timeout=60 \
    -o faulthandler_timeout=45 --durations=15 > "$OUT/$log" 2>&1
  echo "== $log rc=$?"
  grep -E "^(FAILED|ERROR)" "$OUT/$log" | head -n 20
  tail -n 1 "$OUT/$log"
}
run pytest_asyncio.log "${ASYNCIO_TIMEOUT:-300}" "not uvloop and not trio" tests
[ -n "${ONLY_ASYNCIO:-}" ] || run pytest_uvloop.log "${UVLOOP_TIMEOUT:-100}" "uvloop" tests/backends tests/runtime
