"""Event waiting: host events wake the loop from their setter; the waiter thread strategies
resolve awaited events without blocking the loop. CPU tests use stand-in events."""

from __future__ import annotations

import ctypes
import itertools
import select
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aresidency.backends import cudadriver
from aresidency.backends import waiter as waiter_module
from aresidency.backends.base import BackendClosedError
from aresidency.backends.bridge import LoopBridge
from aresidency.backends.events import HostEvent
from aresidency.backends.looptimer import Timerfd
from aresidency.backends.polling import EventNotes
from aresidency.backends.sim import SimBackend
from aresidency.backends.waiter import STRATEGIES, EventWaiter, hostfunc_available

pytestmark = pytest.mark.anyio


class FakeEvent:
    """Completes ``delay`` seconds after creation; ``synchronize`` sleeps until then."""

    def __init__(self, delay: float) -> None:
        self._flag = threading.Event()
        timer = threading.Timer(delay, self._flag.set)
        timer.daemon = True  # a long fake must not hold up interpreter exit
        timer.start()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self._flag.wait()


def test_host_event_runs_each_callback_once() -> None:
    event = HostEvent()
    calls: list[str] = []
    event.add_done_callback(lambda: calls.append("before"))
    assert not event.query()
    event.set()
    event.set()
    event.add_done_callback(lambda: calls.append("after"))
    assert calls == ["before", "after"]
    assert event.query() and event.wait_blocking(0)


def test_a_host_event_callback_that_raises_does_not_cost_the_others_theirs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    event = HostEvent(label="lane")
    calls: list[str] = []

    def broken() -> None:
        raise ValueError("a callback's own bug")

    event.add_done_callback(lambda: calls.append("first"))
    event.add_done_callback(broken)
    event.add_done_callback(lambda: calls.append("last"))
    with caplog.at_level("ERROR", logger="aresidency"):
        event.set()  # the setter (a staging lane's thread) is not interrupted
    assert calls == ["first", "last"]
    assert "a callback of" in caplog.text and "a callback's own bug" in caplog.text


def test_host_event_wait_blocking_times_out() -> None:
    assert not HostEvent().wait_blocking(0.01)


async def test_host_event_set_from_a_thread_wakes_the_awaiting_task() -> None:
    backend = SimBackend()
    backend.start()
    event = HostEvent()
    timer = threading.Timer(0.05, event.set)
    timer.daemon = True
    timer.start()
    start = time.perf_counter()
    with anyio.fail_after(2.0):
        await backend.wait(event)
    assert time.perf_counter() - start >= 0.04
    await backend.aclose()


async def test_cancelled_wait_on_a_host_event_is_harmless() -> None:
    backend = SimBackend()
    backend.start()
    event = HostEvent()
    scope = anyio.CancelScope()
    waiting = anyio.Event()
    cancelled: list[BaseException] = []

    async def wait() -> None:
        with scope:
            try:
                waiting.set()  # the wait below is registered before this task first yields
                await backend.wait(event)
            except anyio.get_cancelled_exc_class() as exc:
                cancelled.append(exc)
                raise

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await waiting.wait()
        scope.cancel()
    assert cancelled and scope.cancelled_caught
    event.set()
    await backend.wait(HostEvent(done=True))  # the late completion of the cancelled wait
    await anyio.lowlevel.checkpoint()  # runs on the loop and does nothing
    await backend.aclose()


def test_unknown_strategy_is_rejected() -> None:
    with pytest.raises(ValueError, match="strategy"):
        EventWaiter("spin")


def test_auto_picks_hybrid_only_where_the_driver_offers_it() -> None:
    waiter = EventWaiter("auto")
    assert waiter.strategy == ("hybrid" if hostfunc_available() else "poll")
    assert waiter.strategy in STRATEGIES
    waiter.close()


@pytest.mark.parametrize("strategy", ["poll", "blocking"])
async def test_waiter_thread_resolves_events_without_blocking_the_loop(strategy: str) -> None:
    waiter = EventWaiter(strategy)
    waiter.start()
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.sleep(0.005)

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ticker)
            try:
                events = [FakeEvent(0.05 + 0.02 * i) for i in range(5)]
                with anyio.fail_after(5.0):
                    async with anyio.create_task_group() as waits:
                        for e in events:
                            waits.start_soon(waiter.wait, e)
            finally:
                done = True
        assert all(e.query() for e in events)
        assert waiter.pending_count() == 0
    finally:
        waiter.close()
    assert ticks >= 10


