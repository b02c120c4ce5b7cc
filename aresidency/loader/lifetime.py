"""How a pass learns that it must end without anyone telling it: the manager closed, or the
iterator that drove it was dropped.

* **The manager's close.** A pass runs threads (the source's, the ring's) that wait on the
  manager's loop and on device events. When the manager closes, its backend stops: a simulated
  device drops the work it had not started, so its events never complete, and the loop is no
  longer the manager's to call. :func:`watch_close` arms a callback for that moment: a host
  event that nobody sets, handed to the backend's ``notify``, which fails every pending
  notification with ``BackendClosedError`` when the backend closes (the last step of the
  manager's close). :class:`HostWaits` makes the threads' waits on device events abandonable,
  so that the pass can end its threads then.
* **A dropped iterator.** ``async for batch in DeviceLoader(...)`` with no ``async with``:
  breaking out, or an exception in the body, drops the iterator without a call to anything,
  as with an async generator (whose finalizer ``sys.set_asyncgen_hooks`` lets the loop
  schedule ``aclose``). The iterator's ``__del__`` does the same: it schedules the end of its
  pass on the loop (:func:`end_on_loop`) and awaits nothing; the pass then ends as
  ``shutdown`` ends it and gives its memory back as the device passes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import anyio

from ..backends.base import Backend
from ..backends.bridge import LoopBridge
from ..backends.events import HostEvent
from ..runtime.signal import ManagerClosedError

__all__ = [
    "HostWaits",
    "closed_under_pass",
    "end_on_loop",
    "ended_by_aclose",
    "ended_by_cancelled_wait",
    "ended_by_close",
    "ended_by_newer_pass",
    "watch_close",
]


def closed_under_pass(
    loader: str, number: int, cause: BaseException | None = None
) -> ManagerClosedError:
    """The error a consumer gets when the manager closed while ``loader`` ran pass
    ``number`` (either kind of pass), chained to ``cause``."""
    error = ManagerClosedError(
        f"the manager closed while {loader} was in pass {number}: the pass ended there (close "
        "the loader before the manager: 'async with DeviceLoader(...)' inside 'async with "
        "ResidencyManager(...)')"
    )
    error.__cause__ = cause
    return error


def ended_by_newer_pass(loader: str, number: int, newer: int) -> RuntimeError:
    """The error a consumer of pass ``number`` gets once pass ``newer`` of the same loader
    (another ``async for`` over it) ended it: a loader runs one pass at a time, and a consumer
    that silently stopped would take the truncated pass for the whole source."""
    return RuntimeError(
        f"pass {number} of {loader} was ended by pass {newer}, which another 'async for' over "
        f"the loader began: a loader runs one pass at a time. Iterate it from one task (and "
        f"hand its batches to other tasks yourself), or end a pass (break out, or aclose() its "
        f"iterator) before you start the next"
    )


def ended_by_close(loader: str, number: int, handed: int) -> anyio.ClosedResourceError:
    """The error of a consumer of pass ``number`` once the loader was closed (``aclose()``,
    or the end of its ``async with``) before the pass ended: as a channel closed under its
    receiver, because a consumer told only "end of iteration" would take the truncated pass
    for the whole source."""
    return anyio.ClosedResourceError(
        f"{loader} was closed while pass {number} ran, after {handed} batch(es) of it reached "
        f"this iterator: the rest of the source was not read. Close the loader after its "
        f"consumers finished (their loops inside its 'async with' block), or break out of "
        f"the loop to end a pass early"
    )


def ended_by_aclose(loader: str, number: int, handed: int) -> anyio.ClosedResourceError:
    """The error of a consumer of an iterator whose ``aclose()`` ended pass ``number`` while it
    ran (from another task while the consumer waited for a batch, or before it asked for the
    next one): as a channel closed under its receiver, because a consumer told only "end of
    iteration" would take the truncated pass for the whole source."""
    return anyio.ClosedResourceError(
        f"pass {number} of {loader} was ended by its iterator's aclose() while it ran, after "
        f"{handed} batch(es) of it reached this iterator: the rest of the source was not read. "
        f"Call aclose() once the loop is done with the iterator (or break out of the loop to "
        f"end a pass early)"
    )


def ended_by_cancelled_wait(loader: str, number: int, handed: int) -> RuntimeError:
    """The error of a later ``__anext__`` on an iterator whose wait for a batch was cancelled
    (a deadline around one ``anext`` that expired, the cancellation caught): the cancellation
    ended the pass, and a consumer told only "end of iteration" would take the truncated pass
    for the whole source."""
    return RuntimeError(
        f"pass {number} of {loader} ended when a wait for its next batch was cancelled, after "
        f"{handed} batch(es): a cancelled wait ends the pass and gives back everything it held, "
        f"so this iterator cannot go on and the rest of the source was not read. Start a new "
        f"pass ('async for' over the loader again), or put the deadline around the whole loop "
        f"rather than around one batch"
    )


def watch_close(backend: Backend, label: str, callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback()`` on the loop once ``backend`` closes (the manager's close ends with
    it). Returns the function that disarms it (loop; the watch then ends quietly)."""
    sentinel = HostEvent(label=f"{label} watches the manager's close")

    def fired(error: BaseException | None) -> None:
        if error is not None:  # the backend closed first; None: disarmed
            callback()

    backend.notify(sentinel, fired)
    return sentinel.set


class HostWaits:
    """Host waits of a pass's threads on device events, which :meth:`abandon` ends at once
    (the manager closed: a simulated device's events never complete then). A
    ``torch.cuda.Event`` is waited for with ``synchronize`` (the GPU finishes its work
    whether the manager runs or not).

    State (under ``_lock``): ``abandoned``, ``_flags`` (one per wait in progress).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flags: set[threading.Event] = set()
        self.abandoned = False

    def wait(self, event: Any) -> bool:
        """Block the calling thread (never the loop) until ``event`` completed (``None``:
        nothing to wait for); False if the waits were abandoned first."""
        if event is None or event.query():
            return True
        add_callback = getattr(event, "add_done_callback", None)
        if not callable(add_callback):
            synchronize = getattr(event, "synchronize", None)
            if callable(synchronize):  # a torch.cuda.Event
                synchronize()
                return True
            while not event.query():  # an event of another kind: only query tells
                if self.abandoned:
                    return False
                time.sleep(0.0002)
            return True
        flag = threading.Event()
        with self._lock:
            if self.abandoned:
                return False
            self._flags.add(flag)
        try:
            add_callback(flag.set)
            flag.wait()
        finally:
            with self._lock:
                self._flags.discard(flag)
        return bool(event.query())

    def wait_all(self, events: Iterable[Any]) -> bool:
        """:meth:`wait` for each event in turn; False once abandoned."""
        return all(self.wait(event) for event in events)

    def abandon(self) -> None:
        """End every wait now and make later ones return False at once (any thread)."""
        with self._lock:
            self.abandoned = True
            flags = list(self._flags)
        for flag in flags:
            flag.set()


def end_on_loop(bridge: LoopBridge | None, end: Callable[[], None]) -> None:
    """Schedule ``end()`` on the loop (from a finalizer: any thread, never waits; nothing if
    the loop has finished)."""
    if bridge is None:
        return
    try:
        bridge.call_soon_quietly(end)
    except Exception:  # pragma: no cover - interpreter shutdown: nobody is left to tell
        pass
