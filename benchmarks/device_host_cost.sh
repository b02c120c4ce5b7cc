#!/usr/bin/env bash
# Where the runtime's host time goes on the GPU's host, in one call: the scope table on the
# instant simulation and on CUDA, the small copies' parts, and two raw profiles in $OUT (read
# them with pstats here).   OUT=$OUT bash benchmarks/device_host_cost.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() { echo "== $*"; timeout 150 "$@" 2>&1 | tail -n 25; }
step python3 benchmarks/bench_scope.py --backend instant --iterations 3000
step python3 benchmarks/bench_scope.py --backend cuda --iterations 3000
step python3 benchmarks/diag_manager_copies.py --rounds 15 ${DIAG_ARGS:-}
python3 benchmarks/bench_scope.py --backend cuda --iterations 2000 --profile \
  --dump "$OUT/scope_cuda.prof" > "$OUT/scope_cuda.txt" 2>&1
head -n 3 "$OUT/scope_cuda.txt"
python3 benchmarks/profile_manager_copies.py --backend cuda --rounds 10 \
  --dump "$OUT/copies_cuda.prof" > "$OUT/copies_cuda.txt" 2>&1
head -n 2 "$OUT/copies_cuda.txt"
step python3 benchmarks/diag_copy_timeline.py --size 64MiB --count 1 --rounds 9
step python3 benchmarks/diag_copy_timeline.py --size 4MiB --count 64 --rounds 7
if [ -n "${WITH_BENCH_COPY:-}" ]; then
  timeout 300 python3 benchmarks/bench_copy.py --markdown "$OUT/bench_copy.md" > "$OUT/bench_copy.txt" 2>&1
  echo "== bench_copy rc=$?"; cat "$OUT/bench_copy.md"
fi
