#!/usr/bin/env bash
# The serving stability run, which outlasts one device call: `start` launches bench_serve in a
# session of its own (it runs on while the machine stays warm), `collect` waits for it and copies
# its log, table and JSON (memory over time) to $OUT.
#
#   bash benchmarks/device_stability.sh start     # then, within the machine's idle time:
#   bash benchmarks/device_stability.sh collect
#
# STAB_ARGS overrides the run (default: 600 measured seconds of aresidency).
set -u
cd "$(dirname "$0")/.."
DIR=/tmp/stability
case "${1:-}" in
  start)
    mkdir -p "$DIR"
    PARTS=none OUT="$DIR/setup" bash benchmarks/device_all.sh > /dev/null
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site"
    setsid nohup python3 benchmarks/bench_serve.py ${STAB_ARGS:---seconds 600 --warmup 5 --tail 10 --methods aresidency} \
      --json "$DIR/serve.json" --markdown "$DIR/serve.md" > "$DIR/serve.log" 2>&1 < /dev/null &
    echo "started pid $! at $(date -u +%T)"
    ;;
  collect)
    limit=${WAIT:-570}
    for ((i = 0; i < limit; i += 5)); do
      [ -f "$DIR/serve.md" ] && ! pgrep -f bench_serve.py > /dev/null && break
      sleep 5
    done
    date -u +%T
    cp "$DIR"/serve.* "${OUT:-.}/" 2>/dev/null
    tail -n 40 "$DIR/serve.log"
    ;;
  *) echo "usage: $0 start|collect" >&2; exit 2 ;;
esac
