#!/usr/bin/env bash
# Everything the GPU machine runs in one call: every test marked cuda/cuda2 (real GPU backend),
# the examples, and the benchmarks whose figures go to benchmarks/RESULTS.md. Logs land in $OUT.
#
#   bash benchmarks/device_all.sh     # from the repository root, on the GPU machine
# Set SKIP_TESTS=1, SKIP_STREAM=1, SKIP_COPY=1 to leave a part out.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  python3 -c "import accelerate; print('accelerate', accelerate.__version__)" 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests -q -rfE -p no:cacheprovider -m "cuda or cuda2" \
    --timeout=${PER_TEST_TIMEOUT:-45} > "$OUT/pytest_cuda.log" 2>&1
  echo "== pytest -m 'cuda or cuda2' rc=$?"
  grep -E "passed|failed|error" "$OUT/pytest_cuda.log" | tail -n 2
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda.log" | head -n 30
  for ex in examples/01_explicit.py examples/03_automatic.py examples/02_weight_streaming.py; do
    timeout 60 python3 "$ex" > "$OUT/$(basename "$ex" .py).log" 2>&1
    echo "== $ex rc=$?"; tail -n 4 "$OUT/$(basename "$ex" .py).log"
  done
fi

if [ "${SKIP_STREAM:-0}" != 1 ]; then
  timeout ${STREAM_TIMEOUT:-270} python3 benchmarks/bench_stream.py --json "$OUT/bench_stream.json" \
    --markdown "$OUT/bench_stream.md" > "$OUT/bench_stream.log" 2>&1
  echo "== bench_stream rc=$?"
  cat "$OUT/bench_stream.md" 2>/dev/null || tail -n 60 "$OUT/bench_stream.log"
fi

timeout 40 python3 benchmarks/bench_scope.py --backend cuda --iterations 3000 > "$OUT/bench_scope.log" 2>&1
echo "== bench_scope (cuda) rc=$?"; cat "$OUT/bench_scope.log"

if [ "${SKIP_COPY:-0}" != 1 ]; then
  timeout 150 python3 benchmarks/bench_copy.py --json "$OUT/bench_copy.json" --markdown "$OUT/bench_copy.md" \
    > "$OUT/bench_copy.log" 2>&1
  echo "== bench_copy rc=$?"; cat "$OUT/bench_copy.md" 2>/dev/null || tail -n 40 "$OUT/bench_copy.log"
fi
