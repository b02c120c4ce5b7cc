#!/usr/bin/env bash
# One call on the GPU machine: the backends' tests (the `cuda` ones included), then the copy and
# event wake-up benchmarks. Logs land in $OUT (the device runner brings that folder back).
#
#   bash benchmarks/device_backends.sh            # from the repository root
#
# Budget: tests <= 100 s, benchmark <= 140 s, wake-up on uvloop <= 25 s.
set -u
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  echo "cpus $(nproc)"; cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout 100 python3 -m pytest tests/backends -q -rfE -p no:cacheprovider \
  --junitxml="$OUT/junit.xml" > "$OUT/pytest.log" 2>&1
echo "== pytest tests/backends rc=$?"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -n 3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 20

timeout 140 python3 benchmarks/bench_copy.py --json "$OUT/bench.json" --markdown "$OUT/bench.md" \
  > "$OUT/bench.log" 2>&1
echo "== bench_copy rc=$?"
tail -n 70 "$OUT/bench.log"

timeout 25 python3 benchmarks/bench_copy.py --wakeup-only --uvloop --json "$OUT/wakeup_uvloop.json" \
  > "$OUT/wakeup_uvloop.log" 2>&1
echo "== wake-up on uvloop rc=$?"
grep -E "waiter|poll|thread|idle" "$OUT/wakeup_uvloop.log" | head -n 12
