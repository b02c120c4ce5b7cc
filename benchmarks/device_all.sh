#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: the tests marked cuda/cuda2 (real GPU backend),
# the examples, and the benchmarks whose figures go to benchmarks/RESULTS.md. Logs land in $OUT.
#
#   bash benchmarks/device_all.sh            # from the repository root, on the GPU machine
#
# PARTS picks what runs (default: all of "tests examples copy scope stream loader serve";
# "overhead", the host time per pool call, "profile", where the manager's small copies
# spend host time, and "diag", the small copies' parts and the host's shard read rate, run
# only when named (diag also times the loop's lag while threads read files); "none": nothing
# but the wheels);
# TEST_PATHS narrows the test directories; TEST_K the tests, with pytest -k (for example
# "not uvloop and not trio": asyncio only). STREAM_ARGS, LOADER_ARGS, SERVE_ARGS pass options
# (such as --quick) to those benchmarks; SCOPE_QUICK=1 runs bench_scope on asyncio only;
# EXAMPLES names the examples to run (default: all of examples/[0-9]*.py).
# Wheels the machine lacks (it has no network) travel in .whl/ and are installed to /tmp/site.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PARTS=${PARTS:-"tests examples copy scope stream loader serve"}
# Installed once per machine: a process started earlier (setsid) may still be importing from there.
if compgen -G ".whl/*.whl" > /dev/null; then
  if [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 && touch /tmp/site/.installed \
      || { echo "wheel install failed"; tail "$OUT/pip.log"; }
  fi
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
has() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import sys, importlib.metadata, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'anyio', importlib.metadata.version('anyio'))"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if has tests; then
  # SIGINT first: pytest still prints its summary when the time runs out; -v names every test.
  # The package is not installed here (PYTHONPATH): load its pytest plugin by name.
  PLUGIN=$(python3 -c "import importlib.metadata as m; print('' if any(e.name == 'aresidency' for e in m.entry_points(group='pytest11')) else '-p aresidency.testing.plugin')")
  timeout -s INT -k 20 "${TEST_TIMEOUT:-280}" python3 -m pytest ${TEST_PATHS:-tests} -v -rfE --tb=short \
    -p no:cacheprovider -p no:asyncio $PLUGIN -m "cuda or cuda2" -k "${TEST_K:-}" \
    --timeout="${PER_TEST_TIMEOUT:-60}" -o faulthandler_timeout=45 > "$OUT/pytest_cuda.log" 2>&1
  echo "== pytest -m 'cuda or cuda2' -k '${TEST_K:-}' rc=$?"
  grep -E "passed|failed|error" "$OUT/pytest_cuda.log" | tail -n 2
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda.log" | head -n 30
  grep -E "^E  " "$OUT/pytest_cuda.log" | sort | uniq -c | sort -rn | head -n 15
fi

if has examples; then
  for ex in ${EXAMPLES:-examples/[0-9]*.py}; do
    timeout 90 python3 "$ex" > "$OUT/$(basename "$ex" .py).log" 2>&1
    echo "== $ex rc=$?"; tail -n 3 "$OUT/$(basename "$ex" .py).log"
  done
fi

if has copy; then
  timeout "${COPY_TIMEOUT:-300}" python3 benchmarks/bench_copy.py --json "$OUT/bench_copy.json" \
    --markdown "$OUT/bench_copy.md" > "$OUT/bench_copy.log" 2>&1
  echo "== bench_copy rc=$?"; cat "$OUT/bench_copy.md" 2>/dev/null || tail -n 40 "$OUT/bench_copy.log"
  timeout 120 python3 benchmarks/bench_copy.py --wakeup-only --uvloop \
    --markdown "$OUT/bench_copy_uvloop.md" > "$OUT/bench_copy_uvloop.log" 2>&1
  echo "== bench_copy --wakeup-only --uvloop rc=$?"; cat "$OUT/bench_copy_uvloop.md" 2>/dev/null
fi

