#!/usr/bin/env bash
# One device call that does a round's GPU work: the CUDA tests (benchmarks/device_final.sh),
# the copy, loader and host-memcpy measurements, each bounded, logs and markdown in $OUT.
#
#   bash benchmarks/device_round.sh                 # from the repository root, on the GPU machine
#   PARTS="copy tests" COPY_ARGS=--staging-only ONLY_ASYNCIO=1 bash benchmarks/device_round.sh
#
# PARTS picks what runs, in its order (default "tests copy loader memcpy single"); COPY_ARGS and
# LOADER_ARGS pass options to bench_copy.py and bench_loader.py (LOADER_ARGS defaults to
# --quick); ASYNCIO_TIMEOUT, UVLOOP_TIMEOUT and ONLY_ASYNCIO go to device_final.sh.
set -u
cd "$(dirname "$0")/.."
. benchmarks/device_env.sh
PARTS=${PARTS:-"tests copy loader memcpy single"}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log -1 --format='%h %s' 2>/dev/null | cut -c1-100
for part in $PARTS; do
  case $part in
    tests)
      ASYNCIO_TIMEOUT=${ASYNCIO_TIMEOUT:-330} UVLOOP_TIMEOUT=${UVLOOP_TIMEOUT:-110} \
        bash benchmarks/device_final.sh
      ;;
    copy)
      timeout -s INT 180 python3 benchmarks/bench_copy.py ${COPY_ARGS:-} \
        --markdown "$OUT/copy.md" > "$OUT/copy.log" 2>&1
      echo "== bench_copy ${COPY_ARGS:-} rc=$?"
      grep -E "^streaming host copy" "$OUT/copy.log"
      cat "$OUT/copy.md" 2>/dev/null || tail -n 40 "$OUT/copy.log"
      ;;
    loader)
      timeout -s INT 240 python3 benchmarks/bench_loader.py ${LOADER_ARGS:---quick} \
        --markdown "$OUT/loader.md" > "$OUT/loader.log" 2>&1
      echo "== bench_loader rc=$?"
      cat "$OUT/loader.md" 2>/dev/null || tail -n 30 "$OUT/loader.log"
      ;;
    memcpy)
      timeout 60 python3 benchmarks/diag_host_memcpy.py --both > "$OUT/memcpy.log" 2>&1
      echo "== diag_host_memcpy rc=$?"
      cat "$OUT/memcpy.log"
      GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000 timeout 60 \
        python3 benchmarks/diag_host_memcpy.py --both --threads 4,8,16 > "$OUT/memcpy_nt.log" 2>&1
      echo "== diag_host_memcpy, non-temporal from 1 MiB rc=$?"
      cat "$OUT/memcpy_nt.log"
      ;;
    single)
      timeout 90 python3 benchmarks/diag_single_copy.py > "$OUT/single.log" 2>&1
      echo "== diag_single_copy rc=$?"
      cat "$OUT/single.log"
      ;;
    *) echo "unknown part $part" ;;
  esac
done
