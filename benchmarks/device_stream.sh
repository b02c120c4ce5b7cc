#!/usr/bin/env bash
# One call on the GPU machine: the weight-streaming tests (the `cuda` ones included: the
# Hugging Face ones of tests/integrations/test_hf_streaming_cuda.py need transformers), the
# example, then the weight-streaming benchmark (matmul workloads, then Llama-shaped decoders). Logs land in $OUT (the device runner brings
# that folder back); the important lines are echoed.
#
#   bash benchmarks/device_stream.sh            # from anywhere; it cds to the repository root
#
# Budget: tests <= 200 s, example <= 60 s, benchmark <= 330 s (it aims at < 5 min).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  python3 -c "import accelerate; print('accelerate', accelerate.__version__)" 2>&1
  python3 -c "import safetensors; print('safetensors', safetensors.__version__)" 2>&1
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>&1
  python3 -c "import diffusers; print('diffusers', diffusers.__version__)" 2>&1 | tail -n 1
  echo "cpus $(nproc)"; free -g 2>/dev/null | head -n 2
} > "$OUT/env_stream.txt" 2>&1
cat "$OUT/env_stream.txt"

timeout 200 python3 -m pytest tests/integrations -q -rfEs -p no:cacheprovider \
  -o faulthandler_timeout=60 --junitxml="$OUT/junit_stream.xml" > "$OUT/pytest_stream.log" 2>&1
echo "== pytest tests/integrations rc=$?"
grep -E "passed|failed|error" "$OUT/pytest_stream.log" | tail -n 3
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest_stream.log" | head -n 20

timeout 60 python3 examples/02_weight_streaming.py > "$OUT/example_stream.log" 2>&1
echo "== examples/02_weight_streaming.py rc=$?"
tail -n 12 "$OUT/example_stream.log"

timeout 330 python3 benchmarks/bench_stream.py --json "$OUT/bench_stream.json" \
  --markdown "$OUT/bench_stream.md" > "$OUT/bench_stream.log" 2>&1
echo "== bench_stream rc=$?"
grep -E "^\[" "$OUT/bench_stream.log" | tail -n 80
echo
cat "$OUT/bench_stream.md" 2>/dev/null || tail -n 60 "$OUT/bench_stream.log"
grep -E "Traceback|Error" "$OUT/bench_stream.log" | head -n 20
