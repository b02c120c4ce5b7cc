"""The numbered examples run, on the simulated backend, and say what they show.

Every ``examples/NN_name.py`` runs as its own process with CUDA hidden
(``CUDA_VISIBLE_DEVICES=""``), so ``backend="auto"`` picks the simulation even on a GPU machine.
Importing torch costs seconds, so one runner process imports it once and forks a child per
example (each child runs the file as ``__main__`` and exits with its status): the whole set
runs in about the time of three plain ``python examples/...`` calls. Each test then checks
the exit status and a line the example prints. The numbering is checked too: consecutive from
01, each docstring titled "Explicit Example N: ..." or "Automatic Example N: ..." with N the
file's number, explicit ones first, and "Automatic Example 14" is the decision-evidence one
that docs/troubleshooting.md's step 5 sends readers to.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PATHS = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
TITLE = re.compile(r"^(Explicit|Automatic) Example (\d+): \S")

# What each example must print (a line that shows it did what its docstring says).
EXPECTED = {
    "01_explicit.py": ["acquire refused as expected", "scope committed"],
    "02_register_and_move.py": ["after discard: weights @ pinned-host"],
    "03_acquire_with_streams.py": ["low-level lease read sum = 1024", "cuda:0 used 0 B"],
    "04_holds_and_protection.py": [
        "move refused: use_count=0 hold_count=1",
        "move refused while task 'decode-step-7' holds a lease",
        "moved: kv-cache now at pinned-host",
    ],
    "05_reservations.py": ["refused: kind=reservation handle=None"],
    "06_scopes_and_explain.py": [
        "explain: feasible=True",
        "explain: feasible=False",
        "cause ResidencyBudgetError",
    ],
    "07_plan_execution_errors.py": [
        "phase=enter failed_action_index=0",
        "cause: OSError: checkpoint shard 3 is truncated",
        "now: old @ pinned-host; new @ nowhere",
    ],
    "08_pending_operations.py": ["cancelled=True", "layer2 still at pinned-host"],
    "09_snapshot_trace_json.py": ["round trip equal: True", '"kind": "materialization"'],
    "10_fault_injection.py": [
        "injected transfer failure",
        "injected out-of-memory: OutOfMemoryError",
        "without faults: weights at cuda:0",
    ],
    "11_controller_decide_and_scope.py": ["evict Eviction(", "on cuda:0 afterwards:"],
    "12_fallbacks.py": ["expert-b @ pinned-host (fallback #1)", "-> pageable-host)"],
    "13_stale_decisions_and_waiting.py": [
        "stale: expected v",
        "admitted after the lease ended: True",
    ],
    "14_automatic_decision_evidence.py": [
        "explored_states:",
        "the held value is never a victim: True",
        "every requested endpoint in place: True",
    ],
    "15_search_limits.py": ["limit 2: inconclusive", "infeasible: ResidencyPlanError"],
    "16_weight_streaming.py": ["bit-identical to the model run entirely on cpu: True"],
    "17_data_loader.py": [
        "24 batches of 1 MiB, in order: True",
        "every step read its batch as the source made it: True",
        "MiB: True",
        "nothing left at cuda:0 after the loader closed: True",
        "shared memory given back without the interpreter lock",
    ],
}

# Imports torch and the package once, then forks a child per example: the child's stdout and
# stderr go to a file, it runs the example as __main__ and exits with its status (killed after
# 60 s, so one example that hangs fails alone).
RUNNER = r"""
import json, os, runpy, signal, sys, tempfile, time, traceback
import torch
import aresidency

results = {}
for path in sys.argv[1:]:
    out = tempfile.TemporaryFile()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a hanging example dies (SIGALRM) and the others still run
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.argv = [path]
        code = 0
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    results[os.path.basename(path)] = {
        "rc": os.waitstatus_to_exitcode(status),
        "seconds": time.perf_counter() - start,
        "output": out.read().decode(errors="replace"),
    }
print(json.dumps(results))
"""


def _title(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    assert docstring, f"{path.name} has no docstring"
    return docstring.splitlines()[0]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    if not hasattr(os, "fork"):
        pytest.skip("the example runner forks (POSIX only)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *map(str, PATHS)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=EXAMPLES.parent,
        check=False,
    )
    assert done.returncode == 0, f"the example runner failed:\n{done.stderr[-4000:]}"
    results: dict[str, dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_example_runs_on_the_simulation_and_prints_what_it_shows(
    path: Path, runs: dict[str, dict[str, Any]]
) -> None:
    result = runs[path.name]
    output = result["output"]
    assert result["rc"] == 0, f"{path.name} exited {result['rc']}:\n{output[-4000:]}"
    assert "a simulation of CUDA devices" in output, f"{path.name} hides that it ran simulated"
    for expected in EXPECTED[path.name]:
        assert expected in output, f"{path.name} did not print {expected!r}:\n{output}"
    assert result["seconds"] < 15, f"{path.name} took {result['seconds']:.1f} s"


def test_every_example_has_an_expected_output_line() -> None:
    assert sorted(EXPECTED) == [path.name for path in PATHS]


def test_examples_are_numbered_consecutively_with_titles_that_match() -> None:
    numbers = [int(path.name[:2]) for path in PATHS]
    assert numbers == list(range(1, len(PATHS) + 1)), [path.name for path in PATHS]
    assert len(PATHS) >= 14
    kinds = []
    for path, number in zip(PATHS, numbers, strict=True):
        match = TITLE.match(_title(path))
        assert match, f"{path.name}: title {_title(path)!r} is not 'Explicit/Automatic Example N'"
        assert int(match.group(2)) == number, f"{path.name} is titled {match.group(0)!r}"
        kinds.append(match.group(1))
    # Explicit examples first, then automatic ones.
    assert kinds == sorted(kinds, key=["Explicit", "Automatic"].index)
    assert "Explicit" in kinds and "Automatic" in kinds


def test_automatic_example_14_is_the_decision_evidence_example_of_step_5() -> None:
    (path,) = [path for path in PATHS if path.name.startswith("14_")]
    assert "decision_evidence" in path.name
    title = _title(path)
    assert title.startswith("Automatic Example 14: ")
    assert "decision evidence" in title
    source = path.read_text()
    # What docs/troubleshooting.md's step 5 prints, in the example.
    for field in (
        "expected_state_version",
        "explored_states",
        "evictions",
        "plan.reclaim",
        "plan.enter",
        "predicted_peak_bytes",
    ):
        assert field in source, f"Automatic Example 14 does not show {field}"


def test_the_readme_demo_is_example_1_and_uses_the_gpu_when_there_is_one() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    assert "examples/01_explicit.py" in readme
    assert 'backend="auto"' in (EXAMPLES / "01_explicit.py").read_text()