async def test_closing_the_waiter_fails_pending_waits() -> None:
    waiter = EventWaiter("poll")
    waiter.start()
    waiting, finished = anyio.Event(), anyio.Event()

    async def wait() -> None:
        try:
            waiting.set()  # the wait below is registered before this task first yields
            with pytest.raises(RuntimeError, match="closed"):
                await waiter.wait(FakeEvent(10.0))
        finally:
            finished.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await waiting.wait()
        assert waiter.pending_count() == 1
        await anyio.to_thread.run_sync(waiter.close)
        with anyio.fail_after(1.0):
            await finished.wait()
    with pytest.raises(RuntimeError, match="closed"):
        await waiter.wait(FakeEvent(10.0))


async def test_a_completed_event_returns_at_once() -> None:
    waiter = EventWaiter("poll")
    event = FakeEvent(0.0)
    await anyio.to_thread.run_sync(event.synchronize)  # until its timer completed it
    await waiter.wait(event)  # never started a thread
    assert "idle" in repr(waiter)
    waiter.close()


class FakeDriver:
    """Stands in for the CUDA driver: a "host function" enqueued after a wait on a fake event
    runs libc's sem_post from another thread once the event completes, as the driver's
    callback thread would."""

    def __init__(self) -> None:
        self.libc = cudadriver.load_libc()
        self.sem_post_ptr = ctypes.cast(self.libc.sem_post, ctypes.c_void_p).value
        self.events: dict[int, FakeEvent] = {}
        self.streams = itertools.count(1)
        self.waiting: dict[int, int] = {}
        self.cuda = self
        self.launched = 0
        self.notify_lag = 0.0  # seconds from completion to the host function's sem_post

    def new_semaphore(self) -> Any:
        return cudadriver.CudaDriver.new_semaphore(self)  # type: ignore[arg-type]

    def create_stream(self, device: int) -> int:
        return next(self.streams)

    def destroy_stream(self, device: int, stream: int) -> None:
        pass

    def call_in(self, device: int, fn: Any, what: str) -> None:
        code = fn()
        if code != 0:
            raise RuntimeError(f"{what} failed with CUresult {code}")

    def cuStreamWaitEvent(self, stream: int, handle: int, flags: int) -> int:
        self.waiting[stream] = handle
        return 0

    def cuLaunchHostFunc(self, stream: int, fn: int, sem: int) -> int:
        assert fn == self.sem_post_ptr
        event = self.events[self.waiting[stream]]
        self.launched += 1

        def callback() -> None:
            event.synchronize()
            time.sleep(self.notify_lag)
            self.libc.sem_post(sem)

        threading.Thread(target=callback, daemon=True).start()
        return 0


class ArmableEvent(FakeEvent):
    ids = itertools.count(1)

    def __init__(self, delay: float, driver: FakeDriver) -> None:
        super().__init__(delay)
        self.cuda_event = next(self.ids)
        self.device = None
        driver.events[self.cuda_event] = self


class FakeStream:
    device_index = 0

    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


