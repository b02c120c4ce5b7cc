#!/usr/bin/env bash
# A/B of the small-copy path on the GPU machine: the working tree against an older tree
# unpacked in build/ab_old (git archive <commit> aresidency benchmarks | tar -x -C build/ab_old,
# carried to the machine), alternating, because the host's speed drifts within a call.
# Prints diag_copy_timeline.py and diag_manager_copies.py for both, ROUNDS times (default 2).
set -u
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
for i in $(seq "${ROUNDS:-2}"); do
  for tree in . build/ab_old; do
    echo "== $tree (round $i)"
    (cd "$tree" && PYTHONPATH="$PWD:$SITE" timeout 100 python3 benchmarks/diag_copy_timeline.py --rounds 5 2>&1 | tail -3)
    (cd "$tree" && PYTHONPATH="$PWD:$SITE" timeout 100 python3 benchmarks/diag_manager_copies.py 2>&1 | tail -9 | grep -v "^|---")
  done
done
