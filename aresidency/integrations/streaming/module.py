"""``StreamedModule`` and ``stream_module``: an ``nn.Module`` run with streamed weights."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn

from ...core.errors import ResidencyBudgetError
from ...core.locations import Location, LocationLike
from ...core.state import ReplicaMode, ValueHandle
from ...runtime.manager import ResidencyManager
from ...runtime.sources import CallableSource
from .checkpoint import checkpoint_plan, read_safetensors_header
from .packing import TensorGroup, collect_groups, find_blocks
from .pipeline import CallPipeline, await_shielded, finish_shielded

__all__ = ["HostKind", "StreamedModule", "stream_module"]


@dataclass(frozen=True, slots=True)
class _TorchState:
    """The caller's thread-local torch state, carried into the thread that runs the blocks."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def capture(cls) -> _TorchState:
        return cls(
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            tuple(
                (kind, torch.get_autocast_dtype(kind))
                for kind in ("cuda", "cpu")
                if torch.is_autocast_enabled(kind)
            ),
        )

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield


HostKind = Literal["pinned-host", "pageable-host"]

_BACKGROUND: set[asyncio.Task[None]] = set()  # discards of failed constructions, kept alive


def _forget(task: asyncio.Task[None]) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a discard that failed leaves the value registered


class StreamedModule:
    """An ``nn.Module`` whose blocks' weights are streamed through a device budget.

    Made by :func:`stream_module`; call it as ``y = await streamed(*args, **kwargs)``. See the
    module docstring for how a call runs. On CUDA the call returns once every block's work is
    enqueued on the compute stream (like any PyTorch call, the host does not wait for the
    device); its result is ready for work ordered after it on that stream.

    State: ``manager``, ``module``, ``device``, ``prefetch``, ``host`` (``None`` with a
    checkpoint), ``handles`` (one value per block with tensors, then the resident group's),
    ``_releasing`` (group index -> the background task releasing its device replica).
    Invariants: outside a call, every parameter and buffer of ``module`` is its own tensor
    again (``host`` mode: a view of the managed host copy); a group's device replica exists
    only while a call uses or prefetches it, or while its release waits for its readers.
    """

    def __init__(
        self,
        manager: ResidencyManager,
        module: nn.Module,
        *,
        device: LocationLike = "cuda:0",
        prefetch: int = 2,
        host: HostKind = "pinned-host",
        checkpoint: str | Path | None = None,
        blocks: Sequence[nn.Module] | None = None,
        stream: Any = None,
        timeout: float | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"stream_module takes an nn.Module, got {type(module).__name__}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be None or >= 0, got {timeout!r}")
        self.manager = manager
        self.module = module
        self.device = Location.parse(device)
        if not self.device.is_cuda:
            raise ValueError(f"device must be a cuda location, got {self.device}")
        if checkpoint is None and host not in ("pinned-host", "pageable-host"):
            raise ValueError(f"host must be 'pinned-host' or 'pageable-host', got {host!r}")
        self.prefetch = prefetch
        self.timeout = timeout
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.host: HostKind | None = None if checkpoint is not None else host
        self.name = name or f"{type(module).__name__}-{id(module):x}"
        self._stream = stream
        manager._check_loop()
        backend = manager.backend
        backend.check_location(self.device)
        self._host_compute = bool(getattr(backend, "simulated", False))
        self._blocks = list(find_blocks(module) if blocks is None else blocks)
        if not self._blocks:
            raise ValueError("no blocks to stream: the module has no children")
        groups, self._resident = collect_groups(
            module, self._blocks, self.name, keep_strides=checkpoint is None
        )
        # A plain nn.Sequential is run block by block on the loop; anything else (a subclass
        # with its own forward or tensors, explicit blocks) through its forward in a thread.
        self._sequential = (
            blocks is None
            and isinstance(module, nn.Sequential)
            and type(module).forward is nn.Sequential.forward
            and self._resident is None
        )
        self._block_groups = groups
        self._groups: list[TensorGroup] = [g for g in groups if g is not None]
        self._order = [g.index for g in self._groups]
        self._position = {index: pos for pos, index in enumerate(self._order)}
        self._by_index = {g.index: g for g in self._groups}
        if self._resident is not None:
            self._by_index[self._resident.index] = self._resident
        self._releasing: dict[int, asyncio.Task[None]] = {}
        self._release_errors: list[BaseException] = []
        self._raised: set[BaseException] = set()  # errors a call raised (drain skips them)
        self._lock = asyncio.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._worker_ident: int | None = None
        self._call: CallPipeline | None = None
        self._hooks: list[Any] = []
        self._closed = False
        self._registered: list[TensorGroup] = []
        try:
            self._register_all()
            self._check_budget()
            if not self._sequential:
                self._install_hooks()
        except BaseException:
            self._unregister_now()
            raise

    # -- set-up

    def _group(self, index: int) -> TensorGroup:
        return self._by_index[index]

    @property
    def handles(self) -> list[ValueHandle]:
        out = [g.handle for g in self._groups]
        if self._resident is not None:
            out.append(self._resident.handle)
        return [h for h in out if h is not None]

    @property
    def block_bytes(self) -> list[int]:
        """The device charge of each streamed block (blocks without tensors left out)."""
        return [g.charge_bytes for g in self._groups]

    @property
    def resident_bytes(self) -> int:
        """The device charge of the tensors outside the blocks (held for a whole call)."""
        return 0 if self._resident is None else self._resident.charge_bytes

    def _all_groups(self) -> list[TensorGroup]:
        return [*self._groups, *([self._resident] if self._resident is not None else [])]

    def _register_all(self) -> None:
        manager = self.manager
        header: tuple[int, dict[str, Any]] | None = None
        if self.checkpoint is not None:
            header = read_safetensors_header(self.checkpoint)
        repointed: set[int] = set()
        for group in self._all_groups():
            if header is not None:
                assert self.checkpoint is not None
                load = checkpoint_plan(group, self.checkpoint, *header)
                source = CallableSource(
                    load, shape=(group.nbytes,), dtype=torch.uint8, source_location="pageable-host"
                )
                group.handle = manager.register_source(
                    source, name=group.name, replica_mode=ReplicaMode.REPLICABLE
                )
                group.from_source = True
            else:
                assert self.host is not None
                meta = [e.names[0] for e in group.entries if e.tensor.is_meta]
                if meta:
                    raise ValueError(
                        f"{meta[0]} is on the meta device: give checkpoint= to load the weights"
                    )
                flat = torch.zeros(group.nbytes, dtype=torch.uint8)
                group.pack_from(flat)
                group.handle = manager.register(
                    flat, name=group.name, replica_mode=ReplicaMode.REPLICABLE, location=self.host
                )
                self._registered.append(group)
                host_flat = manager.tensor(group.handle, self.host)
                group.host_flat = host_flat
                # The module's tensors become views of the managed host copy (no second copy);
                # the hold keeps that copy where it is for as long as they point into it.
                group.hold = manager.hold(group.handle, self.host)
                with torch.no_grad():
                    for entry, view in zip(group.entries, group.views(host_flat)):
                        if id(entry.tensor) not in repointed:
                            repointed.add(id(entry.tensor))
                            entry.tensor.data = view
                continue
            self._registered.append(group)
        snap = manager.snapshot()
        for group in self._all_groups():
            assert group.handle is not None
            group.charge_bytes = snap.value(group.handle).charge_bytes
        self._largest = max((g.charge_bytes for g in self._groups), default=0)

    def _never_fits(self, group: TensorGroup) -> ResidencyBudgetError:
        ledger = self.manager._state.ledger(self.device)
        return ResidencyBudgetError(
            self.device,
            ledger.budget_bytes,
            ledger.used_bytes,
            ledger.reserved_bytes,
            group.charge_bytes,
            what=f"{group.name} (larger than the whole budget)",
        )

    def _check_budget(self) -> None:
        # The ledger itself (not a snapshot): this runs at the start of every call.
        record = self.manager._state.ledger(self.device)
        if record.budget_bytes is None:
            return
        need = self._largest + self.resident_bytes
        if need > record.budget_bytes - record.reserved_bytes:
            largest = self._largest
            raise ValueError(
                f"{self.name}: the largest block ({largest} B) plus the tensors outside the "
                f"blocks ({self.resident_bytes} B) need {need} B at {self.device}, more than its "
                f"budget ({record.budget_bytes} B) less its reservations "
                f"({record.reserved_bytes} B); streaming could never run"
            )

    def _install_hooks(self) -> None:
        for block, group in zip(self._blocks, self._block_groups):
            if group is None:
                continue
            self._hooks.append(
                block.register_forward_pre_hook(functools.partial(self._pre_hook, group))
            )
            self._hooks.append(
                block.register_forward_hook(
                    functools.partial(self._post_hook, group), always_call=True
                )
            )

    def _unregister_now(self) -> None:
        """Undo a failed construction: hooks, the module's tensors, holds now; the values are
        discarded by background tasks (``discard`` awaits)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._restore_host_tensors()
        for group in self._registered:
            if group.hold is not None and group.hold.active:
                group.hold.release()
            if group.handle is not None:
                task = asyncio.ensure_future(self.manager.discard(group.handle))
                _BACKGROUND.add(task)
                task.add_done_callback(_forget)
        self._registered.clear()

    def _restore_host_tensors(self) -> None:
        """Give the module's tensors their own host memory again (a copy out of the managed
        host buffer, which is freed, and poisoned on the simulated backend, at discard)."""
        done: set[int] = set()
        with torch.no_grad():
            for group in self._registered:
                if group.host_flat is None:
                    continue
                for entry, view in zip(group.entries, group.views(group.host_flat)):
                    if id(entry.tensor) in done or entry.tensor.data_ptr() != view.data_ptr():
                        continue
                    done.add(id(entry.tensor))
                    own = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype)
                    own.copy_(view)
                    entry.tensor.data = own
                group.host_flat = None

    # -- hooks (worker thread)

    def _pre_hook(self, group: TensorGroup, module: nn.Module, args: Any) -> None:
        if self._worker_ident != threading.get_ident():
            return
        call = self._call
        assert call is not None
        loop = self.manager._loop
        assert loop is not None
        entering = call.enter(group.index, wait_copy=self._host_compute)
        tensors = asyncio.run_coroutine_threadsafe(entering, loop).result()
        group.swap_in(tensors)

    def _post_hook(self, group: TensorGroup, module: nn.Module, args: Any, output: Any) -> None:
        if self._worker_ident != threading.get_ident():
            return
        group.restore()
        call = self._call
        loop = self.manager._loop
        assert call is not None and loop is not None
        loop.call_soon_threadsafe(call.exit_soon, group.index)

    # -- releases

    def _spawn_release(self, index: int, materialized: asyncio.Task[None]) -> None:
        task = asyncio.ensure_future(self._release(index, materialized))
        self._releasing[index] = task

    async def _release(self, index: int, materialized: asyncio.Task[None]) -> None:
        group = self._group(index)
        assert group.handle is not None
        try:
            try:
                await materialized
            except ResidencyBudgetError:
                return  # a checkpoint load that lost the device budget: nothing arrived
            # Waits for the compute events the leases recorded (the reaper sees them
            # complete), then frees the budget: no synchronization.
            await self.manager.release(group.handle, self.device)
        except BaseException as error:
            self._release_errors.append(error)
        finally:
            if self._releasing.get(index) is asyncio.current_task():
                del self._releasing[index]
            if self._call is not None:
                self._call.pump()

    async def drain(self) -> None:
        """Wait until every device replica this module released has left the budget (its
        readers' events completed and the release committed). Raises the first release error."""
        while self._releasing:
            await asyncio.gather(*list(self._releasing.values()), return_exceptions=True)
        errors, self._release_errors = self._release_errors, []
        raised, self._raised = self._raised, set()
        for error in errors:
            if error not in raised:  # a copy failure its call raised already is not repeated
                raise error

    # -- calls

    def _compute_stream(self) -> Any:
        if self._stream is not None:
            return self._stream
        return self.manager.backend.current_stream(self.device)

    def _stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if not self._host_compute and isinstance(stream, torch.cuda.Stream):
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    @staticmethod
    def _check_inference(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise ValueError(
                    "weight streaming is for inference: an input requires grad while grad mode "
                    "is on, so autograd would keep each block's weights past their release; "
                    "call under torch.no_grad() or torch.inference_mode()"
                )

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module with its blocks' weights streamed through the device budget.

        Awaits only for admission (a block's weights waiting for budget); copies are waited for
        on the device by the compute stream. Returns the module's output, enqueued on the
        compute stream (CUDA) or computed (simulated backend)."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        self.manager._check_loop()
        self._check_inference(args, kwargs)
        async with self._lock:
            self._check_budget()
            stream = self._compute_stream()
            call = CallPipeline(self, stream)
            self._call = call
            call.start()
            try:
                if self._sequential:
                    result = await self._run_sequential(call, stream, args, kwargs)
                else:
                    result = await self._run_threaded(call, stream, args, kwargs)
                if self._host_compute and call.tasks:
                    # Simulation: the blocks ran, so their copies completed; let the tasks
                    # that commit them finish too, so that a failed copy fails this call.
                    await asyncio.wait(call.tasks)
                self._raise_copy_failure(call)
                return result
            except Exception as error:
                self._raised.add(error)
                raise
            finally:
                try:
                    await finish_shielded(call.finish())
                finally:
                    self._call = None

    def _raise_copy_failure(self, call: CallPipeline) -> None:
        """A copy of this call that already failed fails the call (its block read garbage).
        One still in flight when the call returns (CUDA) is raised by :meth:`drain`."""
        for task in call.tasks:
            if task.done() and not task.cancelled():
                error = task.exception()
                if error is not None and not isinstance(error, ResidencyBudgetError):
                    raise error

    async def _run_sequential(
        self, call: CallPipeline, stream: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run the children in order on the loop. Each block's work is enqueued on the compute
        stream: kernels on CUDA; on the simulated backend the block itself is submitted to the
        simulated stream, so it runs after the copy and before the release exactly as kernels
        would (a read after release would see the simulation's poison)."""
        if kwargs or len(args) != 1:
            raise TypeError("an nn.Sequential takes exactly one positional input")
        box: list[Any] = [args[0]]
        errors: list[BaseException] = []
        submit = getattr(stream, "submit", None) if self._host_compute else None
        torch_state = _TorchState.capture() if submit is not None else None
        context = self._stream_context(stream)

        def run(block: nn.Module, group: TensorGroup | None, tensors: list[torch.Tensor]) -> None:
            if errors:
                return  # an earlier block failed: the rest of the stream's work is moot
            if group is not None:
                group.swap_in(tensors)
            try:
                if torch_state is not None:
                    with torch_state.enter():
                        box[0] = block(box[0])
                else:
                    with context:
                        box[0] = block(box[0])
            except BaseException as error:
                errors.append(error)
            finally:
                if group is not None:
                    group.restore()

        try:
            for block, group in zip(self._blocks, self._block_groups):
                tensors = [] if group is None else await call.enter(group.index)
                try:
                    if submit is not None:
                        # the stream keeps the tensors until it ran the block
                        submit(functools.partial(run, block, group, tensors))
                    else:
                        run(block, group, tensors)
                finally:
                    # No reference may outlive the lease: once released, the memory is the
                    # allocator's (and the next block's budget).
                    del tensors
                    if group is not None:
                        await call.exit(group.index)
                if errors:
                    break
        finally:
            if submit is not None:
                # The result exists once the stream ran the blocks; wait for it even when
                # cancelled, so that no block touches the module after the call returned.
                backend = self.manager.backend
                await finish_shielded(backend.wait_event(backend.record_event(stream)))
        if errors:
            raise errors[0]
        return box[0]

    async def _run_threaded(
        self, call: CallPipeline, stream: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        resident = self._resident
        if resident is not None:
            resident.swap_in(await call.enter(resident.index, wait_copy=self._host_compute))
        try:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"aresidency-stream-{self.name}"
                )
            work = functools.partial(self._work, stream, _TorchState.capture(), args, kwargs)
            future = asyncio.get_running_loop().run_in_executor(self._executor, work)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                call.abort()  # the worker's next enter fails; wait for it to unwind
                await await_shielded(future)
                raise
        finally:
            if resident is not None:
                resident.restore()

    def _work(
        self, stream: Any, torch_state: _TorchState, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The worker thread: run the module with the caller's thread-local torch state."""
        with torch_state.enter(), self._stream_context(stream):
            self._worker_ident = threading.get_ident()
            try:
                return self.module(*args, **kwargs)
            finally:
                self._worker_ident = None
                for group in self._groups:
                    group.restore()

    def call_threadsafe(self, *args: Any, **kwargs: Any) -> Any:
        """``await self(*args, **kwargs)`` for a caller on another thread than the manager's
        event loop: blocks that thread (not the loop) until the call returns."""
        loop = self.manager._loop
        if loop is None:
            raise RuntimeError("the manager is not running")
        if threading.get_ident() == self.manager._thread:
            raise RuntimeError("call_threadsafe from the event loop's thread would deadlock")
        return asyncio.run_coroutine_threadsafe(self(*args, **kwargs), loop).result()

    # -- end

    async def aclose(self) -> None:
        """Finish releases, remove the hooks, give the module its own host tensors back, and
        discard the values. The streamed module cannot be called afterwards."""
        if self._closed:
            return
        async with self._lock:
            self._closed = True
            try:
                await self.drain()
            finally:
                for hook in self._hooks:
                    hook.remove()
                self._hooks.clear()
                if self._executor is not None:
                    self._executor.shutdown(wait=False)
                self._restore_host_tensors()
                for group in self._registered:
                    if group.hold is not None and group.hold.active:
                        group.hold.release()
                    if group.handle is not None:
                        await self.manager.discard(group.handle)
                self._registered.clear()

    async def __aenter__(self) -> StreamedModule:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._call else "idle")
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else self.host
        return (
            f"<StreamedModule {self.name!r} {len(self._groups)} blocks -> {self.device} "
            f"prefetch={self.prefetch} from {where} {state} "
            f"[{len(self._releasing)} releasing]>"
        )


def stream_module(
    manager: ResidencyManager,
    module: nn.Module,
    device: LocationLike = "cuda:0",
    prefetch: int = 2,
    host: HostKind = "pinned-host",
    checkpoint: str | Path | None = None,
    *,
    blocks: Sequence[nn.Module] | None = None,
    stream: Any = None,
    timeout: float | None = None,
    name: str | None = None,
) -> StreamedModule:
    """Register ``module``'s weights with ``manager`` for streaming to ``device``.

    ``prefetch``: how many blocks ahead of the running one may be copied (the ``device`` budget
    may allow fewer). ``host``: where the weights are kept (``"pinned-host"`` for full-speed
    copies, or ``"pageable-host"``, staged through the backend's pinned buffers);
    ``checkpoint``: a safetensors file to rebuild each block from instead (keys are the
    module's ``state_dict`` names; tensors missing there, such as non-persistent buffers, are
    taken from the module). ``blocks``: the submodules to stream, in call order (default: see
    :func:`find_blocks`). ``stream``: the compute stream (default: the caller's current stream
    at each call). ``timeout``: seconds a block may wait for budget before ``TimeoutError``
    (``None``: as long as it takes).

    Call on the manager's event loop (registration copies the weights into host memory
    synchronously: a start-up cost). ``ValueError`` if the largest block plus the tensors
    outside the blocks could never fit the ``device`` budget.
    """
    return StreamedModule(
        manager,
        module,
        device=device,
        prefetch=prefetch,
        host=host,
        checkpoint=checkpoint,
        blocks=blocks,
        stream=stream,
        timeout=timeout,
        name=name,
    )