@pytest.mark.parametrize("strategy", ["hybrid", "hostfunc"])
async def test_notified_strategies_resolve_armed_and_unarmed_events(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter(strategy)
    waiter.start()
    try:
        armed = []
        for i in range(6):
            event = ArmableEvent(0.02 + 0.01 * i, driver)
            waiter.arm(event, FakeStream(100 + i % 2))
            armed.append(event)
        unarmed = ArmableEvent(0.03, driver)  # armed lazily by wait()
        with anyio.fail_after(5.0):
            async with anyio.create_task_group() as waits:
                for e in [unarmed, *reversed(armed)]:
                    waits.start_soon(waiter.wait, e)
        assert all(e.query() for e in armed) and unarmed.query()
        if strategy == "hostfunc":
            # armed at record; the unarmed one at its wait (unless done before it began)
            assert driver.launched in (6, 7)
        else:
            # hybrid arms at the wait; a wait predicted short (other events of the stream
            # completed first) or already complete may need no notification at all
            assert 1 <= driver.launched <= 7
        assert waiter.pending_count() == 0 and waiter.degraded is None
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_hybrid_polls_briefly_after_a_wait_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", window_s=0.2, loop_timer=False)
    waiter.start()
    try:
        event = ArmableEvent(0.05, driver)
        event.cuda_event = -1  # its notification never comes: only polling can see it
        driver.events[-1] = FakeEvent(3600.0)
        waiter.arm(event, FakeStream(7))
        start = time.perf_counter()
        with anyio.fail_after(5.0):
            await waiter.wait(event)
        assert time.perf_counter() - start < 0.04 + 0.05  # not the 50 ms safety sweep
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_hybrid_polls_where_a_streams_waits_are_predicted_to_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waits of 50 ms on one stream, notifications 10 ms late. The first wait polls for a
    window at its start, sees nothing, and is woken by the late notification; later waits are
    seen by polls near their predicted end, so they neither poll from their start nor wait
    for the notification."""
    driver = FakeDriver()
    driver.notify_lag = 0.010
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", window_s=0.004, safety_timeout_s=1.0, loop_timer=False)
    waiter.start()
    try:
        wakeups = []
        for _ in range(6):
            event = ArmableEvent(0.05, driver)
            waiter.arm(event, FakeStream(11))
            before = waiter.wakeups
            with anyio.fail_after(5.0):
                await waiter.wait(event)
            wakeups.append(waiter.wakeups - before)
        # The first wait has no history: its polls end 4 ms in, the notification wakes it.
        # Each later prediction starts polls before the completion (the lead shrinks the
        # 60 ms first sample to below 50 ms within two waits), so polls see most of them.
        assert waiter.poll_hits >= 3, (waiter.poll_hits, wakeups)
        # A poll every 75 us across the whole 50 ms would be ~600 wake-ups per wait; a 4 ms
        # window at most ~55 (fewer where the sleep overshoots).
        assert max(wakeups[2:]) < 120, wakeups
        history = waiter.predictor.history((0, 11))
        assert len(history) == 6 and min(history[1:]) < history[0]  # seen before the late post
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_a_wait_shorter_than_predicted_is_woken_by_its_notification(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream whose waits suddenly get shorter: the polls come too late, the notification
    still wakes the task, and the prediction follows the shorter waits."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", window_s=0.004, safety_timeout_s=1.0, loop_timer=False)
    waiter.start()
    try:
        for delay in (0.08, 0.08, 0.01, 0.01):
            event = ArmableEvent(delay, driver)
            waiter.arm(event, FakeStream(12))
            start = time.perf_counter()
            with anyio.fail_after(5.0):
                await waiter.wait(event)
            assert time.perf_counter() - start < delay + 0.5  # never the 1 s safety sweep
        assert waiter.predictor.from_history((0, 12)) < 0.05  # was ~0.07 after the 80 ms waits
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_hybrid_enqueues_no_notification_for_waits_its_polls_catch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Short, regular waits on one stream: once predicted, their completion is seen by the
    polls around it and no host function is enqueued for them (each costs the driver's
    callback thread and a wake-up)."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter(
        "hybrid", window_s=0.1, lazy_arm_s=0.05, safety_timeout_s=1.0, loop_timer=False
    )
    waiter.start()
    try:
        for _ in range(8):
            event = ArmableEvent(0.02, driver)
            waiter.arm(event, FakeStream(13))
            with anyio.fail_after(5.0):
                await waiter.wait(event)
        # the first wait (no history) is notified; later ones are caught by polls (a loaded
        # machine may let a few slip to a sweep woken otherwise, or to a late notification)
        assert driver.launched < 8 and waiter.poll_hits >= 4, (driver.launched, waiter.poll_hits)
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_an_unarmed_wait_its_polls_miss_is_notified_when_its_window_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wait predicted short but much longer (the stream got slower): its polls end without
    the completion, the notification is enqueued then, and it wakes the task long before the
    safety sweep."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter(
        "hybrid", window_s=0.004, lazy_arm_s=0.05, safety_timeout_s=5.0, loop_timer=False
    )
    waiter.start()
    try:
        for delay in (0.02, 0.02, 0.3):
            event = ArmableEvent(delay, driver)
            waiter.arm(event, FakeStream(14))
            start = time.perf_counter()
            with anyio.fail_after(10.0):
                await waiter.wait(event)
            elapsed = time.perf_counter() - start
        assert elapsed < 2.0  # the notification, not the 5 s safety sweep
        assert driver.launched >= 2  # the first wait's and the late one's
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_a_failing_driver_call_degrades_to_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", loop_timer=False)
    waiter.start()

    def broken(stream: int, fn: int, sem: int) -> int:
        return 999

    driver.cuLaunchHostFunc = broken  # type: ignore[method-assign]
    try:
        event = ArmableEvent(0.03, driver)
        waiter.arm(event, FakeStream(1))  # hybrid enqueues the notification at the wait
        with anyio.fail_after(5.0):
            await waiter.wait(event)
        assert waiter.strategy == "poll" and waiter.degraded
        later = ArmableEvent(0.03, driver)
        waiter.arm(later, FakeStream(1))
        with anyio.fail_after(5.0):
            await waiter.wait(later)  # polled
    finally:
        await anyio.to_thread.run_sync(waiter.close)


class ManualEvent:
    """Completes when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        while not self.done:
            time.sleep(1e-4)


async def _until(condition: Any) -> None:
    with anyio.fail_after(5):
        while not condition():
            await anyio.lowlevel.checkpoint()


async def test_an_event_expected_soon_is_polled_on_the_loop_without_the_thread() -> None:
    waiter = EventWaiter("poll", loop_poll_s=10.0)  # a long window: the test sets the pace
    event = ManualEvent()
    waiter.arm(event, None, expected_at=time.monotonic() + 5.0)
    finished = anyio.Event()

    async def wait() -> None:
        await waiter.wait(event)
        finished.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        for _ in range(20):  # the loop keeps polling while the event is pending
            await anyio.lowlevel.checkpoint()
        assert not finished.is_set()
        event.done = True
        await _until(finished.is_set)
    assert waiter.loop_hits == 1
    assert waiter._thread is None, "no thread was needed"


async def test_a_late_event_is_handed_from_the_loop_to_the_thread() -> None:
    waiter = EventWaiter("poll", loop_poll_s=1e-3)
    event = ManualEvent()
    waiter.arm(event, None, expected_at=time.monotonic())
    finished = anyio.Event()

    async def wait() -> None:
        await waiter.wait(event)
        finished.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await _until(lambda: waiter.pending_count() == 1)  # past its deadline: the thread's
        event.done = True
        await _until(finished.is_set)
    assert waiter.loop_hits == 0
    await anyio.to_thread.run_sync(waiter.close)


async def test_events_not_expected_soon_go_to_the_thread_at_once() -> None:
    waiter = EventWaiter("poll", loop_poll_s=1e-3)
    event = ManualEvent()
    waiter.arm(event, None, expected_at=time.monotonic() + 1.0)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(waiter.wait, event)
        await _until(lambda: waiter.pending_count() == 1)
        event.done = True
    assert waiter.loop_hits == 0
    await anyio.to_thread.run_sync(waiter.close)


async def test_closing_the_waiter_fails_a_wait_polled_on_the_loop() -> None:
    waiter = EventWaiter("poll", loop_poll_s=10.0)
    event = ManualEvent()
    waiter.arm(event, None, expected_at=time.monotonic() + 5.0)
    failed = anyio.Event()

    async def wait() -> None:
        with pytest.raises(RuntimeError, match="closed"):
            await waiter.wait(event)
        failed.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await _until(lambda: bool(waiter._loop_pollers))
        await anyio.to_thread.run_sync(waiter.close)
        await _until(failed.is_set)


class CountingEvent(ManualEvent):
    """A manual event that counts its queries."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


class RecordingBridge:
    """Collects what a sweep hands to the loop."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def call_soon_quietly(self, fn: Any, *args: Any) -> None:
        self.batches.append((fn, args))

    def on_loop(self) -> bool:
        return False  # a loop of its own: watch() takes the thread's path


def test_a_sweep_queries_each_stream_oldest_first_and_stops_at_its_first_pending_event() -> None:
    """Events of one stream complete in record order: a sweep that finds a stream's oldest
    awaited event pending does not query the later ones (a burst of 64 copies costs a query
    per completion, not 64 per wake). Events of other streams, or without a known stream,
    are queried for themselves."""
    waiter = EventWaiter("poll")  # never started: the test runs the sweeps itself
    bridge = RecordingBridge()
    a = [CountingEvent() for _ in range(4)]
    b = [CountingEvent() for _ in range(2)]
    for event in a:
        waiter.arm(event, FakeStream(1))
    for event in b:
        waiter.arm(event, FakeStream(2))
    unknown = CountingEvent()  # recorded elsewhere: no stream, no order
    waiter.arm(unknown, None)
    resolved: list[Any] = []
    for event in [a[3], b[1], unknown, a[1], b[0], a[0], a[2]]:  # watched out of order
        notes = waiter_module.EventNotes.of(event)
        assert notes is not None
        entry = waiter_module._Pending(event, bridge, resolved.append, notes.origin)  # type: ignore[arg-type]
        entry.seq = notes.seq if notes.origin is not None else 0
        waiter._pending.append(entry)
    a[0].done = a[1].done = unknown.done = True
    assert waiter._sweep() == 3
    assert [e.queries for e in a] == [1, 1, 1, 0], "stopped at a[2], never asked a[3]"
    assert [e.queries for e in b] == [1, 0], "stopped at b[0]"
    assert unknown.queries == 1
    for event in (*a, *b):
        event.done = True
    assert waiter._sweep() == 4 and waiter.pending_count() == 0
    for fn, args in bridge.batches:
        fn(*args)
    assert len(resolved) == 7


async def test_a_burst_of_hybrid_waits_wakes_the_thread_once_not_per_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    loop_thread = threading.get_ident()
    posts = []
    real_libc = driver.libc

    class CountingLibc:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_libc, name)

        def sem_post(self, sem: Any) -> int:
            if threading.get_ident() == loop_thread:
                posts.append(sem)
            return int(real_libc.sem_post(sem))

    driver.libc = CountingLibc()  # type: ignore[assignment]
    waiter = EventWaiter("hybrid", loop_timer=False)
    waiter.start()
    try:
        events = []
        for i in range(32):  # a stream's queue: each expected after the one before
            event = ArmableEvent(0.05 + 0.001 * i, driver)
            waiter.arm(event, FakeStream(9), expected_at=time.monotonic() + 1.0 + 0.01 * i)
            events.append(event)
        with anyio.fail_after(5.0):
            async with anyio.create_task_group() as waits:
                for event in events:
                    waits.start_soon(waiter.wait, event)
        assert waiter.pending_count() == 0
        # A handful, not one per wait (32): a loaded machine lets the thread go back to sleep
        # between two of the waits now and then (5 seen once beside CPU hogs).
        assert len(posts) <= 8, f"{len(posts)} wake-ups of the thread for 32 waits"
    finally:
        await anyio.to_thread.run_sync(waiter.close)


