"""progress(): a tqdm bar on a real terminal and silence elsewhere, start/end/failure log records
either way, no hard dependency on tqdm, and thread-safe counting."""

from __future__ import annotations

import io
import logging
import os
import select
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from aresidency.progress import Progress, progress

MiB = 1024**2

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="uses a POSIX pseudo-terminal")


class Terminal:
    """A pseudo-terminal: ``stream`` is the slave end progress() writes to; ``read`` collects
    what arrived at the master end, as a user's terminal would show it."""

    def __init__(self) -> None:
        import fcntl
        import struct
        import termios

        master, slave = os.openpty()
        # A real window size: tqdm sizes its bar from the terminal, and a new pty has 0 columns.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
        os.set_blocking(master, False)
        self.master = master
        self.stream = os.fdopen(slave, "w", encoding="utf-8")

    def read(self, until: str | None = None, timeout: float = 5.0) -> str:
        """Everything written so far: wait up to ``timeout`` s for ``until`` to appear, or, with
        no ``until``, until nothing more arrives for 0.3 s (a pty delivers asynchronously)."""
        self.stream.flush()
        received = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            wait = 0.3 if until is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.master], [], [], wait)
            if not ready:
                if until is None:
                    break
                continue
            try:
                chunk = os.read(self.master, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            received += chunk
            if until is not None and until in received.decode("utf-8", "replace"):
                break
        return received.decode("utf-8", "replace")

    def close(self) -> None:
        self.stream.close()
        os.close(self.master)


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    term = Terminal()
    assert term.stream.isatty()
    yield term
    term.close()


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="aresidency")
    return caplog


def _messages(caplog: pytest.LogCaptureFixture, name: str = "aresidency") -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == name]


class FakeTqdm:
    """Stands in for ``tqdm.tqdm``: records its arguments, and updates its count the way a
    non-atomic counter does, letting other threads run between reading and writing it."""

    made: list[FakeTqdm] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.n = 0
        self.closed = False
        FakeTqdm.made.append(self)

    def update(self, n: float | None = 1) -> bool | None:
        before = self.n
        time.sleep(0)  # releases the GIL: an unguarded concurrent update loses counts here
        self.n = before + int(n or 0)
        return None

    def close(self) -> None:
        self.closed = True


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def fake_tqdm(monkeypatch: pytest.MonkeyPatch) -> type[FakeTqdm]:
    module = types.ModuleType("tqdm")
    module.tqdm = FakeTqdm  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tqdm", module)
    monkeypatch.setattr(FakeTqdm, "made", [])
    return FakeTqdm


# --- the bar ---------------------------------------------------------------------------------


def test_a_bar_is_drawn_on_a_terminal(terminal, records):
    pytest.importorskip("tqdm")
    with progress("load shards", total=4 * MiB, stream=terminal.stream) as report:
        for _ in range(4):
            report.update(MiB)
    shown = terminal.read(until="100%")
    assert "load shards" in shown
    assert "100%" in shown
    # Bytes are scaled by 1024: 4 MiB shows as 4.00M (by 1000 it would be 4.19M).
    assert "4.00M/4.00M" in shown
    assert "B/s" in shown


def test_a_bar_for_another_unit_counts_plain_units(terminal):
    pytest.importorskip("tqdm")
    with progress("move tensors", total=3, unit="tensor", stream=terminal.stream) as report:
        for _ in range(3):
            report.update()
    shown = terminal.read(until="3/3")
    assert "move tensors" in shown
    assert "3/3" in shown
    assert "tensor/s" in shown


def test_nothing_is_written_to_a_stream_that_is_not_a_terminal(records):
    pytest.importorskip("tqdm")
    stream = io.StringIO()
    with progress("load shards", total=2 * MiB, stream=stream) as report:
        report.update(MiB)
        report.update(MiB)
    assert stream.getvalue() == ""
    assert report.done == 2 * MiB


def test_stderr_is_the_default_stream(monkeypatch, fake_tqdm):
    stderr = FakeTty()
    monkeypatch.setattr(sys, "stderr", stderr)
    with progress("load", total=10):
        pass
    assert len(fake_tqdm.made) == 1
    assert fake_tqdm.made[0].kwargs["file"] is stderr


def test_a_non_terminal_stderr_gets_no_bar(monkeypatch, fake_tqdm):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress("load", total=10) as report:
        report.update(10)
    assert fake_tqdm.made == []
    assert sys.stderr.getvalue() == ""


