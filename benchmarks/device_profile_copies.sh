#!/usr/bin/env bash
# Where the host time of small copies goes on the GPU: the parts of 64 x 4 MB copies with the
# device's own span beside the host's total (diag_manager_copies.py), then the manager's 64 x 4 MB copies, a task
# each and in one plan, and a scope moving 4 KiB in and out, under cProfile (raw profiles in
# $OUT for pstats elsewhere), then the loader's quick benchmark unless NO_LOADER is set.   bash benchmarks/device_profile_copies.sh
set -u
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh
python3 benchmarks/diag_host_speed.py
timeout 120 python3 benchmarks/diag_manager_copies.py --backend cuda --rounds 15 \
  > "$OUT/diag-copies.log" 2>&1
echo "== diag_manager_copies rc=$?"
tail -n 20 "$OUT/diag-copies.log"
for mode in tasks one-plan; do
  flag=""
  [ "$mode" = one-plan ] && flag=--one-plan
  timeout 90 python3 benchmarks/profile_manager_copies.py --backend cuda --rounds 20 --top 45 \
    $flag --dump "$OUT/copies-$mode.prof" > "$OUT/profile-$mode.log" 2>&1
  echo "== profile $mode rc=$?"
  head -n 1 "$OUT/profile-$mode.log"
done
timeout 90 python3 benchmarks/bench_scope.py --backend cuda --profile --dump "$OUT/scope.prof" \
  > "$OUT/profile-scope.log" 2>&1
echo "== profile scope rc=$?"
head -n 40 "$OUT/profile-scope.log"
[ -n "${NO_LOADER:-}" ] || {
  timeout -s INT 300 python3 benchmarks/bench_loader.py ${LOADER_ARGS:---quick} \
    --markdown "$OUT/loader.md" > "$OUT/loader.log" 2>&1
  echo "== bench_loader rc=$?"
  cat "$OUT/loader.md" 2>/dev/null || tail -n 30 "$OUT/loader.log"
}
