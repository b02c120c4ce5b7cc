"""The per-call prefetch pipeline of a streamed module (all on the event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ...core.errors import ResidencyBudgetError, ResidencyError, ResidencyUnavailableError
from ...runtime.leases import Lease
from .packing import TensorGroup

if TYPE_CHECKING:
    from .module import StreamedModule

__all__ = ["CallPipeline", "await_shielded", "finish_shielded"]


class CallPipeline:
    """The pipeline state of one call (all on the event loop).

    State: ``pos`` (the order position of the block expected next), ``started`` (group index ->
    the task completing its materialization at the device: charged, copy enqueued),
    ``leases`` (groups in use), ``requested`` (the group a caller waits for), ``promised``
    (device bytes of started checkpoint loads, charged at the device only once loaded).

    ``window_open`` is False until the first block has been handed to the compute stream (or
    a caller has to wait: for admission, a checkpoint load, or a staged copy still being
    issued): until then only the first block is started, so that its kernels
    are enqueued right behind its copy instead of behind the Python work of issuing the
    prefetches (which the copy stream does not need yet: the first copy keeps it busy).

    Invariants: a group is started at most once at a time; groups are started in block order
    from ``pos`` (the requested one first), never more than ``prefetch`` ahead of it, and never
    while the module still releases an earlier use of that group.
    """

    def __init__(self, streamed: StreamedModule, stream: Any) -> None:
        self.streamed = streamed
        self.manager = streamed.manager
        self.stream = stream
        self.pos = 0
        self.requested: int | None = None
        self.started: dict[int, asyncio.Task[None]] = {}
        self.leases: dict[int, Lease] = {}
        self.promised: dict[int, int] = {}
        self.waiters: dict[int, asyncio.Future[None]] = {}
        self.failures: dict[int, BaseException] = {}
        self.pending_exits: set[asyncio.Task[None]] = set()
        self.tasks: list[asyncio.Task[None]] = []  # every materialization this call started
        self.active = True
        self.window_open = False
        self._watcher: asyncio.Task[None] | None = None

    # -- admission

    def start(self) -> None:
        self.pump()
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """Re-pump after every state change (budget freed by releases, ours or others')."""
        while self.active:
            await self.manager._wait_change()
            self.pump()

    def _candidates(self) -> Iterator[int]:
        streamed = self.streamed
        if streamed._resident is not None:
            yield streamed._resident.index
        if self.requested is not None:
            yield self.requested
        order = streamed._order
        ahead = streamed.prefetch + 1 if self.window_open else 1
        yield from order[self.pos : self.pos + ahead]

    def open_window(self) -> None:
        """Prefetch from now on (the first block is on its way), and start what fits."""
        self.window_open = True
        self.pump()

    def pump(self) -> None:
        """Start materializations in order while the budget admits them (synchronous: each
        charge happens now and its copy is enqueued now)."""
        if not self.active:
            return
        for index in self._candidates():
            if index in self.started:
                continue
            if index in self.streamed._releasing or not self._start(index):
                break  # keep block order: a later block never takes an earlier one's room

    def _fits(self, group: TensorGroup) -> bool:
        """Whether the device budget has room for ``group`` now, counting our checkpoint loads
        in flight (a load may charge the device only once loaded). A cheap pre-check: the
        manager's own admission stays the authority."""
        ledger = self.manager._state.ledger(self.streamed.device)
        if ledger.budget_bytes is None:
            return True
        promised = sum(self.promised.values())
        return ledger.charged_bytes + promised + group.charge_bytes <= ledger.budget_bytes

    def _start(self, index: int) -> bool:
        group = self.streamed._group(index)
        assert group.handle is not None
        if not self._fits(group):
            if group.charge_bytes > (
                self.manager._state.ledger(self.streamed.device).budget_bytes or 0
            ):
                self._fail(index, self.streamed._never_fits(group))
            return False
        ledger = self.manager._state.ledger(self.streamed.device)
        before = ledger.charged_bytes
        try:
            task = self.manager.materialize_nowait(group.handle, self.streamed.device)
        except ResidencyBudgetError as error:
            if error.budget_bytes is not None and error.requested_bytes > error.budget_bytes:
                self._fail(index, error)  # it could never fit
            return False
        except ResidencyError as error:
            self._fail(index, error)
            return False
        self.started[index] = task
        self.tasks.append(task)
        if ledger.charged_bytes - before < group.charge_bytes and not task.done():
            self.promised[index] = group.charge_bytes  # charged at the device once loaded
        task.add_done_callback(functools.partial(self._on_materialized, index))
        waiter = self.waiters.pop(index, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    def _on_materialized(self, index: int, task: asyncio.Task[None]) -> None:
        self.promised.pop(index, None)
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return
        if self.started.get(index) is task and index not in self.leases:
            del self.started[index]
            # A checkpoint load can lose the device budget to another tenant while it loads:
            # start it again later. Anything else is the caller's error.
            if not isinstance(error, ResidencyBudgetError):
                self._fail(index, error)
            self.pump()

    def _fail(self, index: int, error: BaseException) -> None:
        self.failures[index] = error
        waiter = self.waiters.pop(index, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _evict_unneeded(self, index: int) -> None:
        """The requested group does not fit while groups we will not need before it hold the
        budget (an out-of-order call): give them back."""
        here = self.streamed._position.get(index, -1)
        window = (
            set(self.streamed._order[here : here + self.streamed.prefetch + 1])
            if here >= 0
            else set()
        )
        resident = self.streamed._resident.index if self.streamed._resident is not None else -1
        for other, task in list(self.started.items()):
            if other in self.leases or other in window or other in (index, resident):
                continue
            del self.started[other]
            self.streamed._spawn_release(other, task)

    async def _wait_started(self, index: int) -> asyncio.Task[None]:
        timeout = self.streamed.timeout
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while index not in self.started:
            failure = self.failures.pop(index, None)
            if failure is not None:
                raise failure
            if not self.active:
                raise asyncio.CancelledError
            self._evict_unneeded(index)
            waiter = self.waiters.get(index)
            if waiter is None or waiter.done():
                waiter = self.waiters[index] = loop.create_future()
            self.pump()
            if index in self.started or index in self.failures:
                continue
            if not self.window_open:
                self.open_window()  # about to wait: let the prefetches use the time
                if index in self.started or index in self.failures:
                    continue
            if deadline is None:
                await waiter
                continue
            remaining = deadline - loop.time()
            try:
                await asyncio.wait_for(asyncio.shield(waiter), max(remaining, 0))
            except TimeoutError:
                device = self.streamed.device
                record = self.manager.snapshot().location(device)
                raise TimeoutError(
                    f"{self.streamed._group(index).name} was not admitted at {device} within "
                    f"{timeout} s (used {record.used_bytes} B + reserved "
                    f"{record.reserved_bytes} B of {record.budget_bytes} B)"
                ) from None
        return self.started[index]

    # -- use

    async def enter(self, index: int, *, wait_copy: bool = False) -> list[torch.Tensor]:
        """Lease group ``index`` at the device on the compute stream and return its tensors.

        Waits (without blocking the loop) only until the group is admitted to the budget; the
        copy itself is waited for by the compute stream, on the device. ``wait_copy`` also
        awaits the copy (for work that runs on the host, not on the stream)."""
        if not self.active:
            raise asyncio.CancelledError
        if index in self.leases:
            raise RuntimeError(
                f"{self.streamed._group(index).name} is already in use in this call (a block that "
                "calls itself?); streaming runs each block once at a time"
            )
        group = self.streamed._group(index)
        assert group.handle is not None
        position = self.streamed._position.get(index)
        if position is not None:
            self.pos = position
        self.requested = index
        try:
            while True:
                task = await self._wait_started(index)
                try:
                    lease = self.manager.acquire(
                        group.handle, self.streamed.device, stream=self.stream
                    )
                except ResidencyUnavailableError:
                    # A checkpoint load still running: the device copy begins once it is loaded.
                    if task.done():
                        if self.started.get(index) is not task:
                            continue  # it lost the budget and will be started again
                        task.result()
                        raise
                    self.open_window()  # the load takes a while: start the next ones
                    await self.manager._wait_change()
                    continue
                break
        finally:
            self.requested = None
        if not self.window_open and not self.manager._issued(group.handle, self.streamed.device):
            self.open_window()  # the lease waits for a staged copy to be issued: prefetch
        await lease.__aenter__()
        self.leases[index] = lease
        self.promised.pop(index, None)
        try:
            if wait_copy:
                self.open_window()
                await task
            tensors = group.views(lease.tensor)
        except BaseException:
            await self._exit(index)
            raise
        if self.window_open:
            self.pump()
        return tensors

    async def _exit(self, index: int) -> None:
        lease = self.leases.pop(index, None)
        if lease is None:
            return
        # Records an event on the compute stream after the block's kernels; the release below
        # waits for it (the reaper sees it complete), so the replica outlives every reader.
        await lease.__aexit__(None, None, None)
        task = self.started.pop(index, None)
        if task is None:
            return
        if self.streamed._resident is None or index != self.streamed._resident.index:
            position = self.streamed._position.get(index)
            if position is not None and position + 1 > self.pos:
                self.pos = position + 1
        self.streamed._spawn_release(index, task)
        self.open_window()

    async def exit(self, index: int) -> None:
        await self._exit(index)

    def exit_soon(self, index: int) -> None:
        """``exit`` scheduled from the worker thread (through ``call_soon_threadsafe``)."""
        task = asyncio.ensure_future(self._exit(index))
        self.pending_exits.add(task)
        task.add_done_callback(self.pending_exits.discard)

    def abort(self) -> None:
        """Stop admitting: waiting and later ``enter`` calls raise ``CancelledError``."""
        self.active = False
        for waiter in self.waiters.values():
            if not waiter.done():
                waiter.set_result(None)
        self.waiters.clear()

    async def finish(self) -> None:
        """End the call: exit every lease, release every replica (in the background)."""
        self.abort()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        while self.pending_exits:
            await asyncio.gather(*list(self.pending_exits), return_exceptions=True)
        for index in list(self.leases):
            await self._exit(index)
        for index, task in list(self.started.items()):
            del self.started[index]
            self.streamed._spawn_release(index, task)


async def finish_shielded(awaitable: Any) -> None:
    """Run cleanup to the end even if the calling task is cancelled meanwhile."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


async def await_shielded(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` (a worker thread's result) to settle, whatever is cancelled."""
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(future)
