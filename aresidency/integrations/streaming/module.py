"""``StreamedModule`` and ``stream_module``: an ``nn.Module`` run with streamed weights."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import anyio
import torch
from torch import nn

from ...core.errors import ResidencyBudgetError, ResidencyError
from ...core.locations import Location, LocationLike
from ...core.timeouts import check_timeout
from ...core.values import ReplicaMode, ValueHandle
from ...runtime.checkpoints import Checkpoint
from ...runtime.manager import ResidencyManager
from ...runtime.pending import PendingOperation
from ...runtime.sources import CallableSource
from .checkpoint import block_loader
from .packing import TensorGroup, collect_groups, find_blocks
from .pipeline import CallPipeline
from .runners import ThreadedRunner, run_sequential

__all__ = ["HostKind", "StreamedModule", "stream_module"]


HostKind = Literal["pinned-host", "pageable-host"]


class StreamedModule:
    """An ``nn.Module`` whose blocks' weights are streamed through a device budget.

    Made by :func:`stream_module`; call it as ``y = await streamed(*args, **kwargs)``. See the
    package docstring for how a call runs. On CUDA the call returns once every block's work is
    enqueued on the compute stream (like any PyTorch call, the host does not wait for the
    device); its result is ready for work ordered after it on that stream.

    State: ``manager``, ``module``, ``device``, ``prefetch``, ``host`` (``None`` with a
    checkpoint), ``handles`` (one value per block with tensors, then the resident group's),
    ``releasing`` (group index -> the release of its device replica in flight),
    ``kept`` (group indexes whose device replica stays between calls).
    Invariants: outside a call, every parameter and buffer of ``module`` is its own tensor
    again (``host`` mode: a view of the managed host copy); a group's device replica exists
    only while a call uses or prefetches it, while its release waits for its readers, or while
    it is kept resident.
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
        keep_resident: bool = True,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"stream_module takes an nn.Module, got {type(module).__name__}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        self.timeout = check_timeout(timeout)
        self.manager = manager
        self.module = module
        self.device = Location.parse(device)
        if not self.device.is_cuda:
            raise ValueError(f"device must be a cuda location, got {self.device}")
        if checkpoint is None and host not in ("pinned-host", "pageable-host"):
            raise ValueError(f"host must be 'pinned-host' or 'pageable-host', got {host!r}")
        self.prefetch = prefetch
        self.keep_resident = bool(keep_resident)
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.host: HostKind | None = None if checkpoint is not None else host
        self.name = name or f"{type(module).__name__}-{id(module):x}"
        self._stream = stream
        manager.check_thread()
        backend = manager.backend
        backend.check_location(self.device)
        if stream is not None:
            backend.check_stream(stream, self.device)
        self.host_compute = backend.host_compute
        self.blocks = list(find_blocks(module) if blocks is None else blocks)
        if not self.blocks:
            raise ValueError("no blocks to stream: the module has no children")
        groups, self.resident_group = collect_groups(
            module, self.blocks, self.name, keep_strides=checkpoint is None
        )
        # A plain nn.Sequential is run block by block on the loop; anything else (a subclass
        # with its own forward or tensors, explicit blocks) through its forward in a thread.
        self._sequential = (
            blocks is None
            and isinstance(module, nn.Sequential)
            and type(module).forward is nn.Sequential.forward
            and self.resident_group is None
        )
        self.block_groups = groups
        self._groups: list[TensorGroup] = [g for g in groups if g is not None]
        self.order = [g.index for g in self._groups]
        self.position = {index: pos for pos, index in enumerate(self.order)}
        self._by_index = {g.index: g for g in self._groups}
        if self.resident_group is not None:
            self._by_index[self.resident_group.index] = self.resident_group
        self.releasing: dict[int, PendingOperation] = {}
        self.settling: set[PendingOperation] = set()  # prefetches a finished call cancelled
        self.kept: set[int] = set()
        self._release_errors: list[BaseException] = []
        self._raised: set[int] = set()  # ids of errors a call raised (drain skips them)
        self._lock = anyio.Lock()
        self._call: CallPipeline | None = None
        self._threaded = ThreadedRunner(self)
        self._closed = False
        self._registered: list[TensorGroup] = []
        self._checkpoint: Checkpoint | None = None
        self.calls = 0
        try:
            self._register_all()
            self._check_budget()
            if not self._sequential:
                self._threaded.install_hooks()
        except BaseException:
            self._unregister_now()
            raise

    # -- set-up

    def group(self, index: int) -> TensorGroup:
        return self._by_index[index]

    @property
    def all_groups(self) -> list[TensorGroup]:
        """Every group: the blocks' (in call order), then the resident one."""
        rest = [self.resident_group] if self.resident_group is not None else []
        return [*self._groups, *rest]

    @property
    def handles(self) -> list[ValueHandle]:
        return [g.handle for g in self.all_groups if g.handle is not None]

    @property
    def groups(self) -> list[TensorGroup]:
        """The blocks' groups, in call order (blocks without tensors left out)."""
        return self._groups

    @property
    def block_bytes(self) -> list[int]:
        """The device charge of each streamed block (blocks without tensors left out)."""
        return [g.charge_bytes for g in self._groups]

    @property
    def resident_bytes(self) -> int:
        """The device charge of the tensors outside the blocks (held for a whole call)."""
        return 0 if self.resident_group is None else self.resident_group.charge_bytes

    def _register_all(self) -> None:
        manager = self.manager
        if self.checkpoint is not None and self._checkpoint is None:
            self._checkpoint = Checkpoint.open(self.checkpoint)
        opened = self._checkpoint
        repointed: set[int] = set()
        for group in self.all_groups:
            if opened is not None:
                load = block_loader(group, opened, module=self.module)
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
        for group in self.all_groups:
            assert group.handle is not None
            group.charge_bytes = snap.value(group.handle).charge_bytes
        self._largest = max((g.charge_bytes for g in self._groups), default=0)

    def _never_fits(self, group: TensorGroup) -> ResidencyBudgetError:
        ledger = self.manager.state.ledger(self.device)
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
        record = self.manager.state.ledger(self.device)
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

    def _unregister_now(self) -> None:
        """Undo a failed construction: hooks, the module's tensors, holds and values, now (a
        value just registered has no consumer events: it can be discarded at once)."""
        self._threaded.close()
        self._restore_host_tensors()
        for group in self._registered:
            if group.hold is not None and group.hold.active:
                group.hold.release()
            if group.handle is not None:
                with contextlib.suppress(ResidencyError):
                    self.manager.discard_nowait(group.handle)
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

    # -- residency between calls ("budgets that remember")

    def _window_bytes(self) -> int:
        """Device bytes the prefetch window may need at once: the block in use and
        ``prefetch`` more, counted at the largest block."""
        return (self.prefetch + 1) * self._largest

    def _plan_keep(self) -> set[int]:
        """The groups to keep on the device after this call: the resident group, then blocks
        in call order while they fit beside the window in what the budget leaves us (what
        other tenants hold is not ours to take). A call then copies only the rest."""
        if not self.keep_resident:
            return set()
        ledger = self.manager.state.find_ledger(self.device)
        if ledger is None or ledger.budget_bytes is None:
            return set()  # without a strict budget nothing says how much may stay
        ours = 0
        for group in self.all_groups:
            assert group.handle is not None
            value = self.manager.state.find_value(group.handle)
            if value is not None and self.device in value.materializations:
                ours += group.charge_bytes
        room = ledger.budget_bytes - (ledger.charged_bytes - ours) - self._window_bytes()
        keep: set[int] = set()
        if self.resident_group is not None:
            room -= self.resident_group.charge_bytes
            if room < 0:
                return set()
            keep.add(self.resident_group.index)
        for index in self.order:
            charge = self.group(index).charge_bytes
            if charge > room:
                break
            room -= charge
            keep.add(index)
        return keep

    def residency(self) -> dict[str, Any]:
        """Which groups stay on the device between calls, and why (the budget arithmetic of
        the last call's plan): ``kept`` (group names), ``kept_bytes``, ``streamed_bytes``
        (copied on each call), ``window_bytes``, ``budget_bytes``, ``others_bytes`` (what other
        tenants held at the device), ``reason``."""
        ledger = self.manager.state.find_ledger(self.device)
        budget = None if ledger is None else ledger.budget_bytes
        kept = [self.group(i) for i in sorted(self.kept, key=self._kept_order)]
        kept_bytes = sum(g.charge_bytes for g in kept)
        total = sum(g.charge_bytes for g in self.all_groups)
        if not self.keep_resident:
            reason = "keep_resident=False: every block is released after use"
        elif budget is None:
            reason = f"{self.device} has no strict budget, so nothing stays between calls"
        elif len(self.kept) == len(self.all_groups):
            reason = "the whole model fits beside the prefetch window: nothing is copied"
        else:
            reason = (
                f"blocks stay in call order while they fit in the budget beside the prefetch "
                f"window ({self.prefetch + 1} x the largest block) and what other tenants hold"
            )
        others = None
        if ledger is not None:
            ours = 0
            for group in self.all_groups:
                assert group.handle is not None
                value = self.manager.state.find_value(group.handle)
                if value is not None and self.device in value.materializations:
                    ours += group.charge_bytes
            others = ledger.charged_bytes - ours
        return {
            "kept": [g.name for g in kept],
            "kept_bytes": kept_bytes,
            "streamed_bytes": total - kept_bytes,
            "window_bytes": self._window_bytes(),
            "budget_bytes": budget,
            "others_bytes": others,
            "reason": reason,
        }

    def _kept_order(self, index: int) -> int:
        return self.position.get(index, -1)

    # -- releases

    def release_replica(self, index: int, arriving: PendingOperation | None = None) -> None:
        """Release group ``index``'s device replica in the background (the release waits for
        the readers' events; nothing synchronizes). With ``arriving`` (the materialization
        still bringing it), only once that completed: a copy that failed is aborted by the
        manager instead, and one in flight cannot be released yet. Loop thread."""
        if arriving is not None and not arriving.done():
            arriving.add_done_callback(
                lambda done: None if done.exception() else self.release_replica(index)
            )
            return
        if arriving is not None and arriving.exception() is not None:
            return  # the failed copy was aborted: nothing to release
        group = self.group(index)
        assert group.handle is not None
        if index in self.releasing:
            return
        try:
            pending = self.manager.release_nowait(group.handle, self.device)
        except ResidencyError as error:
            self._release_errors.append(error)
            return
        self.releasing[index] = pending
        pending.add_done_callback(functools.partial(self._released, index))

    def _released(self, index: int, pending: PendingOperation) -> None:
        if self.releasing.get(index) is pending:
            del self.releasing[index]
        error = pending.exception()
        if error is not None:
            self._release_errors.append(error)
        call = self._call
        if call is not None:
            call.pump()

    def settle_later(self, pending: PendingOperation) -> None:
        """Keep track of a prefetch its call no longer needs until it settled (for drain)."""
        self.settling.add(pending)
        pending.add_done_callback(self.settling.discard)

    async def drain(self) -> None:
        """Wait until every device replica this module released has left the budget (its
        readers' events completed and the release committed) and every prefetch a call no
        longer needed has settled. Raises the first release error, or a copy failure no call
        reported."""
        while self.releasing or self.settling:
            if self.settling:
                pending = next(iter(self.settling))
            else:
                pending = next(iter(self.releasing.values()))
            await pending.wait_settled()
        errors, self._release_errors = self._release_errors, []
        raised, self._raised = self._raised, set()
        for error in errors:
            if id(error) not in raised:  # a copy failure its call raised already
                raise error

    # -- calls

    def deadline(self) -> float | None:
        """When a block waiting for budget now gives up (``anyio.current_time`` clock)."""
        return None if self.timeout is None else anyio.current_time() + self.timeout

    def timeout_message(self, group: TensorGroup) -> str:
        ledger = self.manager.state.find_ledger(self.device)
        if ledger is None:
            return f"{group.name} was not admitted at {self.device} within {self.timeout} s"
        return (
            f"{group.name} was not admitted at {self.device} within {self.timeout} s (used "
            f"{ledger.used_bytes} B + reserved {ledger.reserved_bytes} B of "
            f"{ledger.budget_bytes} B)"
        )

    def _compute_stream(self) -> Any:
        if self._stream is not None:
            return self._stream
        return self.manager.backend.current_stream(self.device)

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

        Awaits only when a block's weights are not admitted yet (waiting for budget); copies
        are waited for on the device by the compute stream. Returns the module's output,
        enqueued on the compute stream (CUDA) or computed (simulated backend)."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        self.manager.check_thread()
        self._check_inference(args, kwargs)
        async with self._lock:
            self._check_budget()
            keep = self._plan_keep()
            for index in list(self.kept - keep):
                self.release_replica(index)  # the budget shrank: no longer ours to keep
            self.kept = keep
            stream = self._compute_stream()
            host_wait = self.host_compute and not self._sequential
            call = CallPipeline(self, stream, host_wait=host_wait, keep=keep)
            self._call = call
            self.calls += 1
            try:
                call.start()
                if self._sequential:
                    result = await run_sequential(self, call, stream, args, kwargs)
                else:
                    result = await self._threaded.run(call, stream, args, kwargs)
                if call.failures:
                    raise call.failures[0]
                return result
            except Exception as error:
                self._raised.add(id(error))
                raise
            finally:
                call.finish()
                self._call = None

    def call_threadsafe(self, *args: Any, **kwargs: Any) -> Any:
        """``await self(*args, **kwargs)`` for a caller on another thread than the manager's
        event loop: blocks that thread (not the loop) until the call returns."""
        bridge = self.manager.bridge
        if bridge.on_loop():
            raise RuntimeError("call_threadsafe from the event loop's thread would deadlock")
        return bridge.run_async(self.__call__, *args, **kwargs)

    # -- end

    async def aclose(self) -> None:
        """Finish releases, remove the hooks, give the module its own host tensors back, and
        discard the values (their kept device replicas with them). The streamed module cannot
        be called afterwards."""
        if self._closed:
            return
        async with self._lock:
            self._closed = True
            try:
                await self.drain()
            finally:
                self._threaded.close()
                self._restore_host_tensors()
                for group in self._registered:
                    if group.hold is not None and group.hold.active:
                        group.hold.release()
                    if group.handle is not None:
                        await self.manager.discard(group.handle)
                self._registered.clear()
                self.kept.clear()
                if self._checkpoint is not None:
                    self._checkpoint.close()
                    self._checkpoint = None

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
            f"[{len(self.kept)} kept, {len(self.releasing)} releasing]>"
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
    keep_resident: bool = True,
) -> StreamedModule:
    """Register ``module``'s weights with ``manager`` for streaming to ``device``.

    ``prefetch``: how many blocks ahead of the running one may be copied (the ``device`` budget
    may allow fewer). ``host``: where the weights are kept (``"pinned-host"`` for full-speed
    copies, or ``"pageable-host"``, staged through the backend's pinned buffers);
    ``checkpoint``: a safetensors checkpoint to rebuild each block from instead: a file, a
    directory of shards with its ``model.safetensors.index.json``, or that index (keys are the
    module's ``state_dict`` names; dtypes are converted to the module's; a parameter or
    persistent buffer missing there is a ``KeyError`` naming it; non-persistent buffers, such
    as a rotary embedding's ``inv_freq``, are taken from the module, recovered when the module
    is on the ``meta`` device). ``blocks``: the submodules to stream, in call order (default: see
    :func:`find_blocks`). ``stream``: the compute stream (default: the caller's current stream
    at each call). ``timeout``: seconds a block may wait for budget before ``TimeoutError``
    (``None``: as long as it takes). ``keep_resident``: between calls, keep on the device the
    blocks that fit beside the prefetch window (first blocks first), so a call copies only
    what does not fit (see :meth:`StreamedModule.residency`); needs a strict ``device`` budget.

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
        keep_resident=keep_resident,
    )