# ------------------------------------------------- the loop's timed polls (hybrid, asyncio)

# The loop's own timed polls, on every loop (asyncio and uvloop with a reader callback, trio
# with a system task).


class QueriedEvent(ArmableEvent):
    """An armable fake event that notes when each query came (``time.monotonic``)."""

    def __init__(self, delay: float, driver: FakeDriver, notified: bool = True) -> None:
        super().__init__(delay, driver)
        self.started = time.monotonic()
        self.queries: list[float] = []
        self.threads: list[int] = []  # who made each query
        if not notified:  # its notification waits on an event that never completes
            driver.events[self.cuda_event] = FakeEvent(3600.0)

    def query(self) -> bool:
        self.queries.append(time.monotonic())
        self.threads.append(threading.get_ident())
        return super().query()


def test_a_timerfd_becomes_readable_at_the_monotonic_time_it_was_armed_for() -> None:
    timer = Timerfd.create()
    if timer is None:
        pytest.skip("no timerfd on this system")
    try:
        at = time.monotonic() + 0.05
        timer.arm(at)
        assert select.select([timer.fd], [], [], 0)[0] == []  # not yet
        assert select.select([timer.fd], [], [], 5.0)[0] == [timer.fd]
        assert time.monotonic() >= at
        timer.clear()
        assert select.select([timer.fd], [], [], 0)[0] == []  # consumed
        timer.arm(time.monotonic() - 1.0)  # in the past: at once
        assert select.select([timer.fd], [], [], 5.0)[0] == [timer.fd]
        timer.arm(time.monotonic() + 60.0)  # setting it again consumes the unread expiry
        assert select.select([timer.fd], [], [], 0)[0] == []
        timer.arm(time.monotonic() - 1.0)
        assert select.select([timer.fd], [], [], 5.0)[0] == [timer.fd]
        timer.disarm()  # so does stopping it
        assert select.select([timer.fd], [], [], 0.05)[0] == []
    finally:
        timer.close()