if has scope; then
  timeout 90 python3 benchmarks/bench_scope.py --backend cuda --iterations 3000 > "$OUT/bench_scope.log" 2>&1
  echo "== bench_scope (cuda, asyncio) rc=$?"; cat "$OUT/bench_scope.log"
  [ -n "${SCOPE_QUICK:-}" ] || timeout 90 python3 benchmarks/bench_scope.py --backend cuda --iterations 3000 --uvloop > "$OUT/bench_scope_uvloop.log" 2>&1
  echo "== bench_scope (cuda, uvloop) rc=$?"; cat "$OUT/bench_scope_uvloop.log"
  [ -n "${SCOPE_QUICK:-}" ] || timeout 60 python3 benchmarks/bench_scope.py --backend cuda --iterations 1000 --profile > "$OUT/bench_scope_profile.log" 2>&1
  echo "== bench_scope --profile rc=$?"; head -n 50 "$OUT/bench_scope_profile.log"
fi

if has stream; then
  timeout "${STREAM_TIMEOUT:-300}" python3 benchmarks/bench_stream.py ${STREAM_ARGS:-} --json "$OUT/bench_stream.json" \
    --markdown "$OUT/bench_stream.md" > "$OUT/bench_stream.log" 2>&1
  echo "== bench_stream rc=$?"
  cat "$OUT/bench_stream.md" 2>/dev/null || tail -n 60 "$OUT/bench_stream.log"
fi

if has loader && [ -f benchmarks/bench_loader.py ]; then
  timeout "${LOADER_TIMEOUT:-240}" python3 benchmarks/bench_loader.py ${LOADER_ARGS:-} > "$OUT/bench_loader.log" 2>&1
  echo "== bench_loader rc=$?"; grep -v "^\[bench_loader [0-9:]*\]  *[0-9.]*%" "$OUT/bench_loader.log" | tail -n 40
fi

if has overhead; then
  timeout 120 python3 benchmarks/bench_call_overhead.py --backend cuda > "$OUT/bench_call_overhead.log" 2>&1
  echo "== bench_call_overhead rc=$?"; tail -n 8 "$OUT/bench_call_overhead.log"
fi

if has diag; then
  timeout 120 python3 benchmarks/diag_manager_copies.py > "$OUT/diag_manager_copies.log" 2>&1
  echo "== diag_manager_copies rc=$?"; tail -n 12 "$OUT/diag_manager_copies.log"
  timeout 150 python3 benchmarks/diag_shard_reads.py --with-dma --threads 1,4,8,16 --gib 2 \
    > "$OUT/diag_shard_reads.log" 2>&1
  echo "== diag_shard_reads rc=$?"; tail -n 14 "$OUT/diag_shard_reads.log"
  timeout 120 python3 benchmarks/diag_loop_convoy.py > "$OUT/diag_loop_convoy.log" 2>&1
  echo "== diag_loop_convoy rc=$?"; tail -n 15 "$OUT/diag_loop_convoy.log"
fi

if has profile; then
  # The raw profiles come back too (*.prof): read them with pstats on any machine.
  timeout 120 python3 benchmarks/profile_manager_copies.py --backend cuda \
    --dump "$OUT/manager_copies_tasks.prof" > "$OUT/profile_manager_copies.log" 2>&1
  echo "== profile_manager_copies rc=$?"; head -n 25 "$OUT/profile_manager_copies.log"
  timeout 120 python3 benchmarks/profile_manager_copies.py --backend cuda --one-plan \
    --dump "$OUT/manager_copies_plan.prof" > "$OUT/profile_manager_copies_plan.log" 2>&1
  echo "== profile_manager_copies --one-plan rc=$?"; head -n 3 "$OUT/profile_manager_copies_plan.log"
  timeout 60 python3 benchmarks/bench_scope.py --backend cuda --iterations 1000 --profile \
    --dump "$OUT/scope.prof" > "$OUT/bench_scope_profile.log" 2>&1
  echo "== bench_scope --profile rc=$?"; head -n 3 "$OUT/bench_scope_profile.log"
fi

if has serve && [ -f benchmarks/bench_serve.py ]; then
  timeout "${SERVE_TIMEOUT:-240}" python3 benchmarks/bench_serve.py ${SERVE_ARGS:-} > "$OUT/bench_serve.log" 2>&1
  echo "== bench_serve rc=$?"; tail -n 40 "$OUT/bench_serve.log"
fi

# The tests' outcome once more at the very end: a caller that keeps only the output's tail (a
# long benchmark table pushes the first lines out) still sees it.
if has tests; then
  echo "== summary: pytest -m 'cuda or cuda2' -k '${TEST_K:-}'"
  grep -E "passed|failed|error" "$OUT/pytest_cuda.log" | tail -n 1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_cuda.log" | head -n 10
fi
