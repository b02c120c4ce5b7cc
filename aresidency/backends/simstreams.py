"""SIMULATED in-order streams and events: the device side of :mod:`~aresidency.backends.sim`.

A :class:`SimStream` runs the work submitted to it in order on one worker thread, as a CUDA
stream runs its kernels; a :class:`SimEvent` recorded on it completes when the worker reaches
it. Nothing here touches a GPU.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .base import DeviceEvent
from .events import HostEvent

__all__ = ["SimDeviceStreams", "SimEvent", "SimStream"]


class SimEvent(HostEvent):
    """A SIMULATED CUDA event: complete once its stream's worker reached it.

    ``cuda_event`` is a number standing in for the driver's event handle, by which
    :meth:`by_handle` finds the event again (what a simulated driver call receives); it is
    given on first use, so events nobody hands to a driver cost nothing for it."""

    __slots__ = ("_aresidency", "_handle")

    _handles = itertools.count(1)
    _live: weakref.WeakValueDictionary[int, SimEvent] = weakref.WeakValueDictionary()

    @property
    def cuda_event(self) -> int:
        try:
            return self._handle
        except AttributeError:
            self._handle: int = next(SimEvent._handles)
            SimEvent._live[self._handle] = self
            return self._handle

    @classmethod
    def by_handle(cls, handle: int) -> SimEvent | None:
        """The live event with that handle (None once it was freed)."""
        return cls._live.get(handle)


class _StreamClosed(Exception):
    pass


_stream_handles = itertools.count(1)


class SimStream:
    """A SIMULATED in-order CUDA stream: work runs in submission order on one worker thread.

    State: ``_queue`` (work not yet run), ``_closing``, ``errors`` (exceptions raised by
    submitted work, kept for tests). Invariant: an item runs only after every item submitted
    before it has finished; after ``close`` no further item starts.
    """

    def __init__(self, backend_label: str, device: int | None, kind: str) -> None:
        self.device_index = device
        self.kind = kind
        where = f"cuda:{device}" if device is not None else "host"
        self.name = f"{backend_label}-{where}/{kind}"
        self.errors: list[BaseException] = []
        self._cond = threading.Condition()
        self._queue: list[Callable[[], object]] = []
        self._closing = False
        self._closed = threading.Event()  # set by close: a simulated kernel's sleep ends
        self._running = False
        self._thread: threading.Thread | None = None
        self._seq = itertools.count(1)
        self.cuda_stream = next(_stream_handles)  # stands in for the driver's stream handle

    def submit(self, fn: Callable[[], object]) -> None:
        """Enqueue ``fn`` to run on the stream's worker thread after everything before it.
        The host does not wait."""
        with self._cond:
            if self._closing:
                raise RuntimeError(f"{self.name} is closed")
            self._queue.append(fn)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def sleep(self, seconds: float) -> None:
        """Enqueue ``seconds`` of simulated device work (the worker sleeps; closing the stream
        ends the sleep, as it drops the work queued after it)."""
        self.submit(functools.partial(self._sleep, seconds))

    def _sleep(self, seconds: float) -> None:
        if self._closed.wait(seconds):
            raise _StreamClosed

    def record_event(self) -> SimEvent:
        """An event that completes when the worker reaches this point. Host does not wait."""
        event = SimEvent(label=f"{self.name}#{next(self._seq)}")
        self.submit(event.set)
        return event

    def wait_event(self, event: DeviceEvent) -> None:
        """Make later work on this stream wait for ``event``; the host does not wait."""
        if event.query():
            return
        self.submit(functools.partial(self._block_until, event))

    def _block_until(self, event: DeviceEvent) -> None:
        while True:
            if isinstance(event, HostEvent):
                if event.wait_blocking(0.05):
                    return
            elif event.query():
                return
            else:
                time.sleep(0.001)
            if self._closing:
                raise _StreamClosed

    def synchronize(self, timeout: float | None = None) -> None:
        """Block the calling thread until the stream's queued work ran (tests and ``place``;
        never call it on the event loop)."""
        if not self.record_event().wait_blocking(timeout):
            raise TimeoutError(f"{self.name} did not drain within {timeout} s")

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue) + (1 if self._running else 0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    self._queue.clear()
                    return
                fn = self._queue.pop(0)
                self._running = True
            try:
                fn()
            except _StreamClosed:
                return
            except BaseException as exc:  # a failed "kernel": keep it for the test to see
                self.errors.append(exc)
            finally:
                del fn  # an idle stream must not keep the last work item's tensors alive
                with self._cond:
                    self._running = False

    def close(self, join_timeout: float = 2.0) -> None:
        """Stop the worker; queued work that has not started is dropped."""
        with self._cond:
            self._closing = True
            self._closed.set()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)

    def __repr__(self) -> str:
        return f"<SimStream {self.name} (simulated) queued={self.queued}>"


@dataclass(frozen=True)
class SimDeviceStreams:
    """The streams of one simulated device."""

    compute: SimStream
    h2d: SimStream
    d2h: SimStream
    peer: SimStream
