#!/usr/bin/env bash
# A/B of bench_stream's Llama workloads under several settings, in one GPU call; logs in $OUT.
#   VARIANTS="default|--waiter hostfunc|--loop-poll-us 0" bash benchmarks/stream_ab.sh
# Each variant is one line of extra bench_stream options ("default": none), run in turn.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail "$OUT/pip.log"; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export BENCH_STREAM_WORKLOADS=${BENCH_STREAM_WORKLOADS:-llama-6MiB,llama-25MiB}
export BENCH_STREAM_SKIP=${BENCH_STREAM_SKIP:-cpu_offload,diffusers}
IFS='|' read -r -a variants <<< "${VARIANTS:-default}"
n=0
for v in "${variants[@]}"; do
  n=$((n + 1))
  args=$v; [ "$v" = default ] && args=""
  timeout "${VARIANT_TIMEOUT:-120}" python3 benchmarks/bench_stream.py --quick --only llama $args \
    --markdown "$OUT/ab_$n.md" > "$OUT/ab_$n.log" 2>&1
  echo "== variant $n: '$v' rc=$?"
  grep -E "prefill|decode|CPU ms" "$OUT/ab_$n.log" | grep -v "^|" | sed 's/^\[ *[0-9.]*s\] //'
done
