"""Dumps and the command line: ``manager.dump(path, error)`` writes the evidence as JSON and
``python -m aresidency diagnose PATH`` prints the report ``diagnose(error, manager)`` gives,
with ``rich`` or as plain text; ``... timeline DUMP OUT`` writes the Chrome trace. The CLI runs
in a subprocess (``sys.executable -m aresidency``), as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch

from aresidency import ResidencyBudgetError, ResidencyManager, ResidencyPlan, diagnose
from aresidency.core import Move
from aresidency.diagnosis import diagnose_dump, read_dump

KiB = 1 << 10
ROOT = Path(__file__).resolve().parents[2]


def tensor(kib: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.full((kib * 256,), float(seed))


async def _fail_and_dump(path: Path) -> tuple[str, dict]:
    """A plan that cannot fit, dumped with its error; returns the live report (text, dict)."""
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        m.register(tensor(seed=1), name="resident", location="cuda:0")
        b = m.register(tensor(seed=2), name="b")
        c = m.register(tensor(seed=3), name="c")
        with pytest.raises(Exception) as caught:
            await m.execute(ResidencyPlan(enter=[Move(b, "cuda:0"), Move(c, "cuda:0")]))
        report = diagnose(caught.value, m)
        m.dump(path, caught.value)
        return str(report), report.to_dict()


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict]:
    """One dump for the command-line tests (made once: each CLI run starts Python and torch)."""
    path = tmp_path_factory.mktemp("dump") / "failure.json"
    text, data = anyio.run(_fail_and_dump, path)
    return path, text, data


def run_cli(*args: str, path: Sequence[Path] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "120"}
    entries = [*map(str, path), str(ROOT), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, entries))
    return subprocess.run(
        [sys.executable, "-m", "aresidency", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.anyio
async def test_a_dump_gives_the_same_report_as_the_live_diagnosis(tmp_path: Path) -> None:
    text, data = await _fail_and_dump(tmp_path / "d.json")
    report = diagnose_dump(tmp_path / "d.json")
    assert str(report) == text
    assert report.to_dict() == data
    error, evidence = read_dump(tmp_path / "d.json")
    assert error is not None and error["type"] == "ResidencyPlanError"
    assert error["cause"]["type"] == "ResidencyBudgetError"
    assert evidence.explanation is not None and evidence.explanation["feasible"] is False
    assert report.step(3).evidence["missing_bytes"] == 4 * KiB


@pytest.mark.anyio
async def test_a_dump_after_the_manager_closed_and_one_without_an_error(tmp_path: Path) -> None:
    async with ResidencyManager(budgets={"cuda:0": 4 * KiB}, backend="sim") as m:
        h = m.register(tensor(), name="w")
        m.dump(tmp_path / "state.json")
        big = m.register(tensor(kib=8), name="big")
        try:
            await m.move(big, "cuda:0")
        except ResidencyBudgetError as error:
            failure = error
    version = m.state_version
    m.dump(tmp_path / "closed.json", failure)  # the state of a closed manager stays readable
    closed = diagnose_dump(tmp_path / "closed.json")
    assert closed.state_version == version and closed.step(3).evidence["kind"] == "materialization"
    state_only = diagnose_dump(tmp_path / "state.json")
    assert state_only.error_type is None
    assert [s.number for s in state_only.steps] == [1, 8]
    assert state_only.step(1).evidence["values"] == 1
    del h


def test_the_cli_prints_the_report_as_plain_text(dumped: tuple[Path, str, dict]) -> None:
    path, text, _ = dumped
    result = run_cli("diagnose", str(path), "--plain")
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"


def test_the_cli_draws_the_report_with_rich(dumped: tuple[Path, str, dict]) -> None:
    pytest.importorskip("rich")
    path, _, data = dumped
    result = run_cli("diagnose", str(path))
    assert result.returncode == 0, result.stderr
    for step in data["steps"]:
        assert f"Step {step['number']}. {step['title']}" in result.stdout
    assert "Next action:" in result.stdout
    assert "4096 B missing" in result.stdout
    assert "\u256d" in result.stdout  # a rich panel's corner: drawn, not the plain text


def test_the_cli_prints_plain_text_when_rich_is_not_installed(
    dumped: tuple[Path, str, dict], tmp_path: Path
) -> None:
    # A ``rich`` package first on the path that fails to import, as if it were not installed.
    (tmp_path / "rich").mkdir()
    (tmp_path / "rich" / "__init__.py").write_text('raise ImportError("no rich here")\n')
    path, text, _ = dumped
    result = run_cli("diagnose", str(path), path=[tmp_path])
    assert result.returncode == 0, result.stderr
    assert result.stdout == text + "\n"


def test_the_cli_prints_the_report_as_json(dumped: tuple[Path, str, dict]) -> None:
    path, _, data = dumped
    result = run_cli("diagnose", str(path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads(json.dumps(data))


def test_the_cli_writes_the_dumps_timeline(dumped: tuple[Path, str, dict], tmp_path: Path) -> None:
    path, _, _ = dumped
    out = tmp_path / "timeline.json"
    result = run_cli("timeline", str(path), str(out))
    assert result.returncode == 0, result.stderr
    events = json.loads(out.read_text())["traceEvents"]
    assert any(e["ph"] == "C" and e["name"] == "cuda:0 bytes" for e in events)


def test_the_cli_refuses_a_file_that_is_not_a_dump(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.json"
    bogus.write_text(json.dumps({"hello": 1}))
    result = run_cli("diagnose", str(bogus))
    assert result.returncode == 2
    assert "not an aresidency dump" in result.stderr and "manager.dump" in result.stderr
    missing = run_cli("diagnose", str(tmp_path / "missing.json"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


@pytest.mark.parametrize(
    "spoil, says",
    [
        (lambda d: d.update(captured_unix_s=None), "not a well-formed dump"),
        (lambda d: d.update(error="oops"), "its 'error' is a str, not an error record"),
        (
            lambda d: d["error"]["cause"].update(budget_bytes="abc"),
            "error record is not well-formed",
        ),
        (lambda d: d["snapshot"].update(locations="?"), "not a well-formed dump"),
    ],
    ids=["captured", "error-str", "error-field", "snapshot"],
)
def test_the_cli_explains_a_dump_it_cannot_read_and_exits_2(
    dumped: tuple[Path, str, dict],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    spoil: object,
    says: str,
) -> None:
    """A hand-edited or truncated dump: a message naming what is wrong, exit status 2, no
    traceback (the CLI in process: what ``python -m aresidency`` runs)."""
    from aresidency.diagnosis.cli import main

    path, _, _ = dumped
    data = json.loads(path.read_text())
    spoil(data)  # type: ignore[operator]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["diagnose", str(bad), "--plain"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_the_cli_says_when_it_cannot_write_the_timeline(
    dumped: tuple[Path, str, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aresidency.diagnosis.cli import main

    path, _, _ = dumped
    assert main(["timeline", str(path), str(tmp_path / "no" / "such" / "dir.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.anyio
async def test_dump_names_an_error_argument_that_is_not_an_exception(tmp_path: Path) -> None:
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(TypeError, match="error is the exception that was raised"):
            m.dump(tmp_path / "d.json", "not an error")  # type: ignore[arg-type]
        assert not (tmp_path / "d.json").exists()


def test_the_cli_stops_quietly_when_its_reader_goes_away(dumped: tuple[Path, str, dict]) -> None:
    """``python -m aresidency diagnose DUMP | head``: a reader that stops early broke the pipe,
    and the CLI ended in a BrokenPipeError traceback. Here the pipe's reading end is closed
    before the CLI starts, so its first write fails."""
    path, _, _ = dumped
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    try:
        result = subprocess.run(
            [sys.executable, "-m", "aresidency", "diagnose", str(path), "--plain"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