def test_a_bytes_bar_is_scaled_by_1024_and_delayed_by_min_seconds(fake_tqdm):
    stream = FakeTty()
    with progress("pin", total=5 * MiB, stream=stream, min_seconds=2.5) as report:
        report.update(5 * MiB)
    (bar,) = fake_tqdm.made
    assert bar.kwargs["desc"] == "pin"
    assert bar.kwargs["total"] == 5 * MiB
    assert bar.kwargs["file"] is stream
    assert bar.kwargs["unit"] == "B"
    assert bar.kwargs["unit_scale"] is True
    assert bar.kwargs["unit_divisor"] == 1024
    assert bar.kwargs["delay"] == 2.5
    assert bar.n == 5 * MiB
    assert bar.closed


def test_a_bar_for_another_unit_is_not_byte_scaled(fake_tqdm):
    with progress("blocks", total=7, unit="block", stream=FakeTty()):
        pass
    (bar,) = fake_tqdm.made
    assert bar.kwargs["unit"] == "block"
    assert "unit_scale" not in bar.kwargs
    assert "unit_divisor" not in bar.kwargs


def test_work_that_ends_within_min_seconds_never_shows_a_bar(terminal, records):
    pytest.importorskip("tqdm")
    with progress("quick", total=MiB, stream=terminal.stream, min_seconds=30) as report:
        report.update(MiB)
    assert terminal.read() == ""
    assert _messages(records)[0] == (logging.INFO, "quick: started (1024 KiB)")


def test_work_that_outlasts_min_seconds_shows_a_bar(terminal):
    pytest.importorskip("tqdm")
    with progress("slow", total=2 * MiB, stream=terminal.stream, min_seconds=0.2) as report:
        report.update(MiB)
        time.sleep(0.35)
        report.update(MiB)
    shown = terminal.read(until="100%")
    assert "slow" in shown
    assert "100%" in shown


def test_without_tqdm_a_terminal_gets_no_bar_and_the_records_still_appear(
    monkeypatch, terminal, records
):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes "import tqdm" raise ImportError
    with pytest.raises(ImportError):
        import tqdm  # noqa: F401
    with progress("load", total=3 * MiB, stream=terminal.stream) as report:
        report.update(3 * MiB)
    assert report.done == 3 * MiB
    assert terminal.read() == ""
    messages = [message for _, message in _messages(records)]
    assert messages[0] == "load: started (3072 KiB)"
    assert messages[1].startswith("load: done, 3072 KiB in ")


# --- the log records -------------------------------------------------------------------------


@pytest.mark.parametrize("on_terminal", [True, False], ids=["terminal", "not-a-terminal"])
def test_start_and_end_records_are_logged_either_way(terminal, records, on_terminal):
    stream = terminal.stream if on_terminal else io.StringIO()
    with progress("register weights", total=3 * 2**30, stream=stream) as report:
        report.update(3 * 2**30)
    terminal.read()
    (start_level, start), (end_level, end) = _messages(records)
    assert (start_level, start) == (logging.INFO, "register weights: started (3072 MiB)")
    assert end_level == logging.INFO
    # "<description>: done, <amount> in <seconds> s (<rate>/s)"
    prefix, _, rest = end.partition(" in ")
    assert prefix == "register weights: done, 3072 MiB"
    seconds, _, rate = rest.partition(" s (")
    assert float(seconds) >= 0
    assert rate.endswith("/s)")
    assert rate.split()[-1] in {"B/s)", "KiB/s)", "MiB/s)", "GiB/s)", "TiB/s)", "PiB/s)"}


def test_records_for_other_units_print_plain_counts(records):
    with progress("move", total=12, unit="tensor", stream=io.StringIO()) as report:
        report.update(12)
    (_, start), (_, end) = _messages(records)
    assert start == "move: started (12 tensor)"
    assert end.startswith("move: done, 12 tensor in ")
    assert end.endswith(" tensor/s)")


def test_an_unknown_total_is_logged_as_unknown(records):
    with progress("scan", stream=io.StringIO()) as report:
        report.update(100)
    assert _messages(records)[0] == (logging.INFO, "scan: started (total unknown)")
    assert report.total is None


def test_the_end_record_reports_the_time_taken(records):
    with progress("wait", total=1, stream=io.StringIO()) as report:
        time.sleep(0.2)
        report.update(1)
    end = _messages(records)[1][1]
    seconds = float(end.split(" in ")[1].split(" s ")[0])
    assert 0.2 <= seconds < 5