async def test_hybrid_waits_on_the_loops_thread_are_polled_by_the_loop_not_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waits of 30 ms, predicted within ``lazy_arm_s`` (so no host function is enqueued for
    them), whose notifications would never come: the loop's timed polls see each one and the
    waiter thread is never woken."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter(
        "hybrid", loop_timer=True, window_s=1.0, lazy_arm_s=1.0, safety_timeout_s=10.0
    )
    waiter.start()
    try:
        for _ in range(5):
            event = QueriedEvent(0.03, driver, notified=False)
            waiter.arm(event, FakeStream(21))
            with anyio.fail_after(5.0):
                await waiter.wait(event)
        assert waiter.timer_hits == 5
        assert waiter.wakeups == 0 and waiter.poll_hits == 0 and driver.launched == 0
        assert len(waiter.predictor.history((0, 21))) == 5  # each wait feeds the prediction
        # One poller for the loop, though every wait() made a bridge of its own.
        assert len(waiter._loop_timers) == 1 and None not in waiter._loop_timers.values()
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_timed_polls_begin_near_a_streams_predicted_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the first waits of a stream, the loop does not query a 60 ms wait's event until
    shortly before its predicted end (2% + 40 us of lead), and then only a few dozen times."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", loop_timer=True, window_s=1.0, safety_timeout_s=10.0)
    waiter.start()
    try:
        watched: dict[QueriedEvent, float] = {}  # when watch() returned, for each event
        watch = waiter.watch

        def noting_watch(event: QueriedEvent, *args: Any) -> None:
            watch(event, *args)
            watched[event] = time.monotonic()

        monkeypatch.setattr(waiter, "watch", noting_watch)
        events = []
        for _ in range(5):
            event = QueriedEvent(0.06, driver, notified=False)
            waiter.arm(event, FakeStream(22))
            with anyio.fail_after(5.0):
                await waiter.wait(event)
            events.append(event)
        loop_thread = threading.get_ident()
        for event in events[1:]:
            # wait() and watch() query as the wait begins (which a loaded machine can stretch
            # over milliseconds), and the waiter thread once as it takes the new wait; after
            # that, the loop's polls come near the end.
            began = watched[event] - event.started
            polls = [t - event.started for t in event.queries]
            early = [
                round(t, 4)
                for t, who in zip(polls, event.threads, strict=True)
                if who == loop_thread and began < t < 0.05
            ]
            by_thread = [
                round(t, 4)
                for t, who in zip(polls, event.threads, strict=True)
                if who != loop_thread and t < 0.05
            ]
            history = waiter.predictor.history((0, 22))
            assert not early, ("early polls by the loop", early, began, polls, history)
            assert len(by_thread) <= 1, ("early queries by the thread", by_thread, began, polls)
            assert len(polls) < 100, len(polls)  # 20 us polls from the start: ~3,000
        first = [t - events[0].started for t in events[0].queries]
        assert [t for t in first if 0.005 < t < 0.05]  # no history: polled from the start,
        assert len(first) < 150, len(first)  # less and less often
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_a_wait_the_loops_polls_miss_goes_to_the_threads_notification(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 150 ms wait whose 4 ms window of polls ends first: handed to the thread with its
    host function enqueued at once, which wakes it; the thread does not poll it."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", loop_timer=True, window_s=0.004, safety_timeout_s=10.0)
    waiter.start()
    try:
        event = QueriedEvent(0.15, driver)
        waiter.arm(event, FakeStream(23))
        with anyio.fail_after(5.0):
            await waiter.wait(event)
        assert driver.launched == 1 and waiter.timer_hits == 0 and waiter.poll_hits == 0
        # The thread noted the whole wait, from its start on the loop (not from the hand-over).
        assert waiter.predictor.history((0, 23))[-1] >= 0.14
        loop = threading.get_ident()
        on_loop = [t for t, who in zip(event.queries, event.threads) if who == loop]
        assert max(on_loop) - event.started < 0.1  # the loop stopped polling at the hand-over
        # and the thread never polled it: a few queries at the hand-over and the notification
        # (polls for a 4 ms window every 40 us would be ~100)
        assert len(event.queries) - len(on_loop) < 10, len(event.queries) - len(on_loop)
        assert event.query()
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_a_wait_far_shorter_than_predicted_is_woken_by_its_notification(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's waits of 60 ms, then one of 5 ms: predicted beyond ``lazy_arm_s``, it has
    its notification enqueued besides the loop's polls, and the notification wakes it long
    before the polls would; the polls' entry then goes quietly, calling nobody twice."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", loop_timer=True, window_s=1.0, safety_timeout_s=10.0)
    waiter.start()
    try:
        for _ in range(3):
            event = QueriedEvent(0.06, driver)
            waiter.arm(event, FakeStream(28))
            with anyio.fail_after(5.0):
                await waiter.wait(event)
        (poller,) = waiter._loop_timers.values()
        assert poller is not None
        # The earlier waits' notifications may have beaten their polls: their entries go at
        # their next poll, which would query every entry (the short wait's too). Let them go.
        await _until(lambda: not poller.entries)
        hits, launched, calls = waiter.timer_hits, driver.launched, []
        called_at: list[float] = []
        called = anyio.Event()

        def note(error: BaseException | None) -> None:
            called_at.append(time.monotonic())
            calls.append(error)
            called.set()

        short = QueriedEvent(0.005, driver)
        waiter.arm(short, FakeStream(28))
        waiter.watch(short, LoopBridge.current(), note)
        watched = time.monotonic()  # watch() queries as it begins (a loaded machine may
        # stretch that): the loop's polls come after this. The loop sleeps until the call:
        # spinning on it would hold the GIL from the threads that complete the fake event
        # and post its notification, and delay both by tens of milliseconds.
        with anyio.fail_after(5):
            await called.wait()
        assert calls == [None] and driver.launched == launched + 1
        loop = threading.get_ident()
        polls = [t for t, w in zip(short.queries, short.threads) if w == loop]
        early = [round(t - short.started, 4) for t in polls if watched < t < called_at[0]]
        assert not early  # no poll of the loop's came before the notification woke it
        await _until(lambda: not poller.entries)  # its polls began, found it done, dropped it
        assert calls == [None] and waiter.timer_hits == hits
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_a_wait_far_longer_than_predicted_costs_few_polls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's waits of 10 ms, then one of 300 ms: its polls grow apart (a tenth of how
    late it is), so the long wait is queried tens of times, not every 20 us (15,000)."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", loop_timer=True, window_s=2.0, safety_timeout_s=10.0)
    waiter.start()
    try:
        for delay in (0.01, 0.01, 0.01, 0.3):
            hits = waiter.timer_hits
            event = QueriedEvent(delay, driver, notified=False)
            waiter.arm(event, FakeStream(24))
            with anyio.fail_after(5.0):
                await waiter.wait(event)
        # The long wait was seen by the loop's polls (a short one may go to the thread on a
        # loaded machine, when the loop comes back after its polls' window).
        assert waiter.timer_hits == hits + 1
        assert len(event.queries) < 200, len(event.queries)
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_closing_the_waiter_fails_timed_waits_and_frees_the_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", loop_timer=True, window_s=100.0)
    waiter.start()
    event = QueriedEvent(3600.0, driver, notified=False)
    waiter.arm(event, FakeStream(25))
    failed = anyio.Event()

    async def wait() -> None:
        with pytest.raises(BackendClosedError, match="closed"):
            await waiter.wait(event)
        failed.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await _until(lambda: any(p is not None and p.entries for p in waiter._loop_timers.values()))
        (poller,) = waiter._loop_timers.values()
        await anyio.to_thread.run_sync(waiter.close)
        await _until(failed.is_set)
    assert poller is not None and poller.closed and poller.timer.fd == -1
    assert driver.launched == 0


