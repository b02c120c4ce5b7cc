"""The event waiter under a random mix of waits, on CPU: stand-in CUDA events that complete at
virtual times on in-order streams, can be recorded again (as a ``torch.cuda.Event`` can), and
whose host-function notifications post the semaphore once the recording they waited for
completed. Every wait must end (no lost wake-up), once, after its event completed, whatever the
mix of short and long waits, predictions right and wrong, events recorded again with or without
the backend, cancelled waits and waits from other threads."""

from __future__ import annotations

import itertools
import random
import threading
import time

import anyio
import pytest

from aresidency.backends.bridge import LoopBridge
from aresidency.backends.polling import EventNotes
from aresidency.backends.simdriver import SimNotifyDriver
from aresidency.backends.waiter import EventWaiter

pytestmark = pytest.mark.anyio


class VirtualStream:
    """An in-order stream: work recorded on it completes after the work before it."""

    device_index = 0

    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.busy_until = 0.0
        self.lock = threading.Lock()

    def schedule(self, seconds: float) -> float:
        with self.lock:
            self.busy_until = max(time.monotonic(), self.busy_until) + seconds
            return self.busy_until


class VirtualEvent:
    """Like a ``torch.cuda.Event``: complete once its latest recording's work ran (or when never
    recorded); ``record`` again makes it pending again."""

    ids = itertools.count(1)

    def __init__(self, driver: VirtualDriver) -> None:
        self.cuda_event = next(self.ids)
        self.device = None
        self.done_at = 0.0
        driver.events[self.cuda_event] = self

    def record(self, stream: VirtualStream, seconds: float) -> None:
        self.done_at = stream.schedule(seconds)

    def query(self) -> bool:
        return time.monotonic() >= self.done_at

    def synchronize(self) -> None:
        while not self.query():
            time.sleep(max(self.done_at - time.monotonic(), 0.0) + 1e-5)


class VirtualDriver(SimNotifyDriver):
    """The simulated driver calls of the waiter, for virtual events: a notify stream's wait
    captures the event's latest recording (CUDA semantics); its host function posts the
    semaphore once that completed, a little late, from another thread (the driver's callback
    thread)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.events: dict[int, VirtualEvent] = {}
        self.until: dict[int, float] = {}
        self.rng = rng

    def cuStreamWaitEvent(self, stream: int, handle: int, flags: int) -> int:
        self.until[stream] = self.events[handle].done_at
        return 0

    def cuLaunchHostFunc(self, stream: int, fn: int | None, data: int) -> int:
        at = self.until[stream]
        with self._lock:
            self.launched += 1
            lag = self.rng.uniform(0.0, 0.0005)

        def post() -> None:
            time.sleep(max(at - time.monotonic(), 0.0) + lag)
            self.libc.sem_post(data)

        threading.Thread(target=post, daemon=True).start()
        return 0


DURATIONS = (0.0001, 0.0005, 0.002, 0.004, 0.012, 0.03)


@pytest.mark.parametrize("loop_timer", [True, False], ids=["loop timer", "thread polls"])
@pytest.mark.parametrize("seed", [1, 2])
async def test_every_wait_of_a_random_mix_ends_once_after_its_event(
    loop_timer: bool, seed: int
) -> None:
    rng = random.Random(seed)
    driver = VirtualDriver(rng)
    waiter = EventWaiter(
        "hybrid",
        loop_timer=loop_timer,
        window_s=0.004,
        safety_timeout_s=0.05,
        lazy_arm_s=0.003,
        driver=driver,
    )
    waiter.start()
    streams = [VirtualStream(h) for h in (11, 12, 13)]
    shared = [VirtualEvent(driver) for _ in range(6)]  # recorded again and again
    late: list[tuple[float, float]] = []
    waits = 0

    def record(event: VirtualEvent, stream: VirtualStream, how: str, seconds: float) -> None:
        event.record(stream, seconds)
        if how == "backend":  # the backend records and arms, sometimes with an estimate
            expected = event.done_at * rng.choice((0.7, 1.0, 1.3)) if rng.random() < 0.5 else None
            waiter.arm(event, stream, expected)
        elif how == "device_event":  # recorded again outside arm(): its notes are stale
            notes = EventNotes.of(event)
            if notes is not None:
                notes.armed = False

    async def worker(index: int) -> None:
        nonlocal waits
        local = random.Random(seed * 100 + index)
        for _ in range(30):
            stream = local.choice(streams)
            fresh = local.random() >= 0.4
            event = VirtualEvent(driver) if fresh else local.choice(shared)
            how = local.choice(("backend", "backend", "device_event", "foreign"))
            record(event, stream, how, local.choice(DURATIONS))
            target = event.done_at
            if local.random() < 0.15:
                with anyio.move_on_after(local.uniform(0.0, 0.003)):
                    await waiter.wait(event)
                continue
            await waiter.wait(event)
            now = time.monotonic()
            waits += 1
            # An event of its own: the wait ended after its work ran (a shared one may have
            # been recorded again by another task meanwhile, on any stream, as in CUDA) ...
            if fresh:
                assert now >= target
            # ... and not far behind it: polls, a notification or a safety sweep saw it.
            if now - event.done_at > 0.25 and now - target > 0.25:
                late.append((target, now))

    # Waits from another thread, with callbacks, at the same time.
    bridge = LoopBridge.current()
    called: list[int] = []
    thread_done = threading.Event()

    def from_a_thread() -> None:
        local = random.Random(seed + 7)
        for i in range(20):
            event = VirtualEvent(driver)
            record(event, local.choice(streams), "backend", local.choice(DURATIONS))
            waiter.watch(event, bridge, lambda _error, i=i: called.append(i))
            time.sleep(0.002)
        thread_done.set()

    try:
        with anyio.fail_after(30.0):
            async with anyio.create_task_group() as tasks:
                for i in range(8):
                    tasks.start_soon(worker, i)
                await anyio.to_thread.run_sync(from_a_thread)
            while len(called) < 20:  # noqa: ASYNC110 (a plain list filled by callbacks)
                await anyio.sleep(0.01)
        assert sorted(called) == list(range(20)), "a callback ran twice or never"
        assert waits > 100
        assert not late, f"{len(late)} waits ended over 250 ms after their event: {late[:3]}"
        with anyio.fail_after(5.0):
            while waiter.pending_count():  # noqa: ASYNC110 (the thread's entries end too)
                await anyio.sleep(0.01)
    finally:
        await anyio.to_thread.run_sync(waiter.close)
