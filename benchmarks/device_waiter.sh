#!/usr/bin/env bash
# One device call for the event waiter: the backend's and the runtime's CUDA tests on every
# loop, the wake-up rows of bench_copy (asyncio, then uvloop), and the burst timeline with the
# loop's timed polls (loop_timer=True) against the thread's (the default), alternating. Logs
# land in $OUT.
#
#   bash benchmarks/device_waiter.sh        # from the repository root, on the GPU machine
#
# SKIP_TESTS=1 leaves the tests out; ROUNDS sets the timeline's alternations (default 2);
# WITH_COPY=1 adds the whole bench_copy table and diag_copy_paths (the host's memcpy ceilings).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
if [ -z "${SKIP_TESTS:-}" ]; then
  PARTS=tests TEST_PATHS="tests/backends tests/runtime" TEST_TIMEOUT=${TEST_TIMEOUT:-330} \
    OUT="$OUT" bash benchmarks/device_all.sh
else
  PARTS=none OUT="$OUT" bash benchmarks/device_all.sh  # the wheels and the environment only
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
for loop in "" --uvloop; do
  timeout 90 python3 benchmarks/bench_copy.py --wakeup-only $loop \
    --markdown "$OUT/wake${loop:+_uvloop}.md" > "$OUT/wake${loop:+_uvloop}.log" 2>&1
  echo "== bench_copy --wakeup-only $loop rc=$?"
  grep -E "aresidency waiter|idle loop" "$OUT/wake${loop:+_uvloop}.log"
done
for i in $(seq "${ROUNDS:-2}"); do
  for w in hybrid-timer auto; do
    timeout 60 python3 benchmarks/diag_copy_timeline.py --waiter "$w" --rounds 5 \
      >> "$OUT/timeline.log" 2>&1
    echo "== diag_copy_timeline --waiter $w (round $i) rc=$?"
    tail -n 6 "$OUT/timeline.log"
  done
done
if [ -n "${WITH_COPY:-}" ]; then  # the whole copy table and the host's memcpy ceilings too
  timeout 300 python3 benchmarks/bench_copy.py --json "$OUT/bench_copy.json" \
    --markdown "$OUT/bench_copy.md" > "$OUT/bench_copy.log" 2>&1
  echo "== bench_copy rc=$?"; sed -n '/^### Copies/,/^### Waking/p' "$OUT/bench_copy.md"
  timeout 150 python3 benchmarks/diag_copy_paths.py > "$OUT/diag_copy_paths.log" 2>&1
  echo "== diag_copy_paths rc=$?"; grep -E "pageable|both|cpus" "$OUT/diag_copy_paths.log"
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== summary: pytest -m 'cuda or cuda2' tests/backends tests/runtime"
  grep -E "passed|failed|error" "$OUT/pytest_cuda.log" | tail -n 1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda.log" | head -n 10
fi