def test_records_go_to_the_given_logger(caplog):
    mine = logging.getLogger("aresidency.test.mine")
    caplog.set_level(logging.INFO, logger="aresidency.test.mine")
    with progress("load", total=1, logger=mine, stream=io.StringIO()) as report:
        report.update(1)
    (_, start), (_, end) = _messages(caplog, "aresidency.test.mine")
    assert start == "load: started (1 B)"
    assert end.startswith("load: done, 1 B in ")
    assert [r for r in caplog.records if r.name == "aresidency"] == []


def test_a_failing_body_logs_a_warning_and_the_exception_propagates(terminal, records):
    error = RuntimeError("disk gone")
    with (
        pytest.raises(RuntimeError) as caught,
        progress("load shards", total=4096, stream=terminal.stream) as report,
    ):
        report.update(1024)
        raise error
    assert caught.value is error
    start, end = _messages(records)
    assert start == (logging.INFO, "load shards: started (4096 B)")
    assert end[0] == logging.WARNING
    assert end[1].startswith("load shards: failed after ")
    assert end[1].endswith(" s, 1024 B of 4096 B done (RuntimeError: disk gone)")
    terminal.read()


def test_a_cancelled_body_is_logged_as_failed_with_the_exception_type(records):
    import asyncio

    with pytest.raises(asyncio.CancelledError), progress("load", stream=io.StringIO()) as report:
        report.update(10)
        raise asyncio.CancelledError
    level, end = _messages(records)[-1]
    assert level == logging.WARNING
    assert end.startswith("load: failed after ")
    assert end.endswith(" s, 10 B done (CancelledError)")


def test_a_failing_body_closes_the_bar(fake_tqdm, records):
    with pytest.raises(KeyError), progress("load", total=2, stream=FakeTty()):
        raise KeyError("x")
    (bar,) = fake_tqdm.made
    assert bar.closed


# --- Progress --------------------------------------------------------------------------------


def test_progress_reports_description_total_unit_and_done():
    with progress("load", total=10, unit="it", stream=io.StringIO()) as report:
        assert isinstance(report, Progress)
        assert (report.description, report.total, report.unit, report.done) == ("load", 10, "it", 0)
        report.update()
        report.update(4)
        assert report.done == 5
        assert repr(report) == "Progress('load', 5/10 it)"


def test_concurrent_updates_from_many_threads_all_count():
    threads, per_thread = 8, 20_000
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to expose races
    try:
        with progress("count", total=threads * per_thread * 3, stream=io.StringIO()) as report:
            barrier = threading.Barrier(threads)

            def work(step: int) -> None:
                barrier.wait()
                for _ in range(per_thread):
                    report.update(step)

            workers = [threading.Thread(target=work, args=(i % 3 + 1,)) for i in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
    finally:
        sys.setswitchinterval(old)
    assert report.done == sum((i % 3 + 1) * per_thread for i in range(threads))


def test_concurrent_updates_reach_the_bar_one_at_a_time(fake_tqdm):
    threads, per_thread = 6, 300
    with progress("count", total=threads * per_thread, unit="it", stream=FakeTty()) as report:
        workers = [
            threading.Thread(target=lambda: [report.update() for _ in range(per_thread)])
            for _ in range(threads)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    (bar,) = fake_tqdm.made
    assert report.done == threads * per_thread
    assert bar.n == threads * per_thread


def test_updates_after_the_block_still_count_but_draw_nothing(terminal):
    pytest.importorskip("tqdm")
    with progress("late", total=2, unit="it", stream=terminal.stream) as report:
        report.update()
    terminal.read(until="\n")  # the bar's final line, written when the block ended
    report.update()
    assert report.done == 2
    assert terminal.read() == ""


# --- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"description": b"load"}, TypeError, r"description must be a str, got b'load'"),
        ({"total": 1.5}, TypeError, r"total must be an int or None \(unknown\), got 1\.5"),
        ({"total": True}, TypeError, r"total must be an int or None \(unknown\), got True"),
        ({"total": -1}, ValueError, r"total must be >= 0 or None \(unknown\), got -1"),
        ({"unit": ""}, ValueError, r"unit must be a non-empty str such as 'B' or 'it', got ''"),
        ({"logger": "aresidency"}, TypeError, r"logger must be a logging\.Logger or None"),
        ({"min_seconds": -1}, ValueError, r"min_seconds must be a finite number .* got -1"),
        ({"min_seconds": float("nan")}, ValueError, r"min_seconds must be a finite .* got nan"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_logged(records, kwargs, error, match):
    arguments: dict[str, Any] = {"description": "load", "stream": io.StringIO(), **kwargs}
    with pytest.raises(error, match=match), progress(**arguments):
        pytest.fail("the body ran")
    assert _messages(records) == []
