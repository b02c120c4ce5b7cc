"""A SIMULATION of the CUDA driver calls the event waiter makes, for simulated events.

:class:`~aresidency.backends.waiter.EventWaiter` enqueues its notifications through a handful of
driver calls (a notify stream per origin stream, ``cuStreamWaitEvent``, ``cuLaunchHostFunc`` of
libc's ``sem_post``). :class:`SimNotifyDriver` answers the same calls for
:class:`~aresidency.backends.simstreams.SimEvent`: a notify stream's wait captures the event,
and its "host function" posts the semaphore from the thread that completes the event, as the
driver's callback thread would. So ``SimBackend(waiter=EventWaiter("hybrid",
driver=SimNotifyDriver()))`` runs the whole runtime on CPU with its device events awaited
through the CUDA backend's waiter: its strategies, predictions, the loop's timed polls and the
thread, under every test the simulation runs. Nothing here touches a GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable

from .cudadriver import CudaDriver, load_libc
from .simstreams import SimEvent

__all__ = ["SimNotifyDriver"]


class SimNotifyDriver:
    """The driver calls of the event waiter, SIMULATED for :class:`SimEvent` (see the module
    docstring). State: ``_waiting`` (notify stream -> the event its next host function waits
    for), ``launched`` (host functions enqueued). Thread-safe."""

    def __init__(self) -> None:
        self.libc = load_libc()
        self.sem_post_ptr = ctypes.cast(self.libc.sem_post, ctypes.c_void_p).value
        self.cuda = self  # the waiter calls driver.cuda.cuStreamWaitEvent(...)
        self.launched = 0
        self._streams = itertools.count(1)
        self._waiting: dict[int, SimEvent | None] = {}
        self._lock = threading.Lock()

    def new_semaphore(self) -> ctypes.Array[ctypes.c_char]:
        return CudaDriver.new_semaphore(self)  # type: ignore[arg-type]

    def create_stream(self, device: int) -> int:
        return next(self._streams)

    def destroy_stream(self, device: int, stream: int) -> None:
        with self._lock:
            self._waiting.pop(stream, None)

    def call_in(self, device: int, fn: Callable[[], int], what: str) -> None:
        code = fn()
        if code != 0:
            raise RuntimeError(f"{what} failed with CUresult {code} (simulated)")

    def cuStreamWaitEvent(self, stream: int, handle: int, flags: int) -> int:
        with self._lock:
            self._waiting[stream] = SimEvent.by_handle(handle)
        return 0

    def cuLaunchHostFunc(self, stream: int, fn: int | None, data: int) -> int:
        with self._lock:
            event = self._waiting.get(stream)
            self.launched += 1
        if fn != self.sem_post_ptr:
            return 1  # CUDA_ERROR_INVALID_VALUE: only sem_post is simulated
        post = self.libc.sem_post
        if event is None:  # a freed event is complete
            post(data)
        else:
            event.add_done_callback(lambda: post(data))
        return 0