async def test_a_cancelled_timed_wait_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The awaiting task goes away: its entry stays only until the event completes (then
    its callback finds nobody waiting), and later waits are served as before."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", loop_timer=True, window_s=1.0, safety_timeout_s=10.0)
    waiter.start()
    try:
        event = QueriedEvent(0.05, driver, notified=False)
        waiter.arm(event, FakeStream(26))
        with anyio.move_on_after(0.01) as scope:
            await waiter.wait(event)
        assert scope.cancelled_caught
        (poller,) = waiter._loop_timers.values()
        assert poller is not None
        await _until(lambda: not poller.entries)  # polled until it completed
        assert waiter.timer_hits == 1
        later = QueriedEvent(0.05, driver, notified=False)  # as predicted: the polls see it
        waiter.arm(later, FakeStream(26))
        with anyio.fail_after(5.0):
            await waiter.wait(later)
        assert waiter.timer_hits == 2 and not poller.entries
    finally:
        await anyio.to_thread.run_sync(waiter.close)


async def test_a_wait_whose_notes_say_armed_wrongly_is_still_resolved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An event whose notes say its notification is enqueued, though none will come (it was
    recorded again by someone else after an earlier wait): the loop's polls miss it (a 4 ms
    window, a 300 ms event) and hand it to the thread, asleep with nothing to do; the thread
    must wake and sweep, not sleep until a notification that never comes."""
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", loop_timer=True, window_s=0.004, safety_timeout_s=0.05)
    waiter.start()
    try:
        await _until(lambda: waiter._wake_at == float("inf"))  # asleep, no timeout
        event = QueriedEvent(0.3, driver, notified=False)
        notes = EventNotes.of(event)
        assert notes is not None
        notes.origin, notes.armed = (0, 29), True
        with anyio.fail_after(5.0):
            await waiter.wait(event)
        assert driver.launched == 0  # resolved by a sweep, not by a notification
    finally:
        await anyio.to_thread.run_sync(waiter.close)


def test_recording_an_event_again_makes_its_next_wait_enqueue_a_notification(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid")
    event = ArmableEvent(0.0, driver)
    waiter.arm(event, FakeStream(30))
    notes = EventNotes.of(event)
    assert notes is not None
    notes.armed = True  # as after a wait that enqueued its notification
    waiter.arm(event, FakeStream(30))  # recorded again
    assert not notes.armed
    waiter.close()


class RaisingEvent(QueriedEvent):
    """A query that raises, as a CUDA error would make it."""

    def query(self) -> bool:
        super().query()
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def test_a_timed_wait_whose_query_raises_ends_with_that_error_and_spares_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(waiter_module, "cuda_driver", lambda: driver)
    waiter = EventWaiter("hybrid", loop_timer=True, window_s=1.0)
    waiter.start()
    try:
        good = QueriedEvent(0.03, driver, notified=False)
        bad = RaisingEvent(0.03, driver, notified=False)
        outcomes: list[BaseException | None] = []
        bridge = LoopBridge.current()
        waiter.watch(good, bridge, outcomes.append)
        bad.query = lambda: False  # type: ignore[method-assign]  # pending while watched
        waiter.watch(bad, bridge, outcomes.append)
        del bad.query  # from now on its queries raise
        await _until(lambda: len(outcomes) == 2)
        errors = [o for o in outcomes if o is not None]
        assert len(errors) == 1 and "illegal memory access" in str(errors[0])
        assert None in outcomes  # the other wait was still polled and resolved
    finally:
        await anyio.to_thread.run_sync(waiter.close)


def test_a_wait_whose_event_completes_as_it_is_watched_is_called_back_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race a stress run on CI once hit: a sweep took its snapshot with the new entry in
    it and found the event complete, and the watcher's own second query found it complete
    too and called back, before the sweep took the entry out: the sweep called back again.
    Here the two threads are stepped through that order exactly."""
    waiter = EventWaiter("poll")
    monkeypatch.setattr(waiter, "start", lambda: None)  # the test runs the sweep itself
    watcher = threading.get_ident()
    appended, in_sweep, gate = threading.Event(), threading.Event(), threading.Event()

    class RacingEvent:
        def __init__(self) -> None:
            self.watcher_queries = 0

        def query(self) -> bool:
            if threading.get_ident() != watcher:  # the sweep: complete, but held there
                in_sweep.set()
                assert gate.wait(5.0)
                return True
            self.watcher_queries += 1
            if self.watcher_queries == 1:  # watch()'s first query: still pending
                return False
            appended.set()  # the second one, after the entry was appended
            assert in_sweep.wait(5.0)
            return True

    def sweep() -> None:
        assert appended.wait(5.0)
        waiter._sweep()

    bridge = RecordingBridge()
    calls: list[BaseException | None] = []
    sweeper = threading.Thread(target=sweep, daemon=True)
    sweeper.start()
    waiter.watch(RacingEvent(), bridge, calls.append)  # type: ignore[arg-type]
    gate.set()
    sweeper.join(5.0)
    assert not sweeper.is_alive()
    for fn, args in bridge.batches:
        fn(*args)
    assert calls == [None], f"called back {len(calls)} times"
    assert waiter.pending_count() == 0


