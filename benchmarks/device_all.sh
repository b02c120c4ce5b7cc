#!/usr/bin/env bash
# Everything the GPU machine runs in one call: every test marked cuda/cuda2 (on the GPU backend)
# and the benchmarks whose figures go to benchmarks/RESULTS.md. Logs land in $OUT.
#
#   bash benchmarks/device_all.sh     # from the repository root, on the GPU machine
set -u
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests -q -rfE -p no:cacheprovider -m "cuda or cuda2" \
  > "$OUT/pytest_cuda.log" 2>&1
echo "== pytest -m 'cuda or cuda2' rc=$?"
grep -E "passed|failed|error" "$OUT/pytest_cuda.log" | tail -n 2
grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda.log" | head -n 30

if [ "${SKIP_COPY:-0}" != 1 ]; then
  timeout 150 python3 benchmarks/bench_copy.py --json "$OUT/bench_copy.json" --markdown "$OUT/bench_copy.md" \
    > "$OUT/bench_copy.log" 2>&1
  echo "== bench_copy rc=$?"; cat "$OUT/bench_copy.md" 2>/dev/null || tail -n 40 "$OUT/bench_copy.log"
fi

if [ -f benchmarks/bench_stream.py ] && [ "${SKIP_STREAM:-0}" != 1 ]; then
  timeout 240 python3 benchmarks/bench_stream.py > "$OUT/bench_stream.log" 2>&1
  echo "== bench_stream rc=$?"; tail -n 45 "$OUT/bench_stream.log"
fi

timeout 60 python3 benchmarks/bench_scope.py --backend cuda --iterations 5000 > "$OUT/bench_scope.log" 2>&1
echo "== bench_scope (cuda) rc=$?"; cat "$OUT/bench_scope.log"
