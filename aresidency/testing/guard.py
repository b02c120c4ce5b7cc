"""The loop-stall guard: fail an async test that blocked its event loop.

Code built on aresidency must never block the event loop: a synchronize, a blocking copy or a
busy wait on the loop stalls every other request the process serves. The guard catches it in
tests. A ticker task runs beside the test and records the longest gap between its wake-ups; a
gap over the allowed stall (``MAX_LOOP_STALL``, 0.1 s, or the ini option
``residency_max_loop_stall``) means something ran on the loop that long without awaiting, and
the test fails at teardown, saying for how long. The default is loose enough for a slow CI
machine and tight enough to catch a blocking wait on a simulated kernel of a few hundred
milliseconds.

Two ways to use it, both for tests run by anyio's pytest plugin (``pytest.mark.anyio``; on
asyncio, uvloop and trio alike):

* request the ``loop_stall_guard`` fixture (the plugin provides it) in one test, or in a
  module's ``pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("loop_stall_guard")]``;
* import :func:`loop_never_blocked` into a ``conftest.py``: it is an autouse fixture, so every
  async anyio test of that directory is guarded (except tests marked ``allow_loop_stall``;
  ``allow_loop_stall(0.5)`` allows half a second instead).

``NO_LOOP_GUARD=1`` in the environment turns the guard off (to tell a stall from another
failure). Automatic garbage collection is paused while a guarded test runs: a full collection
can stall any Python code for 0.1 s, and that is not the code under test blocking. Nor is a
loaded machine: where Linux reports how long the process's Python threads waited for a CPU
(:class:`RunQueueClock`; the loop's thread, or the one holding the interpreter lock it wants),
that time is taken out of each gap, and so is the time a virtual machine's hypervisor took the
loop's CPU away while the loop ran (steal time). Nor is torch's one-time start-up (the first call
of each kernel): :func:`warm_torch` runs it once per process before the first guarded test. Nor
is a module's first import (reading, compiling and running it; a fresh clone has no compiled
files): :class:`ImportClock` times those imports and takes them out.

A failure says what the loop ran while it was blocked: a watchdog thread
(:class:`StallWatchdog`) looks at the loop's thread half the allowed stall into a gap and keeps
its stack, and the failure prints its innermost frames of the code under test.

How it works on every loop: :func:`loop_stall_guard` is an anyio async-generator fixture that
opens a task group, starts the ticker in it, yields for the test and closes the group at
teardown. anyio's pytest plugin runs an async generator fixture's set-up, the test and the
fixture's teardown one after the other in one and the same task, so the group is entered and
exited by that task, with the test nested inside it.
"""

from __future__ import annotations

import builtins
import functools
import gc
import importlib
import inspect
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import pytest

__all__ = [
    "ALLOW_MARKER",
    "ImportClock",
    "MAX_LOOP_STALL",
    "MAX_LOOP_STALL_INI",
    "RunQueueClock",
    "StallWatchdog",
    "TICK",
    "allowed_stall",
    "guard_applies",
    "loop_never_blocked",
    "loop_stall_guard",
    "max_loop_stall",
    "runs_under_anyio",
    "warm_torch",
]

MAX_LOOP_STALL = 0.1  # seconds
TICK = 0.002  # seconds between the ticker's wake-ups
#: The ini option (registered by the plugin) that changes ``MAX_LOOP_STALL`` for a project.
MAX_LOOP_STALL_INI = "residency_max_loop_stall"
#: The marker of a test that blocks the loop on purpose (the guard leaves it alone, or allows
#: the seconds it is given).
ALLOW_MARKER = "allow_loop_stall"


def max_loop_stall(config: pytest.Config) -> float:
    """The longest stall allowed, in seconds: the ini option ``residency_max_loop_stall`` when
    the plugin registered it and it is set, else ``MAX_LOOP_STALL``. ``pytest.UsageError`` for
    a value that is not a number of seconds > 0."""
    try:
        text = config.getini(MAX_LOOP_STALL_INI)
    except ValueError:  # the plugin is not loaded (-p no:aresidency): the ini is unknown
        return MAX_LOOP_STALL
    if not text:
        return MAX_LOOP_STALL
    try:
        seconds = float(str(text))
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise pytest.UsageError(
            f"{MAX_LOOP_STALL_INI} must be a number of seconds > 0, such as 0.1; got {text!r}"
        )
    return seconds


