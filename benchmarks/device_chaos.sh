#!/usr/bin/env bash
# Hunt a rare failure of the randomized workload on the GPU: the injected-faults chaos test
# for ARESIDENCY_CHAOS_SEEDS seeds (default 24), repeated REPEAT times (default 1), full
# tracebacks and the value's transitions in $OUT/chaos.log; then any extra test paths given
# as arguments (their CUDA tests) in $OUT/extra.log.   bash benchmarks/device_chaos.sh [paths]
set -u
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh
export ARESIDENCY_CHAOS_SEEDS=${ARESIDENCY_CHAOS_SEEDS:-24}
PYTEST=(python3 -m pytest -q -rfE --tb=long -p no:cacheprovider -p no:asyncio
  -p aresidency.testing.plugin -m "cuda or cuda2" --timeout=120)
for round in $(seq "${REPEAT:-1}"); do
  echo "== round $round" >> "$OUT/chaos.log"
  timeout -s INT -k 20 "${CHAOS_TIMEOUT:-300}" "${PYTEST[@]}" tests/runtime/test_chaos_cuda.py \
    -k "injected and not uvloop and not trio" >> "$OUT/chaos.log" 2>&1
  echo "== chaos round $round rc=$?"
  grep -E "^(FAILED|ERROR)" "$OUT/chaos.log" | tail -n 20
  tail -n 1 "$OUT/chaos.log"
done
if [ "$#" -gt 0 ]; then
  timeout -s INT -k 20 "${EXTRA_TIMEOUT:-200}" "${PYTEST[@]}" -k "not uvloop and not trio" "$@" \
    > "$OUT/extra.log" 2>&1
  echo "== extra rc=$?"
  grep -E "^(FAILED|ERROR)" "$OUT/extra.log" | head -n 20
  tail -n 1 "$OUT/extra.log"
fi
