#!/usr/bin/env bash
# bench_loader.py's shard source under several read settings, one after another in one call of
# the GPU machine (compute and shards only; a table line each for steps/s, GPU idle, loop lag).
#   VARIANTS="--shard-workers 8|--shard-read mapping --shard-workers 1" bash benchmarks/loader_variants.sh
# Run from the repository root after `PARTS=none bash benchmarks/device_all.sh` (the wheels).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site"
BASE=${BASE:-"--quick --sizes 16,64 --compute-factor 3 --methods compute,aresidency_shards"}
IFS='|' read -r -a variants <<< "${VARIANTS:-}"
# No VARIANTS (or an empty one): BASE alone, once (read -a gives no element for "").
[ "${#variants[@]}" -gt 0 ] || variants=("")
for variant in "${variants[@]}"; do
  echo "== $variant"
  # shellcheck disable=SC2086
  timeout 120 python3 benchmarks/bench_loader.py $BASE $variant 2>&1 \
    | grep -E "MiB (steps/s|GPU idle %|loop lag)|^source:" | sed -E 's/\| error: not run //g'
done
