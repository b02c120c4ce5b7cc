"""Progress for work that takes seconds, on real registrations: a value copied into pinned
memory and a streamed module packed block by block report their progress (a tqdm bar when
stderr is a terminal, log records always) once the work is large, and nothing when it is small.

The terminal is a POSIX pseudo-terminal read from a worker thread (reading it on the event
loop would block the loop). "Large" is lowered from 256 MiB to 1 MiB for the tests, through
the documented module attribute ``aresidency.progress.LARGE_WORK_BYTES``."""

from __future__ import annotations

import io
import logging
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

import anyio
import pytest
import torch
from torch import nn

import aresidency.progress
from aresidency import stream_module

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(sys.platform == "win32", reason="uses a POSIX pseudo-terminal"),
]

# Imported here, not on the loop during a test: its first import takes a while.
pytest.importorskip("tqdm")

MiB = 1 << 20


class Terminal:
    """A pseudo-terminal: ``stream`` is the end progress bars are drawn on; :meth:`read`
    returns what reached the other end, as a user's terminal would show it."""

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
        """Everything written so far: wait up to ``timeout`` s for ``until`` to appear, or,
        with no ``until``, until nothing more arrives for 0.3 s (a pty delivers
        asynchronously). Blocks the calling thread: call it in a worker thread."""
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
            except OSError:
                break
            if not chunk:
                break
            received += chunk
            if until is not None and until in received.decode("utf-8", "replace"):
                break
        return received.decode("utf-8", "replace")

    async def shown(self, until: str | None = None) -> str:
        return await anyio.to_thread.run_sync(self.read, until)

    def close(self) -> None:
        self.stream.close()
        os.close(self.master)


# pytest's output capture puts its own sys.stderr back when a test's call begins, so a fixture
# cannot replace it for the test: each test does, with ``stderr_is(...)``.


@pytest.fixture
def stderr_is(monkeypatch: pytest.MonkeyPatch) -> Callable[[TextIO], None]:
    """``stderr_is(stream)`` makes ``stream`` the process's stderr until the test ends."""
    return lambda stream: monkeypatch.setattr(sys, "stderr", stream)


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    term = Terminal()
    assert term.stream.isatty()
    yield term
    term.close()


@pytest.fixture
def large_from_1mib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aresidency.progress, "LARGE_WORK_BYTES", MiB)


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="aresidency")
    return caplog


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aresidency" and r.levelno == level]


# --- register ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("large_from_1mib")
async def test_registering_a_large_value_into_pinned_memory_draws_a_bar_on_a_terminal(
    residency_manager, stderr_is, terminal, records
):
    stderr_is(terminal.stream)
    residency_manager.register(torch.ones(MiB), name="weights", location="pinned-host")  # 4 MiB

    shown = await terminal.shown(until="100%")
    assert "register 'weights': copy to pinned-host" in shown
    assert "100%" in shown
    assert "4.00M/4.00M" in shown  # bytes, scaled by 1024
    start, end = messages(records)
    assert start == "register 'weights': copy to pinned-host: started (4096 KiB)"
    assert end.startswith("register 'weights': copy to pinned-host: done, 4096 KiB in ")


@pytest.mark.usefixtures("large_from_1mib")
async def test_registering_a_large_value_writes_nothing_when_stderr_is_not_a_terminal(
    residency_manager, stderr_is, records
):
    not_a_terminal = io.StringIO()  # a log file, CI
    stderr_is(not_a_terminal)
    residency_manager.register(torch.ones(MiB), name="weights", location="pinned-host")

    assert not_a_terminal.getvalue() == ""
    start, end = messages(records)  # the records are written either way
    assert start == "register 'weights': copy to pinned-host: started (4096 KiB)"
    assert end.startswith("register 'weights': copy to pinned-host: done, 4096 KiB in ")


@pytest.mark.usefixtures("large_from_1mib")
async def test_registering_a_small_value_reports_nothing(
    residency_manager, stderr_is, terminal, records
):
    stderr_is(terminal.stream)
    residency_manager.register(torch.ones(1024), name="small", location="pinned-host")  # 4 KiB

    assert await terminal.shown() == ""
    assert records.records == []


@pytest.mark.usefixtures("large_from_1mib")
async def test_registering_a_large_value_where_it_lives_copies_nothing_and_reports_nothing(
    residency_manager, stderr_is, terminal, records
):
    stderr_is(terminal.stream)
    residency_manager.register(torch.ones(MiB), name="in-place")  # stays in pageable memory

    assert await terminal.shown() == ""
    assert records.records == []


async def test_below_the_default_256_mib_a_registration_reports_nothing(
    residency_manager, stderr_is, terminal, records
):
    stderr_is(terminal.stream)
    threshold = aresidency.progress.LARGE_WORK_BYTES
    assert threshold == 256 * MiB
    residency_manager.register(torch.ones(MiB), name="weights", location="pinned-host")

    assert await terminal.shown() == ""
    assert records.records == []


# --- stream_module -----------------------------------------------------------------------------


def model() -> nn.Sequential:
    torch.manual_seed(0)
    # Just over 1 MiB per block: each registration inside would report on its own if nesting
    # did not silence it.
    return nn.Sequential(*(nn.Linear(512, 512) for _ in range(5)))


@pytest.mark.usefixtures("large_from_1mib")
# stream_module is a synchronous call: it packs and pins every block on the calling thread (here
# the loop), which is what this test watches, so it may hold the loop for the whole packing.
@pytest.mark.allow_loop_stall
async def test_streaming_a_module_reports_one_progress_over_all_its_blocks(
    residency_manager, stderr_is, terminal, records
):
    stderr_is(terminal.stream)
    streamed = stream_module(residency_manager, model(), "cuda:0", name="net")
    total = sum(group.nbytes for group in streamed.all_groups)
    assert min(group.nbytes for group in streamed.all_groups) > MiB

    shown = await terminal.shown(until="100%")
    assert "stream_module net: pack 5 blocks into pinned-host" in shown
    assert "register '" not in shown  # the registrations inside draw no bar of their own
    inner = messages(records, logging.DEBUG)
    assert len(inner) == 10 and all(m.startswith("register 'net.") for m in inner)
    start, end = messages(records)
    assert start == (
        f"stream_module net: pack 5 blocks into pinned-host: started "
        f"({aresidency.format_nbytes(total)})"
    )
    assert end.startswith(
        f"stream_module net: pack 5 blocks into pinned-host: done, "
        f"{aresidency.format_nbytes(total)} in "
    )
    await streamed.aclose()


async def test_nested_progress_logs_at_debug_and_draws_no_bar(stderr_is, terminal, records):
    stderr_is(terminal.stream)
    with aresidency.progress.progress("outer", total=2, unit="it") as outer:
        with aresidency.progress.progress("inner", total=1, unit="it") as inner:
            inner.update()
        outer.update(2)

    shown = await terminal.shown(until="100%")
    assert "outer" in shown
    assert "inner" not in shown
    assert [m.split(":")[0] for m in messages(records)] == ["outer", "outer"]
    assert [m.split(":")[0] for m in messages(records, logging.DEBUG)] == ["inner", "inner"]
