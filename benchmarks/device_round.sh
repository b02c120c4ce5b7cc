#!/usr/bin/env bash
# One device call that does a round's GPU work: the CUDA tests (benchmarks/device_final.sh),
# then the copy, loader and host-memcpy measurements, each bounded, logs and markdown in $OUT.
#
#   bash benchmarks/device_round.sh                 # from the repository root, on the GPU machine
#
# PARTS picks what runs (default "tests copy loader memcpy single"); COPY_ARGS and LOADER_ARGS pass
# options to bench_copy.py and bench_loader.py (LOADER_ARGS defaults to --quick).
set -u
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh
PARTS=${PARTS:-"tests copy loader memcpy single"}
has() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log -1 --format='%h %s' 2>/dev/null | cut -c1-100
if has tests; then
  ASYNCIO_TIMEOUT=${ASYNCIO_TIMEOUT:-330} UVLOOP_TIMEOUT=${UVLOOP_TIMEOUT:-110} \
    bash benchmarks/device_final.sh
fi
if has copy; then
  timeout -s INT 180 python3 benchmarks/bench_copy.py ${COPY_ARGS:-} --markdown "$OUT/copy.md" \
    > "$OUT/copy.log" 2>&1
  echo "== bench_copy rc=$?"
  cat "$OUT/copy.md" 2>/dev/null || tail -n 40 "$OUT/copy.log"
fi
if has loader; then
  timeout -s INT 150 python3 benchmarks/bench_loader.py ${LOADER_ARGS:---quick} \
    --markdown "$OUT/loader.md" > "$OUT/loader.log" 2>&1
  echo "== bench_loader rc=$?"
  cat "$OUT/loader.md" 2>/dev/null || tail -n 30 "$OUT/loader.log"
fi
if has memcpy; then
  timeout 60 python3 benchmarks/diag_host_memcpy.py --both > "$OUT/memcpy.log" 2>&1
  echo "== diag_host_memcpy rc=$?"
  cat "$OUT/memcpy.log"
  GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000 timeout 60 \
    python3 benchmarks/diag_host_memcpy.py --both --threads 4,8,16 > "$OUT/memcpy_nt.log" 2>&1
  echo "== diag_host_memcpy, non-temporal from 1 MiB rc=$?"
  cat "$OUT/memcpy_nt.log"
fi
if has single; then
  timeout 90 python3 benchmarks/diag_single_copy.py > "$OUT/single.log" 2>&1
  echo "== diag_single_copy rc=$?"
  cat "$OUT/single.log"
fi