def runs_under_anyio(request: pytest.FixtureRequest) -> bool:
    """Whether the requesting test is a coroutine function that anyio's plugin runs (marked
    ``anyio``, or anyio's auto mode): the tests the guard and the manager fixture serve."""
    function = getattr(request, "function", None)
    return inspect.iscoroutinefunction(function) and "anyio_backend" in request.fixturenames


def allowed_stall(request: pytest.FixtureRequest) -> float | None:
    """The longest stall allowed in this test, in seconds; None where it is not guarded: marked
    ``allow_loop_stall`` (without seconds), or ``NO_LOOP_GUARD`` set. ``allow_loop_stall(s)``
    (or ``seconds=s``) allows ``s`` instead of the project's limit (:func:`max_loop_stall`):
    for a test of code that stalls its loop for a known reason of someone else's, such as a
    ``DataLoader`` forking its workers while it holds the interpreter lock."""
    if os.environ.get("NO_LOOP_GUARD"):
        return None
    marker = request.node.get_closest_marker(ALLOW_MARKER)
    if marker is None:
        return max_loop_stall(request.config)
    if len(marker.args) > 1 or set(marker.kwargs) - {"seconds"}:
        raise pytest.UsageError(
            f"{ALLOW_MARKER} takes one number of seconds at most, got args {marker.args!r} "
            f"and keywords {marker.kwargs!r}"
        )
    seconds = marker.kwargs.get("seconds", marker.args[0] if marker.args else None)
    if seconds is None:
        return None
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise pytest.UsageError(
            f"{ALLOW_MARKER}(seconds) needs a number of seconds > 0, such as 0.5; got {seconds!r}"
        )
    return float(seconds)


def guard_applies(request: pytest.FixtureRequest) -> bool:
    """Whether :func:`loop_never_blocked` guards this test: an async test run by anyio, not
    marked ``allow_loop_stall`` without seconds, and ``NO_LOOP_GUARD`` not set."""
    return runs_under_anyio(request) and allowed_stall(request) is not None