async def test_a_wait_polled_on_the_loop_is_not_lost_to_another_waits_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three waits polled on the loop in one tick: one's query raises (that wait gets the
    error), one's callback raises (logged); the third is still called back, and later waits
    are still polled."""
    waiter = EventWaiter("poll", loop_poll_s=10.0)

    class BrokenEvent(ManualEvent):
        """Pending when watched; its next query (the loop's poll) raises."""

        def __init__(self) -> None:
            super().__init__()
            self.queries = 0

        def query(self) -> bool:
            self.queries += 1
            if self.queries > 1:
                raise RuntimeError("the device is gone")
            return False

    broken, raising, plain = BrokenEvent(), ManualEvent(), ManualEvent()
    for event in (broken, raising, plain):
        waiter.arm(event, None, expected_at=time.monotonic() + 5.0)
    bridge = LoopBridge.current()
    results: dict[str, BaseException | None] = {}

    def explode(_error: BaseException | None) -> None:
        results["raising"] = _error
        raise ValueError("a callback's own bug")

    waiter.watch(broken, bridge, lambda error: results.__setitem__("broken", error))
    waiter.watch(raising, bridge, explode)
    waiter.watch(plain, bridge, lambda error: results.__setitem__("plain", error))
    raising.done = plain.done = True
    with caplog.at_level("ERROR", logger="aresidency"):
        await _until(lambda: len(results) == 3)
    assert isinstance(results["broken"], RuntimeError)
    assert results["raising"] is None and results["plain"] is None
    assert "a callback of a wait polled on the loop raised" in caplog.text
    later = ManualEvent()
    waiter.arm(later, None, expected_at=time.monotonic() + 5.0)
    finished = anyio.Event()

    async def wait_later() -> None:
        await waiter.wait(later)
        finished.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait_later)
        later.done = True
        await _until(finished.is_set)
    assert waiter._thread is None, "every wait was the loop's"
