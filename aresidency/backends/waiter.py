"""Telling the event loop when CUDA events complete, without blocking the loop or spinning.

:class:`EventWaiter` watches CUDA events for the CUDA backend: :meth:`EventWaiter.watch` runs a
callback on the owning loop (asyncio, uvloop or trio, through a
:class:`~aresidency.backends.bridge.LoopBridge`) once the event completed. (Host-side
completions, :class:`~aresidency.backends.events.HostEvent`, need no waiter: their setter
calls back.) The waiter owns one background thread and one of four strategies:

  ``"hybrid"`` (the default when the driver offers it)
      ``"hostfunc"`` notifications plus polling where the completion is expected: the
      thread queries an awaited event every ``hybrid_poll_s`` (40 us) for at most
      ``window_s`` (4 ms) from its *predicted* completion on. The prediction is per origin
      stream: the shortest of its last eight waits (from ``wait`` to seen complete), less a
      lead of ``lead_fraction`` (8%) + ``lead_s`` (60 us), capped at ``window_s``, so a
      stream whose waits shrink is caught up in a few waits and one whose waits grow costs a
      few extra polls. With no history
      the polling starts at once. On an H200 (benchmarks/bench_copy.py, 2 ms kernel) a host
      function, like every interrupt-driven wake-up (blocking sync, a thread in
      ``synchronize()``), reached the loop 0.3-0.6 ms after the event, while a poll sees it
      within one interval; polling only near the predicted end keeps back-to-back waits
      from polling all the time. The notification itself costs CPU (the driver's callback
      thread, a wake-up of ours): it is enqueued when the wait begins, except for a wait
      predicted to end within ``lazy_arm_s`` (3 ms), whose notification is enqueued only if
      its polling window closes without the event (a notification enqueued after the
      completion fires at once). Such a short wait that ends before its predicted window is
      seen by the window's first poll, at most ``lazy_arm_s`` late, and only until the
      prediction has followed (the next wait). A notification enqueued late can reach its
      notify stream after that of a later event of the same origin stream; it then waits
      for that event too (a delay, bounded by the safety sweep). Measured on an H200
      (benchmarks/RESULTS.md): woken 81 us after the event on uvloop (median; 139 us on
      asyncio), 7-9% of a core for 20 ms waits and 16-18% for back-to-back 2 ms waits, where
      every strategy that wakes the loop from another thread costs 13-18%.

      **By default (``loop_timer=True``) the polls are the event loop's own** (Linux): a
      wait that begins on the loop's thread is polled by that loop, woken by a ``timerfd`` at
      the predicted end less a shorter lead (``timer_lead_fraction`` 2% + ``timer_lead_s`` 40
      us), every ``timer_poll_s`` (20 us) and then less often the later it is, for
      ``window_s``; a wait predicted beyond ``lazy_arm_s`` has its notification enqueued too
      (it may end early), and one still pending when its polls end goes to the thread, with
      its notification enqueued at once (:mod:`~aresidency.backends.looptimer`). No thread
      hop, no hand-over of the interpreter lock: on the H200 the task resumed 34-37 us after
      the event instead of 105-138 us, for 3-6% of a core above the harness's own instead
      of 11-12%. Trio's loop polls the same way (a system task waits on the timer). Waits
      begun on other threads, and loops that cannot watch a file descriptor (asyncio's
      proactor loop), are polled by the thread as described above; ``loop_timer=False``
      gives every wait to the thread.
  ``"hostfunc"``
      Right after an event is recorded on a stream, :meth:`EventWaiter.arm` makes a *notify
      stream* (one per origin stream, created with ``CU_STREAM_NON_BLOCKING``) wait for the
      event and then run libc's ``sem_post`` as a CUDA host function
      (``cuLaunchHostFunc``). The host function runs on the driver's callback thread without
      Python or the GIL. The waiter thread sleeps in ``sem_wait`` (ctypes releases the GIL),
      queries the awaited events when woken and resolves the completed ones with one
      ``call_soon_threadsafe`` per loop and batch. The origin stream never runs a host
      function, so copy streams get no bubbles; events of one origin stream complete in
      record order, so its notify stream never delays a notification.
  ``"poll"``
      The waiter thread queries the awaited events, sleeping between sweeps with a backoff
      from ``poll_min_s`` to ``poll_max_s`` (reset when something completes).
  ``"blocking"``
      Events are created with ``blocking=True`` (``cudaEventBlockingSync``); the waiter
      thread sleeps in ``synchronize()`` on the oldest awaited event, then sweeps.

Many waits at once
    Events of one stream complete in the order they were recorded (the backend numbers them
    when it arms them), so a sweep queries each stream's awaited events oldest first and stops
    at the first one still pending; events recorded elsewhere are queried for themselves. A
    new wait wakes the hybrid thread only if it wants polling before the thread's next planned
    wake-up. So a burst of 64 queued copies costs the thread a query per completion and one
    wake-up, not 64 queries at every wake and a wake-up per copy, and the interpreter lock it
    takes for them is not taken from the loop.

Short copies on the loop
    Whatever the strategy, an event the backend expects to complete within ``loop_poll_s``
    (250 us: a copy of known size on a copy stream, whose completion time it estimates from
    the bytes queued on that stream), awaited from the loop's own thread, is queried by the
    loop once per iteration until shortly after its expected completion; a late one goes on
    to the loop's timed polls where it has them (hybrid), else to the thread. Every such event
    of a loop is queried by one callback. On an H200 a 4 KiB copy is seen 25 us after it was
    issued this way (19 us by a thread spinning on ``query()``), where a hop from any other
    thread to an asyncio loop costs 50-100 us.

Why this module is long: the four strategies share one thread's state (the awaited events
under one lock, the notify streams, the semaphore its sleeps wait on), and choosing between
the loop's polls and that thread needs both sides; what stands apart already lives apart (the
prediction in ``prediction``, the loop's polls in ``polling`` and ``looptimer``, the driver
calls in ``cudadriver``).

Reference figures for an H200 (docs/performance.md): polling with ``asyncio.sleep(0)`` burns
a core; polling every 100 us costs about 6% of a core and adds about 0.1 ms; a thread blocked
in ``event.synchronize()`` wakes about 0.2 ms later and added about 1 ms of loop lag at p99.
``benchmarks/bench_copy.py`` measures the strategies side by side (``--uvloop`` for uvloop).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import anyio

from .bridge import LoopBridge
from .cudadriver import CudaDriver, Timespec, cuda_driver, hostfunc_available
from .looptimer import LoopTimerPoller
from .polling import (
    EventNotes,
    LoopPoller,
    closed_error,
    next_record,
    set_timer_slack,
    spin_wait,
)
from .prediction import WaitPredictor

__all__ = [
    "STRATEGIES",
    "EventWaiter",
    "hostfunc_available",
    "spin_wait",
]

Callback = Callable[[BaseException | None], None]

STRATEGIES: Final = ("hybrid", "hostfunc", "poll", "blocking")


# ------------------------------------------------------------------ the waiter


class _Pending:
    __slots__ = ("added", "armed", "bridge", "callback", "event", "key", "poll_from", "seq")

    def __init__(
        self,
        event: Any,
        bridge: LoopBridge,
        callback: Callback,
        key: Any = None,
        added: float = 0.0,
        poll_from: float = 0.0,
    ):
        self.event = event
        self.bridge = bridge  # the loop the callback runs on
        self.callback = callback
        self.key = key  # the origin stream (device, stream handle): one prediction each
        self.added = added  # time.monotonic() when the wait began
        self.poll_from = poll_from  # hybrid: polling starts here
        self.armed = True  # hybrid: False while the notification is not enqueued yet
        # Record order on its origin stream (0: unknown). Events of one stream complete in
        # record order, so a sweep stops at a stream's first event still pending.
        self.seq = 0

    def sort_key(self) -> tuple[int, int, int]:
        key = self.key
        if self.seq and key is not None and key[1] is not None:
            return (0, hash(key), self.seq)
        return (1, 0, 0)


class EventWaiter:
    """Parks tasks until CUDA events complete; one background thread, see the module docstring.

    State: ``_pending`` (the watched events and their callbacks, guarded by ``_cond``),
    ``_notify`` (origin stream key -> notify stream handle, ``hostfunc`` only), ``_closed``,
    ``_loop_pollers`` (one per loop that has events polled on it). What the waiter knows of
    one event (its origin stream, when it is expected, whether its notification is enqueued)
    is noted on the event object itself (:class:`EventNotes`): never in a weak-keyed table,
    because a weak reference to a ``torch.cuda.Event`` corrupted the interpreter's memory
    when the event was freed on an H200 with torch 2.11 (the garbage collector then crashed).
    Invariants: an entry leaves ``_pending`` only when its event has completed (its callback
    then runs on its loop with ``None``) or when the waiter closes (its callback then gets a
    ``BackendClosedError``); every event armed posts the semaphore once after it completes.

    ``driver``: what enqueues the notifications (the CUDA driver by default;
    :class:`~aresidency.backends.simdriver.SimNotifyDriver` for simulated events).
    """

    def __init__(
        self,
        strategy: str = "auto",
        *,
        poll_min_s: float = 50e-6,
        poll_max_s: float = 1e-3,
        hybrid_poll_s: float = 40e-6,
        lead_fraction: float = 0.08,
        lead_s: float = 60e-6,
        window_s: float = 4e-3,
        safety_timeout_s: float = 0.05,
        lazy_arm_s: float = 3e-3,
        loop_poll_s: float = 250e-6,
        loop_timer: bool = True,
        timer_poll_s: float = 20e-6,
        timer_lead_fraction: float = 0.02,
        timer_lead_s: float = 40e-6,
        driver: Any = None,
    ) -> None:
        if strategy == "auto":
            strategy = "hybrid" if driver is not None or hostfunc_available() else "poll"
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown waiting strategy {strategy!r}: expected one of {STRATEGIES}")
        if not timer_poll_s > 0:
            raise ValueError(
                f"timer_poll_s must be a positive number of seconds, got {timer_poll_s!r}"
            )
        for name, lead in (
            ("timer_lead_fraction", timer_lead_fraction),
            ("timer_lead_s", timer_lead_s),
        ):
            if not lead >= 0:
                raise ValueError(f"{name} must be >= 0, got {lead!r}")
        self.strategy = strategy
        self.poll_min_s = poll_min_s
        self.poll_max_s = poll_max_s
        self.hybrid_poll_s = hybrid_poll_s
        self.window_s = window_s
        self.predictor = WaitPredictor(
            lead_fraction=lead_fraction,
            lead_s=lead_s,
            timer_lead_fraction=timer_lead_fraction,
            timer_lead_s=timer_lead_s,
            window_s=window_s,
        )
        self.lazy_arm_s = lazy_arm_s
        self.loop_poll_s = loop_poll_s
        self.loop_timer = loop_timer
        self.timer_poll_s = timer_poll_s
        self._loop_pollers: dict[LoopBridge, LoopPoller] = {}
        # hybrid: per loop, its timer poller (None: that loop cannot have one)
        self._loop_timers: dict[LoopBridge, LoopTimerPoller | None] = {}
        self.loop_hits = 0  # completions seen by polling on the loop, once per iteration
        self.timer_hits = 0  # hybrid: completions seen by the loop's timed polls
        # hostfunc: a sweep happens at least this often while something is awaited, so a
        # notification that never comes (an event not armed in time) delays, never hangs.
        self.safety_timeout_s = safety_timeout_s
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        # hybrid: when the thread plans to wake next (monotonic; inf: only when posted), set
        # under _cond together with the plan; 0 while it is awake
        self._wake_at = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._notify: dict[tuple[int, int | None], int] = {}
        self._driver: CudaDriver | None = driver
        self._sem: ctypes.Array[ctypes.c_char] | None = None
        self.wakeups = 0  # times the thread woke up (diagnostics, benchmarks)
        self.poll_hits = 0  # hybrid: completions first seen by a poll, not a notification
        self.degraded: str | None = None  # why hostfunc fell back to polling, if it did
        if strategy in ("hybrid", "hostfunc"):
            if self._driver is None:
                self._driver = cuda_driver()
            self._sem = self._driver.new_semaphore()

    @property
    def driver(self) -> Any:
        """What enqueues the notifications (None for the strategies that need none)."""
        return self._driver

    @property
    def blocking_events(self) -> bool:
        """Whether events to be awaited must be created with ``blocking=True``."""
        return self.strategy == "blocking"

    def start(self) -> None:
        """Start the thread (idempotent). Called on the loop by the backend's ``start``."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the event waiter is closed")
            if self._thread is not None:
                return
            target = {
                "hybrid": self._run_hybrid,
                "hostfunc": self._run_hostfunc,
                "poll": self._run_poll,
                "blocking": self._run_blocking,
            }[self.strategy]
            self._thread = threading.Thread(
                target=target, name=f"aresidency-waiter-{self.strategy}", daemon=True
            )
            self._thread.start()

    # -- arming (hostfunc)

    def arm(self, event: Any, stream: Any, expected_at: float | None = None) -> None:
        """Call right after recording ``event`` on the CUDA ``stream``: note its origin
        stream, and (``hostfunc``) enqueue its notification; ``hybrid`` enqueues it when the
        event is awaited (see the module docstring). ``expected_at``: when (``time.monotonic``)
        the work before the event should be done, if the caller knows (a copy of known size).
        The host does not wait; the origin stream gets no work. Thread-safe."""
        notes = EventNotes.of(event)
        if notes is None:
            return
        notes.expected_at = expected_at
        notes.armed = False  # a new recording: a notification enqueued for an earlier one is spent
        if stream is not None:
            notes.origin = (int(stream.device_index), int(stream.cuda_stream))
            notes.seq = next_record()
        if self.strategy not in ("hybrid", "hostfunc") or self._closed:
            return
        if self.strategy == "hybrid" or notes.origin is None:
            return
        try:
            self._arm_on(event, *notes.origin)
        except RuntimeError as exc:
            self._degrade(exc)

    def _degrade(self, exc: BaseException) -> None:
        """A driver call failed: fall back to polling (the thread switches when woken)."""
        with self._cond:
            if self.strategy not in ("hybrid", "hostfunc"):
                return
            self.strategy = "poll"
            self.degraded = f"hostfunc notification failed ({exc}); polling instead"
            self._cond.notify_all()
        assert self._driver is not None and self._sem is not None
        self._driver.libc.sem_post(ctypes.addressof(self._sem))

    def _arm_on(self, event: Any, device: int, key: int | None) -> None:
        driver = self._driver
        assert driver is not None and self._sem is not None
        with self._cond:
            notify = self._notify.get((device, key))
            if notify is None:
                notify = self._notify[(device, key)] = driver.create_stream(device)
            sem = ctypes.addressof(self._sem)
            handle = int(event.cuda_event)

            def enqueue() -> int:
                code = int(driver.cuda.cuStreamWaitEvent(notify, handle, 0))
                if code != 0:
                    return code
                return int(driver.cuda.cuLaunchHostFunc(notify, driver.sem_post_ptr, sem))

            # Under the lock: the notify stream receives its waits in record order.
            driver.call_in(device, enqueue, "cuStreamWaitEvent/cuLaunchHostFunc")
            notes = EventNotes.of(event)
            if notes is not None:
                notes.armed = True

    # -- waiting

    def watch(self, event: Any, bridge: LoopBridge, callback: Callback) -> None:
        """Run ``callback(None)`` on ``bridge``'s loop once ``event`` completes (or
        ``callback(BackendClosedError)`` if the waiter closes first); never in this call. The
        loop is not blocked and no thread spins: the waiter thread hands each batch of
        completions to a loop with one ``call_soon_threadsafe``. An event the backend expects
        within ``loop_poll_s`` (see :meth:`arm`), watched on its own loop, is instead queried
        by that loop once per iteration until then, which saves the thread hop (the way a
        short copy is seen within microseconds). Thread-safe."""
        if event.query():
            bridge.call_soon_quietly(callback, None)
            return
        if self._closed:
            bridge.call_soon_quietly(callback, closed_error())
            return
        notes = EventNotes.of(event)
        if self.loop_poll_s > 0 and bridge.on_loop() and notes is not None:
            expected_at = notes.expected_at
            if expected_at is not None:
                now = time.monotonic()
                if expected_at - now <= self.loop_poll_s:
                    # Due within a few polls: polled on the loop, no thread hop.
                    deadline = min(now + self.loop_poll_s, max(expected_at, now) + 50e-6)
                    self._loop_poller(bridge).add(event, callback, deadline)
                    return
        if self._timed_on(bridge):
            poller = self._loop_timer_of(bridge)
            if poller is not None:
                self._watch_timed(event, bridge, callback, poller)
                return
        self._watch_thread(event, bridge, callback)

    def _loop_poller(self, bridge: LoopBridge) -> LoopPoller:
        poller = self._loop_pollers.get(bridge)
        if poller is None:
            poller = self._loop_pollers[bridge] = LoopPoller(self, bridge)
        return poller

    def _loop_timer_of(self, bridge: LoopBridge) -> LoopTimerPoller | None:
        if bridge not in self._loop_timers:
            self._loop_timers[bridge] = LoopTimerPoller.create(self, bridge, self.timer_poll_s)
        return self._loop_timers[bridge]

    def _watch_late(self, event: Any, bridge: LoopBridge, callback: Callback) -> None:
        """An event polled once per loop iteration is late (the loop's thread): the loop's
        timed polls go on from now where it has them (not feeding the prediction: the wait's
        start is not known), else the thread watches it."""
        poller = self._loop_timer_of(bridge) if self._timed_on(bridge) else None
        if poller is None:
            self._watch_thread(event, bridge, callback)
            return
        now = time.monotonic()
        poller.add(event, callback, None, now, now, now + self.window_s)

    def _timed_on(self, bridge: LoopBridge) -> bool:
        """Whether waits on ``bridge``'s loop may be polled by that loop (calling thread)."""
        return self.strategy == "hybrid" and self.loop_timer and bridge.on_loop()

    def _watch_timed(
        self, event: Any, bridge: LoopBridge, callback: Callback, poller: LoopTimerPoller
    ) -> None:
        """:meth:`watch` by the loop's own timed polls (hybrid, on the loop thread): from the
        predicted completion less a short lead, for ``window_s``; then the thread's
        notification (see :mod:`~aresidency.backends.looptimer`)."""
        now = time.monotonic()
        notes, key = self._origin_of(event)
        predicted = self._delay(notes, key, now, timer=True)
        poll_from = now + predicted
        notified = predicted > self.lazy_arm_s
        if notified:
            # A long wait may end well before its prediction (a stream's history holds
            # longer waits): its notification is enqueued now as well, and whichever of the
            # two sees the completion first calls back.
            callback = _FirstOnly(callback)
            self._watch_thread(event, bridge, callback, started=now, notify_only=True)
        poller.add(event, callback, key, now, poll_from, poll_from + self.window_s, notified)

    @staticmethod
    def _origin_of(event: Any) -> tuple[EventNotes | None, Any]:
        """The event's notes and the key of its origin stream (a per-device key for an
        event recorded elsewhere than by the backend)."""
        notes = EventNotes.of(event)
        key = notes.origin if notes is not None else None
        if key is None:
            device = getattr(event, "device", None)
            key = (
                int(device.index) if device is not None and device.index is not None else 0,
                None,
            )
        return notes, key

    def _watch_thread(
        self,
        event: Any,
        bridge: LoopBridge,
        callback: Callback,
        *,
        started: float | None = None,
        notify_only: bool = False,
    ) -> None:
        """:meth:`watch` through the waiter thread (any thread). ``notify_only``: the loop
        polls for it, or its polls missed it (the wait began at ``started``): its
        notification is enqueued now and the thread does not poll for it."""
        if self._thread is None:
            self.start()
        notes, key = self._origin_of(event)
        now = time.monotonic()
        entry = _Pending(event, bridge, callback, key, now if started is None else started, now)
        if notes is not None and notes.origin is not None:
            entry.seq = notes.seq
        predicted = float("inf") if notify_only else self._delay(notes, key, now, timer=False)
        entry.poll_from = now + predicted
        if self.strategy in ("hybrid", "hostfunc") and not (notes is not None and notes.armed):
            if self.strategy == "hybrid" and 0 < predicted <= self.lazy_arm_s:
                entry.armed = False  # the thread arms it if its polls miss the completion
            else:
                try:
                    self._arm_on(event, *key)
                except RuntimeError as exc:
                    self._degrade(exc)
        with self._cond:
            self._pending.append(entry)
            self._cond.notify()
            # The hybrid thread sleeps until its next poll (computed under this lock): wake it
            # only if this wait wants polling sooner, or if it sleeps with no timeout at all (a
            # burst of copies posts once, not once per copy). A wait whose notification is
            # enqueued would be woken by it, but one that the event's notes wrongly call armed
            # (an event recorded again by someone else) would then wait forever: now it gets
            # the thread's safety sweeps at least.
            reschedule = entry.poll_from < self._wake_at or self._wake_at == float("inf")
        if (
            reschedule
            and self.strategy == "hybrid"
            and self._driver is not None
            and self._sem is not None
        ):
            self._driver.libc.sem_post(ctypes.addressof(self._sem))  # reschedule the polls
        # The notification may have come and gone between the first query and the append
        # (the thread then swept without this entry): query again now that it is visible.
        # If this query says pending, the completion, hence the post, comes after the append.
        if event.query():
            with self._cond:
                if entry in self._pending:
                    self._pending.remove(entry)
                else:
                    return  # the thread swept it meanwhile: its callback is on its way
            bridge.call_soon_quietly(callback, None)

    async def wait(self, event: Any) -> None:
        """Park the task until ``event`` completes (:meth:`watch` with an ``anyio.Event``).
        Raises ``BackendClosedError`` if the waiter closes first."""
        if event.query():
            return
        done = anyio.Event()
        outcome: list[BaseException | None] = []

        def complete(error: BaseException | None) -> None:
            outcome.append(error)
            done.set()

        self.watch(event, LoopBridge.current(), complete)
        await done.wait()
        if outcome[0] is not None:
            raise outcome[0]

    def pending_count(self) -> int:
        with self._cond:
            return len(self._pending)

    def _record_wait(self, key: Any, seconds: float) -> None:
        """A wait on ``key``'s stream took ``seconds`` (the loop's timed polls report here)."""
        self.predictor.record(key, seconds)

    def _delay(self, notes: EventNotes | None, key: Any, now: float, *, timer: bool) -> float:
        """Hybrid: seconds from ``now`` until a wait's polls begin (see
        :class:`~aresidency.backends.prediction.WaitPredictor`); 0 for the other strategies."""
        if self.strategy != "hybrid":
            return 0.0
        return self.predictor.delay(notes, key, now, timer=timer)

    def _sweep(self) -> int:
        """Resolve the entries whose event completed; returns how many. Waiter thread only.
        Events of one origin stream are queried oldest first, down to the first one still
        pending (the later ones are then pending too): a burst of copies on one stream costs a
        query per completion, not one per copy at every wake."""
        with self._cond:
            entries = sorted(self._pending, key=_Pending.sort_key)
        done = []
        blocked: set[Any] = set()  # origin streams whose oldest awaited event is pending
        for p in entries:
            ordered = p.seq and p.key is not None and p.key[1] is not None
            if ordered and p.key in blocked:
                continue
            if p.event.query():
                done.append(p)
            elif ordered:
                blocked.add(p.key)
        if not done:
            return 0
        finished = {id(p) for p in done}
        now = time.monotonic()
        with self._cond:
            # Only the entries still pending are this sweep's to call back: between the
            # snapshot and now, the watcher's own second query (see :meth:`_watch_thread`)
            # may have taken one out and called it back itself.
            still = {id(p) for p in self._pending}
            done = [p for p in done if id(p) in still]
            self._pending = [p for p in self._pending if id(p) not in finished]
        if not done:
            return 0
        for p in done:
            self.predictor.record(p.key, now - p.added)
        by_loop: dict[LoopBridge, list[Callback]] = {}
        for p in done:
            by_loop.setdefault(p.bridge, []).append(p.callback)
        for bridge, callbacks in by_loop.items():
            bridge.call_soon_quietly(_run_batch, callbacks)
        return len(done)

    def _run_hostfunc(self) -> None:
        driver = self._driver
        assert driver is not None and self._sem is not None
        sem = ctypes.addressof(self._sem)
        libc = driver.libc
        timeout = Timespec()
        while True:
            with self._cond:
                idle = not self._pending
            if idle:
                libc.sem_wait(sem)  # EINTR simply loops
            else:
                deadline = time.time() + self.safety_timeout_s
                timeout.tv_sec = int(deadline)
                timeout.tv_nsec = int((deadline - int(deadline)) * 1e9)
                libc.sem_timedwait(sem, ctypes.byref(timeout))
            while libc.sem_trywait(sem) == 0:
                pass  # one sweep serves every notification that arrived meanwhile
            self.wakeups += 1
            if self._closed:
                return
            if self.strategy != "hostfunc":
                self._run_poll()  # degraded
                return
            self._sweep()

    def _run_hybrid(self) -> None:
        driver = self._driver
        assert driver is not None and self._sem is not None
        set_timer_slack()
        sem = ctypes.addressof(self._sem)
        libc = driver.libc
        timeout = Timespec()
        while True:
            now = time.monotonic()
            with self._cond:
                # Poll while some entry is inside its window; otherwise sleep until the next
                # window opens, a notification (or a new wait) posts, or the safety sweep.
                # An unarmed entry whose window closed gets its notification now.
                delay: float | None = None
                unarmed = []
                for p in self._pending:
                    end = p.poll_from + self.window_s
                    if not p.armed and now >= end:
                        p.armed = True
                        unarmed.append(p)
                    if p.poll_from <= now < end:
                        delay = self.hybrid_poll_s
                    elif delay != self.hybrid_poll_s:
                        ahead = p.poll_from - now if p.poll_from > now else self.safety_timeout_s
                        delay = min(ahead, self.safety_timeout_s if delay is None else delay)
                self._wake_at = float("inf") if delay is None else now + delay
            for p in unarmed:
                try:
                    self._arm_on(p.event, *p.key)
                except RuntimeError as exc:
                    self._degrade(exc)
            if delay is None:
                libc.sem_wait(sem)
                posted = True
            else:
                deadline = time.time() + delay
                timeout.tv_sec = int(deadline)
                timeout.tv_nsec = int((deadline - int(deadline)) * 1e9)
                posted = libc.sem_timedwait(sem, ctypes.byref(timeout)) == 0
            while libc.sem_trywait(sem) == 0:
                posted = True
            with self._cond:
                self._wake_at = 0.0  # awake: it plans again before it sleeps
            self.wakeups += 1
            if self._closed:
                return
            if self.strategy != "hybrid":
                self._run_poll()  # degraded
                return
            found = self._sweep()
            if found and not posted:
                self.poll_hits += found

    def _run_poll(self) -> None:
        set_timer_slack()
        interval = self.poll_min_s
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                    interval = self.poll_min_s
                if self._closed:
                    return
            self.wakeups += 1
            found = self._sweep()
            interval = self.poll_min_s if found else min(interval * 2, self.poll_max_s)
            time.sleep(interval)

    def _run_blocking(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                head = self._pending[0].event
            head.synchronize()  # sleeps for a blocking-sync event; releases the GIL
            self.wakeups += 1
            self._sweep()

    # -- shutdown

    def close(self, join_timeout: float = 1.0) -> None:
        """Stop the thread; fail every pending wait with ``RuntimeError``. Any thread; blocks
        at most ``join_timeout`` (call it from a worker thread, not the loop)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
            notify = dict(self._notify)
            self._notify.clear()
        for p in pending:
            p.bridge.call_soon_quietly(p.callback, closed_error())
        for poller in list(self._loop_pollers.values()):
            poller.bridge.call_soon_quietly(poller.tick)  # fails its entries: closed
        for timed in list(self._loop_timers.values()):
            if timed is not None:
                timed.close_from_any_thread()  # fails its entries: closed
        if self._driver is not None and self._sem is not None:
            self._driver.libc.sem_post(ctypes.addressof(self._sem))
            for (device, _key), stream in notify.items():
                try:
                    self._driver.destroy_stream(device, stream)
                except RuntimeError:
                    pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._thread else "idle"
        degraded = " (degraded)" if self.degraded else ""
        return (
            f"<EventWaiter {self.strategy}{degraded} {state} pending={len(self._pending)} "
            f"notify_streams={len(self._notify)}>"
        )


class _FirstOnly:
    """A callback that two watchers of one event hold (the loop's timed polls and the
    thread's notification): the first call goes through, a later one is dropped."""

    __slots__ = ("callback", "done")

    def __init__(self, callback: Callback) -> None:
        self.callback = callback
        self.done = False

    def __call__(self, error: BaseException | None) -> None:
        if not self.done:
            self.done = True
            self.callback(error)


def _run_batch(callbacks: list[Callback]) -> None:
    """On the loop: the completions one sweep found."""
    for callback in callbacks:
        callback(None)