@pytest.fixture
async def loop_stall_guard(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Fail the test if its event loop was blocked for longer than the allowed stall (see the
    module docstring). The host never waits: the ticker sleeps on the loop between checks.
    A test marked ``allow_loop_stall``, or a run with ``NO_LOOP_GUARD`` set, is not guarded,
    however the fixture was requested; ``allow_loop_stall(seconds)`` changes its limit."""
    if not runs_under_anyio(request):
        pytest.fail(
            "loop_stall_guard guards async tests run by anyio's pytest plugin: mark the test "
            "with pytest.mark.anyio (a sync test has no event loop to guard)",
            pytrace=False,
        )
    limit = allowed_stall(request)
    if limit is None:
        yield  # blocks on purpose, or the guard is turned off for this run
        return
    warm_torch()  # before the ticker starts: torch's start-up is not the code under test
    worst = 0.0
    excused = 0.0  # of the worst gap: what the loop's threads waited for a CPU (not counted)
    imported = 0.0  # of the worst gap: what first imports took (not counted)
    worst_stack: traceback.StackSummary | None = None  # what the loop ran in the worst gap
    stop = False
    watchdog = StallWatchdog(threading.get_ident(), after=limit / 2)

    async def ticker(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        nonlocal worst, excused, imported, worst_stack
        waited = RunQueueClock()
        try:
            last = time.perf_counter()
            last_waited = waited()
            last_imported = imports.seconds
            watchdog.tick(last)
            task_status.started()
            ticks = 0
            while not stop:
                await anyio.sleep(TICK)
                now = time.perf_counter()
                ticks += 1
                # Every thread now and then, and after a long gap; else the loop's own.
                now_waited = waited(everyone=ticks % 16 == 0 or now - last > limit / 4)
                # Time the process's threads spent ready but waiting for a CPU (a loaded
                # machine) is not the loop being blocked by the code under test.
                gap = now - last - TICK
                waited_here = min(now_waited - last_waited, max(gap, 0.0))
                # Nor is a module's first import (reading and compiling it: one-time start-up).
                now_imported = imports.seconds
                imported_here = min(now_imported - last_imported, max(gap - waited_here, 0.0))
                stack = watchdog.tick(now)  # what the loop ran if this gap was a long one
                if gap - waited_here - imported_here > worst:
                    worst = gap - waited_here - imported_here
                    excused, imported, worst_stack = waited_here, imported_here, stack
                last = now
                last_waited = now_waited
                last_imported = now_imported
        finally:
            waited.close()

    # Automatic garbage collection is paused during the test: a full collection under pytest
    # can stall any Python code for 0.1 s or more, and that is not the code blocking.
    gc.disable()
    imports = ImportClock.install()
    watchdog.start()
    try:
        async with anyio.create_task_group() as tasks:
            # Started (its clock running) before the test: a test that blocks the loop at
            # once is measured too (start_soon may let the test run first, as on trio).
            await tasks.start(ticker)
            try:
                yield
            finally:
                # The ticker ends after its current sleep, so the last stretch (up to the
                # teardown) is measured too.
                stop = True
    finally:
        watchdog.close()
        imports.uninstall()
        gc.enable()
    if worst >= limit:
        pytest.fail(
            f"the event loop was blocked for {worst * 1e3:.0f} ms (at most {limit * 1e3:.0f} ms "
            f"allowed): something ran on the loop without awaiting (a synchronize, a blocking "
            f"copy, a busy wait); move it to a worker thread, or mark the test "
            f"{ALLOW_MARKER} if it blocks on purpose. (Not counted in that stall: "
            f"{excused * 1e3:.0f} ms the process's threads waited for a CPU, or the "
            f"hypervisor had it; {imported * 1e3:.0f} ms went to modules' first imports.)"
            + describe_stall(worst_stack, after=limit / 2),
            pytrace=False,
        )


def describe_stall(stack: traceback.StackSummary | None, *, after: float) -> str:
    """The failure's account of what the loop's thread ran during its longest stall: the
    innermost frames the watchdog saw, ``after`` seconds into the stall (the loop's own code
    first seen from the outside; the frames of the ticker's and the runner's machinery are
    left out)."""
    if stack is None:
        return (
            f"\nThe watchdog did not catch the loop's thread {after * 1e3:.0f} ms into the "
            f"stall (the interpreter lock was not let go, or the stall ended first)."
        )
    *outer, innermost = stack  # the innermost frame shows, wherever it is
    frames = [frame for frame in outer if not _machinery(frame.filename)]
    frames = [*frames[-(STACK_FRAMES - 1) :], innermost]
    lines = "".join(
        f"\n  {frame.filename}:{frame.lineno} in {frame.name}"
        + (f"\n    {frame.line.strip()}" if frame.line else "")
        for frame in frames
    )
    return f"\nThe loop's thread {after * 1e3:.0f} ms into that stall, innermost last:{lines}"


STACK_FRAMES = 8  # how many of the stalled thread's innermost frames a failure shows


def _machinery(filename: str) -> bool:
    """Frames of the event loops' and the test runner's own code: not where a stall is."""
    parts = filename.replace("\\", "/").split("/")
    return filename.startswith("<frozen") or any(part in _MACHINERY for part in parts)


_MACHINERY = frozenset(("asyncio", "trio", "anyio", "outcome", "_pytest", "pytest", "pluggy"))


class ImportClock:
    """The seconds the process's threads have spent in imports that loaded a module for the
    first time (reading, compiling and running it), while the clock is installed: a lazy
    import's one-time cost, which a fresh clone without compiled files pays in full, is
    start-up, not the code under test blocking its loop. It wraps ``builtins.__import__``
    (every ``import`` statement) and ``importlib.import_module``; an import counts when the
    module table grew during it, and only the outermost import of each thread is timed. An
    import already done costs the wrapper well under a microsecond more."""

    _installed: ImportClock | None = None
    _users = 0

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = threading.local()
        self._import = builtins.__import__
        self._import_module = importlib.import_module

    @classmethod
    def install(cls) -> ImportClock:
        """The process's clock, installed (a second install shares it)."""
        if cls._installed is None:
            clock = cls()
            builtins.__import__ = clock._timed(clock._import)
            importlib.import_module = clock._timed(clock._import_module)  # type: ignore[assignment]
            cls._installed = clock
        cls._users += 1
        return cls._installed

    def uninstall(self) -> None:
        """Put the originals back once the last user is done."""
        cls = type(self)
        if cls._installed is not self:
            return
        cls._users -= 1
        if cls._users == 0:
            builtins.__import__ = self._import
            importlib.import_module = self._import_module
            cls._installed = None

    def _timed(self, original: Any) -> Any:
        depth = self._depth

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(depth, "n", 0):
                return original(*args, **kwargs)  # inside an import already timed
            loaded, started = len(sys.modules), time.perf_counter()
            depth.n = 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.n = 0
                if len(sys.modules) != loaded:
                    self.seconds += time.perf_counter() - started

        return timed


def _stack_of(thread: int) -> traceback.StackSummary | None:
    """What ``thread`` runs now, outermost first (its 64 innermost frames): names and line
    numbers only. No frame object outlives this call: a frame held by another thread keeps
    its function's locals alive after the function returned (a tensor released there would
    stay allocated until the holder let go)."""
    frame = sys._current_frames().get(thread)
    if frame is None:
        return None
    try:
        stack = traceback.StackSummary.extract(
            traceback.walk_stack(frame), limit=64, lookup_lines=False
        )
    finally:
        del frame
    stack.reverse()  # outermost first, as a traceback prints
    return stack


class StallWatchdog:
    """A thread that looks at the loop's thread when the loop has not ticked for ``after``
    seconds, and keeps the stack it was running (once per stall): what blocked the loop, seen
    while it blocked. The ticker calls :meth:`tick` at each wake-up; it returns the stack of
    the stall that wake-up ended, if the watchdog caught one. The thread wakes ``4 / after``
    times a second and takes the interpreter lock only for that look (a few microseconds; the
    stack's source lines are read later, only for a failure)."""

    def __init__(self, loop_thread: int, *, after: float) -> None:
        self._loop_thread = loop_thread
        self._after = after
        self._last_tick = time.perf_counter()
        self._caught: tuple[float, traceback.StackSummary] | None = None  # (stall's start, stack)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="aresidency-loop-watchdog", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def tick(self, now: float) -> traceback.StackSummary | None:
        with self._lock:
            started, self._last_tick = self._last_tick, now
            caught, self._caught = self._caught, None
        if caught is not None and caught[0] == started:
            return caught[1]
        return None

    def _watch(self) -> None:
        while not self._stop.wait(self._after / 4):
            with self._lock:
                started = self._last_tick
                if self._caught is not None or time.perf_counter() - started < self._after:
                    continue
            stack = _stack_of(self._loop_thread)
            if stack is None:
                continue
            with self._lock:
                if self._last_tick == started:  # the stall still goes on
                    self._caught = (started, stack)


_warmed = False


def warm_torch() -> None:
    """Run torch's one-time start-up once per process, before the first guarded test: the
    first call of a kernel, and of the intra-op thread pool, costs milliseconds each (a fresh
    process's first forward of a small transformer-like model took 51 ms on a 2-core machine,
    its second 1 ms), and that is not the code under test blocking its loop. About 10 ms; it
    draws nothing from torch's random number generators."""
    global _warmed
    if _warmed:
        return
    _warmed = True
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        a = torch.ones(256, 256)
        b = a @ a
        F.gelu(b)
        F.layer_norm(b, (256,))
        F.linear(a[:2, :8], a[:8, :8], a[0, :8])
        F.embedding(torch.zeros(2, dtype=torch.long), a)
        torch.cat([a, b]).sum()


class RunQueueClock:
    """The seconds this process's Python threads have spent ready to run but waiting for a CPU
    since the clock was made, from Linux's per-thread scheduler statistics
    (``/proc/self/task/<tid>/schedstat``). The loop's thread waits for a CPU itself on a
    loaded machine, or for the interpreter lock held by another thread that waits for one: both
    delay the loop without the code under test blocking it. A thread counts from the first
    reading that sees it.

    In a virtual machine the hypervisor also takes CPUs away from the guest ("steal" time, the
    eighth number of each ``cpu<N>`` line of ``/proc/stat``, in clock ticks of 10 ms), and the
    guest's own statistics count that time as the thread running. The clock adds, for the
    loop's thread, the steal of the CPU that lost the most since the last reading, but never
    more than the time that thread ran meanwhile: a thread that slept did not lose its CPU.

    Where the system does not say, it reads zero, and the guard counts every gap whole."""

    def __init__(self, stat_path: str = "/proc/stat") -> None:
        self._own = threading.get_native_id()  # the loop's thread: read at every call
        self._fds: dict[int, int] = {}
        self._last: dict[int, int] = {}  # per thread: its run-queue nanoseconds when last read
        self._total = 0  # nanoseconds, summed over the threads' increments
        self._works = os.path.exists(f"/proc/self/task/{self._own}/schedstat")
        self._tick_ns = 1e9 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        try:
            self._stat: int | None = os.open(stat_path, os.O_RDONLY) if self._works else None
        except OSError:
            self._stat = None  # no steal figures: run-queue waits only
        self._steal: list[int] = []  # per CPU: its steal ticks when last read
        self._ran: int | None = None  # the loop's thread: its nanoseconds on a CPU, then
        self(everyone=True)  # the first reading: the baselines

    def __call__(self, everyone: bool = True) -> float:
        """The seconds so far. ``everyone=False`` reads the calling thread only (about 3 us;
        reading every thread costs a few us per thread): the other threads' waits since
        their last reading are then counted at the next full one. The steal figures are read
        at every call (about 12 us)."""
        if not self._works:
            return 0.0
        if everyone:
            tids = {t.native_id for t in threading.enumerate() if t.native_id is not None}
            tids.add(self._own)
            for tid in list(self._fds):
                if tid not in tids:
                    self._forget(tid)  # ended: what it waited since its last reading is lost
        else:
            tids = {self._own}
        own_ran = None
        for tid in tids:
            read = self._read(tid)
            if read is None:
                continue
            ran, waited = read
            if tid == self._own:
                own_ran = ran
            last = self._last.get(tid)
            if last is not None and waited > last:
                self._total += waited - last
            self._last[tid] = waited
        self._total += self._stolen(own_ran)
        return self._total * 1e-9

    def _stolen(self, ran: int | None) -> int:
        """Nanoseconds the hypervisor took from the loop's thread since the last call (an
        estimate: the most any one CPU lost, at most what the thread ran: ``ran``, its
        nanoseconds on a CPU now)."""
        steal = self._read_steal()
        before, ran_before = self._steal, self._ran
        self._steal, self._ran = steal, ran
        if not steal or len(steal) != len(before) or ran is None or ran_before is None:
            return 0
        lost = max(now - then for now, then in zip(steal, before)) * self._tick_ns
        return int(max(0.0, min(lost, ran - ran_before)))

    def _read_steal(self) -> list[int]:
        if self._stat is None:
            return []
        try:
            text = os.pread(self._stat, 1 << 16, 0).decode("ascii", "replace")
            return [
                int(line.split()[8])
                for line in text.splitlines()
                if line.startswith("cpu") and not line.startswith("cpu ")
            ]
        except (OSError, ValueError, IndexError):
            return []

    def _read(self, tid: int) -> tuple[int, int] | None:
        """The thread's nanoseconds on a CPU and waiting on a run queue, or None."""
        fd = self._fds.get(tid)
        try:
            if fd is None:
                fd = self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            # "<ns on a CPU> <ns waiting on a run queue> <time slices>"
            ran, waited = os.pread(fd, 128, 0).split()[:2]
            return int(ran), int(waited)
        except (OSError, ValueError, IndexError):
            self._forget(tid)  # the thread ended, or the system does not say
            return None

    def _forget(self, tid: int) -> None:
        self._last.pop(tid, None)
        fd = self._fds.pop(tid, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for tid in list(self._fds):
            self._forget(tid)
        if self._stat is not None:
            os.close(self._stat)
            self._stat = None
        self._works = False


@pytest.fixture(autouse=True)
def loop_never_blocked(request: pytest.FixtureRequest) -> None:
    """Autouse: the guard for every async anyio test of the directory whose ``conftest.py``
    imports this fixture (``from aresidency.testing import loop_never_blocked``), except tests
    marked ``allow_loop_stall`` and runs with ``NO_LOOP_GUARD`` set. A sync fixture: a sync
    test cannot use an async fixture, so it requests the guard only for the async tests."""
    if guard_applies(request):
        request.getfixturevalue("loop_stall_guard")
