#!/usr/bin/env bash
# The variants of benchmarks/diag_stream_hang.py in one device call (each bounded, each
# printing what a stalled call waits on), then the CUDA streaming tests that hung.
#   bash benchmarks/device_hang.sh
set -u
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
variant() {
  echo "=== diag_stream_hang $*"
  timeout -k 5 60 python3 benchmarks/diag_stream_hang.py "$@" 2>&1 | grep -v Warning
  echo "=== rc=${PIPESTATUS[0]}"
}
if [ -n "${VARIANTS:-}" ]; then
  while IFS= read -r line; do [ -n "$line" ] && variant $line; done <<< "$VARIANTS"
else
  variant --host pageable-host
  variant --host pageable-host --first-hand-out 16
  variant --host pageable-host --first-hand-out 100000 --checkpoint-every 100000
  variant --host pageable-host --thread-polls
  variant --host pinned-host
fi
