"""``StreamedModule`` and ``stream_module``: an ``nn.Module`` run with streamed weights.

Why this module is long: it holds the whole life of a streamed module in one class, from
registration (packed host copies or checkpoint sources) through calls and ``generate`` to the
background releases, ``drain`` and the end; the pipeline, the runners and the residency
arithmetic live in their own modules."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import anyio
import torch
from torch import nn

from ...core.errors import ResidencyBudgetError, ResidencyError
from ...core.locations import Location, LocationLike
from ...core.timeouts import check_timeout
from ...core.values import (
    MaterializationState,
    ReplicaMode,
    ValueHandle,
    check_optional_name,
    value_charge,
)
from ...progress import progress_if_large
from ...runtime.checkpoints import Checkpoint
from ...runtime.leases import current_task
from ...runtime.manager import ResidencyManager
from ...runtime.pending import PendingOperation
from ...runtime.shield import finish_shielded
from ...runtime.signal import ManagerClosedError
from ...runtime.sources import CallableSource
from . import nesting
from .checkpoint import BlockLoader, CheckpointNames, block_loader, check_names
from .packing import TensorGroup, collect_groups, compact, copy_into, find_blocks
from .pipeline import CallPipeline
from .residency import describe, others_bytes, spread
from .ring import IdleRing, RingCall
from .runners import ThreadedRunner, run_sequential

__all__ = ["HostKind", "StreamedModule", "stream_module"]

#: The streamed modules of each manager: a call waiting for room asks the idle ones at its
#: device for what they keep between calls (see :meth:`StreamedModule.ask_others_for_room`).
_by_manager: weakref.WeakKeyDictionary[ResidencyManager, weakref.WeakSet[StreamedModule]] = (
    weakref.WeakKeyDictionary()
)


def host_copy_holds(manager: ResidencyManager) -> list[tuple[ValueHandle, Location]]:
    """Where the open streamed modules of ``manager`` (``stream_module``'s, a model pool's)
    hold their host copies, one entry per hold: each module keeps its groups' host copies in
    place for its whole life (its tensors point into them), until its ``aclose()``. For
    tools that tell those standing holds from the ones a test or a request left behind
    (``aresidency.testing.assert_quiet``)."""
    return [
        (group.hold.handle, group.hold.location)
        for streamed in list(_by_manager.get(manager, ()))
        if not streamed._closed
        for group in streamed.all_groups
        if group.hold is not None and group.hold.active
    ]


#: One lock per manager and device: the calls of streamed modules there take their admission
#: in turns (see :class:`_AdmissionTurn`).
_turns: weakref.WeakKeyDictionary[ResidencyManager, dict[Location, anyio.Lock]] = (
    weakref.WeakKeyDictionary()
)


async def _acquire(lock: anyio.Lock, manager: ResidencyManager) -> None:
    """``await lock.acquire()``, or ``ManagerClosedError`` once the manager closes while it
    waits: the call holding the lock ends when the manager closes, as a rule, but one whose
    forward never returns (blocked in the user's code, or in a call nested in it) does not,
    and its followers would wait for ever. Free: no wait, nothing more."""
    try:
        lock.acquire_nowait()
        return
    except anyio.WouldBlock:
        pass
    closed: list[ManagerClosedError] = []
    acquired = False
    try:
        with anyio.CancelScope() as scope:

            async def watch() -> None:
                try:
                    while True:
                        await manager.wait_for_change()
                except ManagerClosedError as error:
                    closed.append(error)
                    scope.cancel()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(watch)
                await lock.acquire()
                acquired = True
                tasks.cancel_scope.cancel()
        if closed:
            raise closed[0]
    except BaseException:
        # (closed, or cancelled as the task group ended: the lock is not the caller's)
        if acquired:
            lock.release()
        raise


class _AdmissionTurn:
    """A call's turn to take what it needs at its device, one call at a time per manager and
    device: two calls that each took the tensors they hold for the whole call could otherwise
    wait for ever on the room for a block that the other's tensors fill. Taken before the call
    plans what it keeps (a call waiting for its turn is idle, so the call whose turn it is may
    take its kept blocks), held by a ring call until its ring is reserved (from then on it
    needs nothing more) and by a call over managed values until it ends (it takes each block's
    room as it goes)."""

    def __init__(
        self, manager: ResidencyManager, device: Location, closed: Callable[[], None]
    ) -> None:
        self._manager = manager
        self._lock = _turns.setdefault(manager, {}).setdefault(device, anyio.Lock())
        self._held = False
        self._closed = closed  # raises the call's ManagerClosedError

    async def __aenter__(self) -> _AdmissionTurn:
        try:
            await _acquire(self._lock, self._manager)
        except ManagerClosedError:
            self._closed()
            raise
        self._held = True
        return self

    @property
    def held(self) -> bool:
        return self._held

    def end(self) -> None:
        """The call holds what it needs: the next call's turn."""
        if self._held:
            self._held = False
            self._lock.release()

    async def __aexit__(self, *exc: object) -> None:
        self.end()


HostKind = Literal["pinned-host", "pageable-host"]


class StreamedModule:
    """An ``nn.Module`` whose blocks' weights are streamed through a device budget.

    Made by :func:`stream_module`; call it as ``y = await streamed(*args, **kwargs)``, or
    ``ids = await streamed.generate(...)`` for a Hugging Face model. See the package docstring
    for how a call runs. On CUDA the call returns once every block's work is
    enqueued on the compute stream (like any PyTorch call, the host does not wait for the
    device); its result is ready for work ordered after it on that stream.

    State: ``manager``, ``module``, ``device``, ``prefetch``, ``host`` (``None`` with a
    checkpoint), ``handles`` (one value per block with tensors, then the resident group's;
    a block listed twice in ``blocks`` is one value), ``order`` (the group index of each block
    run, in call order: a block listed twice comes twice), ``positions`` (group index -> its
    places in ``order``), ``position`` (its first place),
    ``releasing`` (group index -> the release of its device replica in flight),
    ``kept`` (group indexes whose device replica stays between calls), ``current_call`` (the
    ring or pipeline of the call in flight, or ``None``), ``ring`` (whether calls stream
    through a ring), ``rings`` (finished calls' rings not retired yet, by reservation name),
    ``copies``/``copied_bytes`` (copies to the device started so far).
    Invariants: outside a call, every parameter and buffer of ``module`` is its own tensor
    again (``host`` mode: a view of the managed host copy); a group's device replica exists
    only while a call uses or prefetches it, while its release waits for its readers, or while
    it is kept resident.
    """

    #: Whether what the module keeps between calls is offered to other tenants short of
    #: room (``manager.add_reclaimer``); a model pool's modules are offered by the pool.
    offers_kept = True

    def __init__(
        self,
        manager: ResidencyManager,
        module: nn.Module,
        *,
        device: LocationLike = "cuda:0",
        prefetch: int = 2,
        host: HostKind = "pinned-host",
        checkpoint: str | Path | Checkpoint | None = None,
        blocks: Sequence[nn.Module] | None = None,
        stream: Any = None,
        timeout: float | None = None,
        name: str | None = None,
        keep_resident: bool = True,
        ring: bool | None = None,
        checkpoint_names: CheckpointNames | None = None,
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
        if host not in ("pinned-host", "pageable-host"):
            # (with a checkpoint the weights live in no host copy, but a wrong value is wrong)
            raise ValueError(f"host must be 'pinned-host' or 'pageable-host', got {host!r}")
        if ring is not None and not isinstance(ring, bool):
            raise TypeError(f"ring must be True, False or None, got {ring!r}")
        if not isinstance(keep_resident, bool):
            raise TypeError(f"keep_resident must be True or False, got {keep_resident!r}")
        if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike, Checkpoint)):
            raise TypeError(
                "checkpoint must be a path (str or os.PathLike) or an opened Checkpoint, got "
                f"{type(checkpoint).__name__}"
            )
        if isinstance(checkpoint, str) and not checkpoint.strip():
            raise ValueError(
                f"checkpoint must name a file or directory, got {checkpoint!r} (None streams "
                "the module's own weights)"
            )
        if checkpoint_names is not None and checkpoint is None:
            raise ValueError("checkpoint_names= maps names to a checkpoint's: give checkpoint=")
        self._checkpoint_names = check_names(checkpoint_names, module)
        self.prefetch = prefetch
        self.keep_resident = keep_resident
        # An opened Checkpoint is the caller's (opened off the loop, closed by the caller);
        # a path is opened at registration and closed with the module.
        given = checkpoint if isinstance(checkpoint, Checkpoint) else None
        self._owns_checkpoint = given is None
        if isinstance(checkpoint, Checkpoint):
            self.checkpoint: Path | None = checkpoint.path
        else:
            self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.host: HostKind | None = None if checkpoint is not None else host
        check_optional_name(name, "streamed module", "its values, ring reservations and errors")
        self.name = name or f"{type(module).__name__}-{id(module):x}"
        self._stream = stream
        manager.check_thread()
        backend = manager.backend
        backend.check_location(self.device)
        if stream is not None:
            backend.check_stream(stream, self.device)
        self.host_compute = backend.host_compute
        can_ring = self.host == "pinned-host" and backend.has_copy_into
        if ring and not can_ring:
            raise ValueError(
                "ring=True needs the weights in pinned host memory (host='pinned-host', no "
                f"checkpoint) and a backend with copy_into; this module has host={self.host!r} "
                f"on {type(backend).__name__}"
            )
        self.ring = can_ring if ring is None else ring
        if blocks is not None:
            blocks = _check_blocks(module, blocks)
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
            and not callable(getattr(module, "generate", None))
        )
        self.block_groups = groups
        # The blocks' groups once each (a block listed twice has one), in call order; the
        # call order itself lists a group each time its block runs.
        self._groups: list[TensorGroup] = list({id(g): g for g in groups if g is not None}.values())
        self.order = [g.index for g in groups if g is not None]
        self.positions: dict[int, list[int]] = {}
        for pos, index in enumerate(self.order):
            self.positions.setdefault(index, []).append(pos)
        self.position = {index: places[0] for index, places in self.positions.items()}
        self._by_index = {g.index: g for g in self._groups}
        if self.resident_group is not None:
            self._by_index[self.resident_group.index] = self.resident_group
        self.releasing: dict[int, PendingOperation] = {}
        # copies a finished call cancelled, or whose block was handed back before it arrived
        self.settling: set[PendingOperation] = set()
        # group index -> a copy a finished call cancelled, until it settled (the replica is
        # leaving: a later call waits for it, as for a release, before it starts the group)
        self.cancelling: dict[int, PendingOperation] = {}
        # rings of finished calls waiting for the device to pass their last use (name -> set
        # once the buffer is freed and the reservation ended)
        self.rings: dict[str, IdleRing] = {}
        self._deferred: set[int] = set()  # releases waiting for their replica to arrive
        self.kept: set[int] = set()
        self._release_errors: list[BaseException] = []
        self._raised: set[int] = set()  # ids of errors a call raised (drain skips them)
        self._lock = anyio.Lock()
        self.current_call: CallPipeline | RingCall | None = None
        # the call in flight, for a call made from inside its forward (see nesting)
        self._forward: nesting.Forward | None = None
        self._threaded = ThreadedRunner(self)
        self._closed = False
        self._registered: list[TensorGroup] = []
        self._checkpoint: Checkpoint | None = given
        self._loaders: dict[int, BlockLoader] = {}  # group index -> its checkpoint loader
        self._dropped: set[str] = set()  # tensors whose replacement was dropped (warned once)
        self.calls = 0
        # Copies to the device this module started (a block each time it is streamed in, the
        # groups it keeps when they arrive), and their bytes: what "budgets that remember" save.
        self.copies = 0
        self.copied_bytes = 0
        self._refuse_streamed_twice()
        try:
            # What can be refused is refused before a tensor moves or a value is registered.
            self._check_before_moving()
            self._register_all()
            if not self._sequential:
                self._threaded.install_hooks()
        except BaseException:
            self._unregister_now()
            raise
        _by_manager.setdefault(manager, weakref.WeakSet()).add(self)
        # What the module keeps between calls is a cache: offered to any tenant short of
        # room at the device (a loader's batch, a scope, a pool's request), as to another
        # streamed module's call (ask_others_for_room). Weakly, as _by_manager holds it.
        self._unreclaim: Callable[[], None] | None = None
        if self.offers_kept:
            method = weakref.WeakMethod(self._reclaim)

            def reclaim(location: Location, nbytes: int) -> int:
                bound = method()
                return 0 if bound is None else bound(location, nbytes)

            self._unreclaim = manager.add_reclaimer(reclaim)

    # -- set-up

    def _refuse_streamed_twice(self) -> None:
        """``ValueError`` if the module (or a submodule of it) is streamed already, by this
        manager (``stream_module`` again, a model pool's) or by another one, until that
        streamed module's ``aclose()``: its tensors would be registered and charged twice,
        and the first streamed module would find them swapped out (pointed at the other
        registration's memory, for good). Changes nothing, but for a streamed module whose
        manager has closed without its ``aclose()``: it can never run again, so it is closed
        here (its hooks removed, its module given its own tensors back), as ``aclose()``
        would, and the module may be streamed again."""
        mine = {id(sub) for sub in self.module.modules()}
        for manager, streamed in list(_by_manager.items()):
            for other in list(streamed):
                if other._closed or other is self:
                    continue
                if not any(id(sub) in mine for sub in other.module.modules()):
                    continue
                if not manager.running:
                    other._close_after_manager()
                    continue
                if manager is self.manager:
                    raise ValueError(
                        f"{type(self.module).__name__} is (or shares submodules with) a module "
                        f"this manager streams already ({other.name}); use that one, aclose() "
                        "it first, or stream a separate copy (copy.deepcopy)"
                    )
                raise ValueError(
                    f"{type(self.module).__name__} is (or shares submodules with) a module "
                    f"another manager ({manager.id}) streams already ({other.name}, to "
                    f"{other.device}): its tensors are views of that manager's host copy, "
                    "and streaming them here too would take them from it; aclose() that "
                    "streamed module first, or stream a separate copy (copy.deepcopy)"
                )

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

    def _check_before_moving(self) -> None:
        """Everything the construction can refuse, before a tensor moves (packing gives each
        tensor new storage, and frees the old as it goes, so that host memory is never
        doubled) or a value is registered: the checkpoint opens and holds every tensor in a
        dtype that converts (a loader per group), no tensor is on the meta device without a
        checkpoint, the largest block fits the device budget beside the tensors outside the
        blocks, and the packed groups fit the host budget. Sets each group's charge (what the
        manager will charge for it) and ``_largest``."""
        if self.checkpoint is not None and self._checkpoint is None:
            self._checkpoint = Checkpoint.open(self.checkpoint)
        opened = self._checkpoint
        granularity = self.manager.state.granularity
        for group in self.all_groups:
            if opened is not None:
                self._loaders[group.index] = block_loader(
                    group, opened, module=self.module, names=self._checkpoint_names
                )
            else:
                meta = [e.names[0] for e in group.entries if e.tensor.is_meta]
                if meta:
                    raise ValueError(
                        f"{meta[0]} is on the meta device: give checkpoint= to load the weights"
                    )
            group.charge_bytes = value_charge(group.nbytes, None, granularity)
        self._largest = max((g.charge_bytes for g in self._groups), default=0)
        self._check_budget()
        if opened is None:
            assert self.host is not None
            self.manager.state.ledger(Location.parse(self.host)).check_admit(
                sum(g.charge_bytes for g in self.all_groups),
                f"{self.name}: packing its {len(self.all_groups)} groups into {self.host}",
            )

    def _register_all(self) -> None:
        manager = self.manager
        opened = self._checkpoint
        # Packing and pinning every block of a large model takes seconds on the loop thread:
        # one report over all of it (the registrations inside report nothing of their own).
        # With a checkpoint nothing is copied here (the blocks load lazily): nothing to report.
        copied = 0 if opened is not None else sum(g.nbytes for g in self.all_groups)
        where = f"pack {len(self.all_groups)} blocks into {self.host}"
        with progress_if_large(f"stream_module {self.name}: {where}", copied) as report:
            self._register_groups(opened, report.update)
        snap = manager.snapshot()
        for group in self.all_groups:
            assert group.handle is not None
            group.charge_bytes = snap.value(group.handle).charge_bytes
        self._largest = max((g.charge_bytes for g in self._groups), default=0)
        self._note_weights()
        self._note_modules()

    def _note_modules(self) -> None:
        """Remember every submodule edge (parent, attribute, child) of the module, with the
        child's path and whether its subtree holds tensors (see :meth:`_check_modules`)."""
        self._edges: list[tuple[nn.Module, str, nn.Module, str, bool]] = []
        # each module's path and how many children it had (one added shows there)
        self._parents: list[tuple[nn.Module, str, int]] = []
        for path, parent in self.module.named_modules():
            self._parents.append((parent, path, len(parent._modules)))
            for attr, child in parent._modules.items():
                if child is not None:
                    where = f"{path}.{attr}" if path else attr
                    self._edges.append((parent, attr, child, where, _holds_tensors(child)))

    def _check_modules(self) -> None:
        """``ValueError`` if a submodule holding tensors was replaced (or removed) since
        :func:`stream_module`, or one without was replaced by one with: a new module's
        tensors were never registered, and a new block has no hooks (its weights would stay
        on the host). So is a submodule with tensors added (a layer appended to a block
        list). A module without tensors replaced by another (an activation) is fine."""
        for parent, path, count in self._parents:
            if len(parent._modules) == count:
                continue
            known = {attr for p, attr, *_ in self._edges if p is parent}
            for attr, child in parent._modules.items():
                if attr not in known and child is not None and _holds_tensors(child):
                    where = f"{path}.{attr}" if path else attr
                    raise ValueError(
                        f"{self.name}: {where} ({type(child).__name__}) was added since "
                        "stream_module: its weights were never packed, and a block added is "
                        "not streamed; aclose() the streamed module and stream the module "
                        "again"
                    )
        for i, (parent, attr, child, where, holds) in enumerate(self._edges):
            current = parent._modules.get(attr)
            if current is child:
                continue
            if not holds and (current is None or not _holds_tensors(current)):
                if current is not None:
                    self._edges[i] = (parent, attr, current, where, False)
                continue
            new = "removed" if current is None else f"replaced by a new {type(current).__name__}"
            raise ValueError(
                f"{self.name}: {where} was {new} since stream_module: a streamed module "
                "runs the modules and tensors it registered (a new module's weights were "
                "never packed, and a new block is not streamed); aclose() it and stream the "
                "module again, or change weights in place (load_state_dict without assign, "
                "copy_ under no_grad)"
            )

    def _register_groups(self, opened: Checkpoint | None, copied: Callable[[int], None]) -> None:
        """Register every group: as a source reading ``opened``, or packed into the host
        location (``copied(nbytes)`` after each)."""
        manager = self.manager
        repointed: set[int] = set()
        for group in self.all_groups:
            if opened is not None:
                load = self._loaders[group.index]
                source = CallableSource(
                    load, shape=(group.nbytes,), dtype=torch.uint8, source_location="pageable-host"
                )
                group.handle = manager.register_source(
                    source, name=group.name, replica_mode=ReplicaMode.REPLICABLE
                )
                group.from_source = True
            else:
                assert self.host is not None
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
                copied(group.nbytes)
                continue
            self._registered.append(group)

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
        # Only the backend's own reservations (its staging) stay for ever. The others (rings,
        # ours or another streamed module's; scopes; reservation blocks; a loader's buffers)
        # end on their own, and a call waits for their room; what the calling task keeps
        # itself is checked below.
        reserved = sum(
            nbytes for nbytes, owner in record.reservations.values() if owner == "backend"
        )
        own = None
        if need <= record.budget_bytes - reserved and need > record.budget_bytes - (
            record.reserved_bytes - self._all_ring_bytes()
        ):
            # Room only once reservations end: none of them may be this task's own.
            own = self.manager.waiting_on_itself(
                need,
                self.device,
                exempt=self.handles,
                what=(
                    f"{self.name}: a call needs room for its largest block "
                    f"({self._largest} B) plus the tensors outside the blocks "
                    f"({self.resident_bytes} B)"
                ),
            )
        if own is not None:
            raise own
        if need > record.budget_bytes - reserved:
            largest = self._largest
            block = max(self._groups, key=lambda g: g.charge_bytes, default=None)
            which = f"{self.block_label(block)}, " if block is not None else ""
            raise ValueError(
                f"{self.name}: the largest block ({which}{largest} B) plus the tensors outside the "
                f"blocks ({self.resident_bytes} B) need {need} B at {self.device}, more than its "
                f"budget ({record.budget_bytes} B) less the backend's own reservations "
                f"({reserved} B); streaming could never run"
            )

    def _all_ring_bytes(self) -> int:
        """Bytes the rings of every streamed module of the manager at our device reserve."""
        return sum(
            other._ring_bytes()
            for other in list(_by_manager.get(self.manager, ()))
            if other.device == self.device
        )

    def _idle_ring_bytes(self) -> int:
        """Bytes reserved by the rings of our finished calls not retired yet."""
        return sum(r.reserved_bytes for r in self.rings.values())

    def _ring_bytes(self) -> int:
        """Bytes reserved by our rings: the finished calls' not retired yet, and the call's
        in flight."""
        call = self.current_call
        active = call.reserved_bytes if isinstance(call, RingCall) else 0
        return self._idle_ring_bytes() + active

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
        self._close_checkpoint()

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
                    if entry.broadcast:
                        # (expanded: its memory copied, expanded again as it was)
                        own = compact(view, entry.broadcast).clone().expand(entry.shape)
                    else:
                        own = torch.empty_strided(entry.shape, entry.stride, dtype=entry.dtype)
                        own.copy_(view)
                    entry.tensor.data = own
                group.host_flat = None

    def block_label(self, group: TensorGroup) -> str:
        """``group``'s block as the module names it (``layers.3``), for messages."""
        if group.index < len(self.blocks):
            block = self.blocks[group.index]
            for name, sub in self.module.named_modules():
                if sub is block:
                    return name or type(block).__name__
        return "the tensors outside the blocks"

    def _note_weights(self) -> None:
        """Remember each host tensor's memory and version (see :meth:`_changed_groups`)."""
        for group in self._registered:
            if group.host_flat is not None:
                group.note()

    def _changed_groups(self) -> list[TensorGroup]:
        """The groups whose tensors were written in place since they were noted (a
        ``load_state_dict``, a ``copy_`` under ``no_grad``), or that a call's forward put
        other tensors in (see :meth:`_check_replaced`): their device replicas are stale.
        ``ValueError`` if a tensor was replaced instead (``load_state_dict(assign=True)``,
        ``.half()``, ``.to(...)``, a new ``Parameter``): the streamed weights are the ones
        registered, so the call would not run the module's; so is a submodule replaced
        (:meth:`_check_modules`)."""
        self._check_modules()
        changed = self._check_replaced()
        for group in self._registered:
            if group.seen is None or group.replaced:
                continue
            replaced, stale = group.changes()
            if replaced is not None:
                raise ValueError(
                    f"{self.name}: {replaced.names[0]} was replaced since stream_module "
                    "(load_state_dict(assign=True), .to(), .half() or a new Parameter): "
                    "a streamed module runs the tensors it registered; aclose() it and "
                    "stream the module again, or change weights in place "
                    "(load_state_dict without assign, copy_ under no_grad)"
                )
            if stale:
                changed.append(group)
        return changed

    async def _refresh(self, changed: list[TensorGroup]) -> None:
        """Weights written in place, or replaced by a call's forward: once nothing reads the
        host copies (the releases and copies of earlier calls settled), write what the
        forward put in place of the module's tensors into them (:meth:`_apply_replaced`),
        bring the packed host copies up to date (a tensor tied across groups lives in one of
        them) and drop the stale device replicas; the call copies those groups again."""
        await self.drain()
        replaced = [g for g in changed if g.replaced]
        if replaced:
            self._apply_replaced(replaced)
            # (a tensor written there may be tied into another group: stale now too)
            changed = list({id(g): g for g in [*changed, *self._changed_groups()]}.values())
        with torch.no_grad():
            for group in changed:
                if group.host_flat is not None:
                    for entry, view in zip(group.entries, group.views(group.host_flat)):
                        if entry.tensor.data_ptr() != view.data_ptr():
                            copy_into(entry, view, entry.tensor.detach())
                    group.note()
                self.kept.discard(group.index)
                self.release_replica(group.index)

    def _check_replaced(self) -> list[TensorGroup]:
        """The groups a call's forward put other tensors in: a forward that puts a new tensor
        in place of one of a group's (a dynamic RoPE's ``register_buffer("inv_freq", ...)``
        once a sequence outgrows the longest it has seen) changes the module, as it would
        unstreamed. The call captured the new value on the host when the block (or the
        forward, for the tensors outside the blocks) ended; :meth:`_refresh` writes it into
        the module's tensor before the next call (with a checkpoint: the loader copies it
        instead of the module's non-persistent buffer). A value that cannot be kept (of
        another shape or dtype, ``None``, or one for a tensor read from a checkpoint) is
        dropped with a warning naming the tensor (once per tensor): the next calls start
        from the packed one again, as every call did before (harmless for a table the
        forward rebuilds when it needs a larger one, such as M2M100's sinusoidal positions;
        a different result from the unstreamed module's for state it keeps there)."""
        groups = []
        for group in self.all_groups:
            if not group.replaced:
                continue
            loader = self._loaders.get(group.index)
            for index, value in list(group.replaced.items()):
                entry = group.entries[index]
                if value is None:
                    what = "None"
                elif value.shape != entry.shape or value.dtype != entry.dtype:
                    what = f"a {value.dtype} tensor of shape {list(value.shape)}"
                elif loader is not None and not loader.copies_entry(index):
                    what = f"a new tensor, but it is read from checkpoint {self.checkpoint}"
                else:
                    continue
                del group.replaced[index]
                if entry.names[0] not in self._dropped:
                    self._dropped.add(entry.names[0])
                    warnings.warn(
                        f"{self.name}: a call's forward replaced {entry.names[0]} "
                        f"({entry.dtype}, shape {list(entry.shape)}) with {what}, which a "
                        "streamed module cannot keep (its tensors are packed with their shape "
                        "and dtype; a checkpoint's are read from the file): each call starts "
                        "from the packed one, unlike the module run unstreamed",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            if group.replaced:
                groups.append(group)
        return groups

    def _apply_replaced(self, groups: list[TensorGroup]) -> None:
        """Write the values captured in ``groups`` into the module's own tensors (or into what
        a checkpoint's loader copies), while nothing reads them."""
        with torch.inference_mode():  # (also writes a tensor made under inference mode)
            for group in groups:
                replaced, group.replaced = group.replaced, {}
                loader = self._loaders.get(group.index)
                for index, value in replaced.items():
                    assert value is not None
                    entry = group.entries[index]
                    if loader is not None:
                        loader.set_copy(index, value)
                    if not entry.tensor.is_meta:
                        entry.tensor.copy_(value)

    def unprotected_handles(self) -> list[ValueHandle]:
        """The module's values nothing protects at the device now: what a wait for room
        counts as given back (the module releases them itself as it goes), unlike what the
        waiting call leases there. The resident group is the call's while one is in flight,
        on its way in too (its copy in flight, or landed and not leased yet): the call leases
        it for its whole length and never gives it back. Counted as given back, the call's
        wait would seem able to end, and a wait closing a cycle with it would not be
        refused (see :meth:`ResidencyManager.room_wait`)."""
        state = self.manager.state
        resident = self.resident_group
        ours = None if resident is None or self.current_call is None else resident.handle
        out = []
        for handle in self.handles:
            if handle is ours:
                continue
            value = state.find_value(handle)
            mat = None if value is None else value.materializations.get(self.device)
            if mat is None or not mat.protected:
                out.append(handle)
        return out

    def ask_others_for_room(self) -> bool:
        """A call of ours waits for room at our device: the other streamed modules of the
        manager that are idle there give up what they keep between calls (a cache, which
        yields to a call that needs the room; their next call plans again). Returns whether
        any did: the caller tries again before it waits (a release with no readers left
        commits at once, and no later change would wake it)."""
        yielded = False
        for other in list(_by_manager.get(self.manager, ())):
            if other is not self and other.device == self.device:
                yielded = other._yield_kept() or yielded
        return yielded

    def _reclaim(self, location: Location, nbytes: int) -> int:
        """The manager's reclaimer (:meth:`ResidencyManager.add_reclaimer`): a tenant lacks
        ``nbytes`` at ``location``. When it is our device and no call of ours is in flight,
        what we keep there is released (the next call plans again). Returns the bytes whose
        release began. Loop thread."""
        if location != self.device:
            return 0
        here = [index for index in self.kept if self._replica_here(index)]
        if not self._yield_kept():
            return 0
        return sum(
            self.group(index).charge_bytes
            for index in here
            if index in self.releasing or not self._replica_here(index)
        )

    def _yield_kept(self) -> bool:
        """Release what this idle module keeps; whether a release started (a group someone
        holds, such as a model pool's, stays)."""
        if self._closed or self.current_call is not None or not self.kept:
            return False
        kept, self.kept = self.kept, set()
        yielded = False
        for index in sorted(kept):
            had = self._replica_here(index)
            self.release_replica(index)
            # released at once (no readers left), or on its way out
            yielded = yielded or (
                had and (index in self.releasing or not self._replica_here(index))
            )
        return yielded

    def _forget_gone_kept(self) -> None:
        """After a call: a group planned to stay whose replica is not at the device (the call
        ended before it came) or is leaving (a release an earlier call started) is not kept.
        One still arriving stays kept (a failed arrival is dropped when it fails)."""
        for index in list(self.kept):
            if index in self.releasing or not self._replica_here(index):
                self.kept.discard(index)

    def _replica_here(self, index: int) -> bool:
        handle = self.group(index).handle
        value = None if handle is None else self.manager.state.find_value(handle)
        return value is not None and self.device in value.materializations

    # -- residency between calls ("budgets that remember")

    def _window_bytes(self) -> int:
        """Device bytes the prefetch window may need at once: the block in use and
        ``prefetch`` more, counted at the largest block; never more blocks than the module
        has (a block listed twice is one group: one replica, one ring slot)."""
        return min(self.prefetch + 1, len(self._groups)) * self._largest

    def _plan_keep(self) -> set[int]:
        """The groups to keep on the device after this call: the resident group, then as many
        block bytes as fit beside the window in what the budget leaves us (what other tenants
        hold is not ours to take), spread evenly over the call order. A call then copies only
        the rest, and those copies overlap the compute of the kept blocks between them."""
        if not self.keep_resident:
            return set()
        state = self.manager.state
        ledger = state.find_ledger(self.device)
        if ledger is None or ledger.budget_bytes is None:
            return set()  # without a strict budget nothing says how much may stay
        # (our finished calls' rings are ours: the next call takes one over or it retires)
        others = others_bytes(state, self.device, self.all_groups) - self._idle_ring_bytes()
        if sum(g.charge_bytes for g in self.all_groups) <= ledger.budget_bytes - others:
            # The whole model fits: every group stays, nothing is copied, and no room is
            # left for a window no call would use.
            return {g.index for g in self.all_groups}
        room = ledger.budget_bytes - others - self._window_bytes()
        keep: set[int] = set()
        if self.resident_group is not None:
            room -= self.resident_group.charge_bytes
            if room < 0:
                return set()
            keep.add(self.resident_group.index)
        return keep | spread(self._groups, room)

    def residency(self) -> dict[str, Any]:
        """Which groups stay on the device between calls, and why (the budget arithmetic of
        the last call's plan): ``kept`` (group names: the resident group, then blocks in call
        order), ``streamed`` (the groups copied on each call), ``kept_bytes``,
        ``streamed_bytes`` (copied on each call), ``window_bytes`` (room for the prefetch
        window: ``prefetch + 1`` x the largest block, or, when fewer blocks are copied on
        each call than that or the budget leaves room for fewer blocks beside the tensors
        outside the blocks and what other tenants hold, the bytes a call really uses: its
        ring's slots, or the blocks it copies at once; 0 when nothing is copied),
        ``window_blocks`` (how many blocks that is), ``budget_bytes``, ``others_bytes`` (what
        other tenants hold at the device), ``reason`` (a sentence, which says when the window
        is smaller than ``prefetch + 1`` blocks, and why). Before the first call: the plan the
        first call would make now."""
        return describe(
            self.manager.state,
            self.device,
            self._groups,
            self.resident_group,
            self.kept if self.calls or self._closed else self._plan_keep(),
            window_bytes=self._window_bytes(),
            prefetch=self.prefetch,
            keep_resident=self.keep_resident,
            own_reserved=self._ring_bytes(),
            ring=self.ring,
        )

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
            self.settle_later(arriving)  # drain waits for it, then for the release it starts
            return
        if arriving is not None and arriving.exception() is not None:
            return  # the failed copy was aborted: nothing to release
        group = self.group(index)
        assert group.handle is not None
        if index in self.releasing:
            return
        if not self.manager.running:
            return  # the manager is closing: it frees every replica itself
        if index in self.kept:
            # Planned to stay by the call in flight or the last one (a release deferred until
            # an earlier call's copy arrived fires after a later call chose to keep it).
            return
        value = self.manager.state.find_value(group.handle)
        record = None if value is None else value.materializations.get(self.device)
        if record is None:
            return  # gone already
        if record.use_count or record.hold_count:
            # A later call leased it meanwhile (a release deferred until a copy arrived fires
            # after the next call took the replica): that call releases or keeps it.
            return
        if record.state is not MaterializationState.RESIDENT:
            # Still arriving (a copy a cancelled call began for a group it meant to keep):
            # released once it settled.
            self._release_when_settled(index)
            return
        try:
            pending = self.manager.release_nowait(group.handle, self.device)
        except ResidencyError as error:
            self._release_errors.append(error)
            return
        self.releasing[index] = pending
        pending.add_done_callback(functools.partial(self._released, index))

    def _release_when_settled(self, index: int) -> None:
        """Release group ``index``'s replica once it is no longer arriving (loop)."""
        if index in self._deferred:
            return
        self._deferred.add(index)
        handle = self.group(index).handle
        assert handle is not None

        def changed() -> None:
            value = self.manager.state.find_value(handle)
            record = None if value is None else value.materializations.get(self.device)
            if record is not None and record.state is not MaterializationState.RESIDENT:
                return  # still arriving: wait for the next change
            unlisten()
            self._deferred.discard(index)
            if record is not None and index not in self.kept:
                self.release_replica(index)

        unlisten = self.manager.add_change_listener(changed)

    def _released(self, index: int, pending: PendingOperation) -> None:
        if self.releasing.get(index) is pending:
            del self.releasing[index]
        error = pending.exception()
        if error is not None:
            self._release_errors.append(error)
        if self.current_call is None and not self._replica_here(index):
            # A release an earlier call started, committed after a later call planned to
            # keep the group and ended without it: its replica is gone, so it is not kept.
            self.kept.discard(index)
        call = self.current_call
        if call is not None:
            call.pump()  # it may wait for this release; it also takes the blocks handed back

    def _kept_readers(self) -> bool:
        """Whether a replica kept at the device still has reader events not reaped."""
        state = self.manager.state
        for index in self.kept:
            handle = self.group(index).handle
            value = None if handle is None else state.find_value(handle)
            record = None if value is None else value.materializations.get(self.device)
            if record is not None and record.pending_event_count:
                return True
        return False

    def settle_later(self, pending: PendingOperation) -> None:
        """Keep track of a prefetch its call no longer needs until it settled (for drain)."""
        self.settling.add(pending)
        pending.add_done_callback(self.settling.discard)

    def cancel_copy(self, index: int, pending: PendingOperation) -> None:
        """Cancel group ``index``'s copy a finished call no longer needs: until it settled,
        a later call waits for it before starting the group (a lease on a copy being
        cancelled fails); drain waits for it too."""
        pending.cancel()
        self.settle_later(pending)
        if pending.done():
            return
        self.cancelling[index] = pending
        pending.add_done_callback(functools.partial(self._cancelled, index))

    def _cancelled(self, index: int, pending: PendingOperation) -> None:
        if self.cancelling.get(index) is pending:
            del self.cancelling[index]
        call = self.current_call
        if call is not None:
            call.pump()  # it may wait for this copy to settle

    def end_reservation(self, name: str) -> None:
        """End a retired ring's reservation (loop; nothing to do once the manager closed)."""
        if self.manager.running:
            try:
                self.manager.unreserve_nowait(name, self.device)
            except (ResidencyError, ValueError, RuntimeError) as error:
                self._release_errors.append(error)

    async def drain(self) -> None:
        """Wait until every device replica this module released has left the budget (its
        readers' events completed and the release committed), every prefetch a call no
        longer needed has settled, and the readers of the replicas kept resident are done
        (their events reaped: on CUDA, the last call's kernels on the compute stream ran).
        The host does not block: this awaits the manager's completions. Between calls it
        ends with ``kept`` naming only groups at the device. Raises the first release error,
        or a copy failure no call reported. Loop thread, as every call: from another thread
        it raises ``RuntimeError``."""
        if self.manager.running:
            self.manager.check_thread()
        while True:
            if self.settling:
                await next(iter(self.settling)).wait_settled()
            elif self.releasing:
                await next(iter(self.releasing.values())).wait_settled()
            elif self.rings:
                await next(iter(self.rings.values())).done.wait()
            elif self._deferred:
                await self.manager.wait_for_change()  # an arrival, then its release
            elif self._kept_readers():
                await self.manager.wait_for_change()  # an event reaped is a change
            else:
                break
        if self.current_call is None:
            # Every release and arrival has settled and no call runs: a group the plan still
            # names but the device no longer holds (however it left) is not kept.
            self._forget_gone_kept()
        errors, self._release_errors = self._release_errors, []
        raised, self._raised = self._raised, set()
        for error in errors:
            if id(error) not in raised:  # a copy failure its call raised already
                raise error

    # -- calls

    def deadline(self) -> float | None:
        """When a block waiting for budget now gives up (``anyio.current_time`` clock)."""
        return None if self.timeout is None else anyio.current_time() + self.timeout

    def timeout_message(
        self,
        group: TensorGroup,
        need: int | None = None,
        refused: ResidencyBudgetError | None = None,
    ) -> str:
        """The ``TimeoutError`` of ``group`` not admitted in time: what it waited for
        (``need`` bytes: the group's charge, or a ring buffer for it) against the room there
        was, and the reservations that held the rest, by name. ``refused``: the manager's
        last refusal of its copy, when it was short of room elsewhere than at the device
        (where a checkpoint's group is read on its way): the message names that location."""
        where = self.device
        text = f"{group.name} was not admitted at {self.device} within {self.timeout} s"
        if refused is not None and refused.location != self.device:
            where = refused.location
            text += (
                f": it is read from its source into {where} on its way there, which had no "
                f"room for its {refused.requested_bytes} B"
            )
        elif need is not None:
            text += f": it needs {need} B"
        ledger = self.manager.state.find_ledger(where)
        if ledger is None:
            return text
        budget = ledger.budget_bytes
        free = "" if budget is None else f", {max(0, budget - ledger.charged_bytes)} B free"
        text += (
            f" (used {ledger.used_bytes} B + reserved {ledger.reserved_bytes} B of "
            f"{budget} B{free})"
        )
        if ledger.reservations:
            held = sorted(ledger.reservations.items(), key=lambda item: -item[1][0])
            listed = ", ".join(f"{name!r} {nbytes} B" for name, (nbytes, _) in held[:5])
            more = f" and {len(held) - 5} more" if len(held) > 5 else ""
            text += f"; reservations there: {listed}{more}"
        return text

    def call_executor(self) -> concurrent.futures.Executor | None:
        """The executor that runs the next call's forward when it is not the module's own
        worker thread (``None``: its own). A subclass may name one shared with other modules;
        it must run one call at a time, and only calls that never wait there for another
        module's call to progress (a call whose every block is already on the device)."""
        return None

    def _compute_stream(self) -> Any:
        if self._stream is not None:
            return self._stream
        return self.manager.backend.current_stream(self.device)

    @staticmethod
    def _check_inference(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Refuse a call in grad mode with an input that requires grad, wherever it sits in
        the arguments (in a dict, list, tuple, dataclass...): autograd would keep each block's
        weights past their release, and the gradients would be wrong."""
        if not torch.is_grad_enabled():
            return
        budget = [10_000]
        named = [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]
        for name, value in named:
            where = _requires_grad_at(value, name, budget)
            if where is None:
                continue
            raise ValueError(
                f"weight streaming is for inference: the input at {where} requires grad while "
                "grad mode is on, so autograd would keep each block's weights past their "
                "release (and its gradients would be wrong); call under torch.no_grad() or "
                "torch.inference_mode()"
            )

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module with its blocks' weights streamed through the device budget.

        Awaits only when a block's weights are not admitted yet (waiting for budget); copies
        are waited for on the device by the compute stream. Returns the module's output,
        enqueued on the compute stream (CUDA) or computed (simulated backend). Hugging Face
        keyword arguments pass through as they are (``input_ids=``, ``attention_mask=``,
        ``past_key_values=``, ``use_cache=True``: the cache it returns lives on the device)."""
        return await self._run(None, args, kwargs)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Run Hugging Face generation (``self.module.generate(*args, **kwargs)``, from
        ``GenerationMixin``) with streamed weights, and return what it returns (the generated
        ids, or its output object).

        The generate loop runs in the worker thread that runs the module's forward: each of
        its forward passes streams the blocks through the device budget as a call does (the
        KV cache and activations stay on the device; only weights stream), and across the
        passes the prefetch window wraps around: while the last blocks of one pass run, the
        first blocks of the next are being copied (unless kept resident). The host waits in
        that thread only (for a block not ready yet, and wherever generation itself syncs,
        such as its stopping checks); this awaits the thread. Cancelling the awaiting task
        stops generation at the next block boundary and leaves nothing behind beyond what
        ``keep_resident`` keeps (:meth:`drain` waits for the releases).

        ``TypeError`` for a module without a ``generate`` method."""
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise TypeError(
                f"{type(self.module).__name__} has no generate() method: stream a Hugging Face "
                "model with GenerationMixin (such as LlamaForCausalLM) to generate, or await "
                "the streamed module itself for a forward pass"
            )
        return await self._run(generate, args, kwargs)

    async def _run(
        self, generate: Callable[..., Any] | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """One call: the module's forward (``generate`` is None) or its generate loop."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        self._check_manager()
        self._check_inference(args, kwargs)
        outer = nesting.awaited_in(self.manager.bridge)
        if outer is not None:
            # Awaited in a task that another call's forward started on this loop (with
            # asyncio.run_coroutine_threadsafe or from_thread.run): nested in that call, as
            # a call_threadsafe from there is.
            self._refuse_nested(outer, from_task=True)
            return await self._call_nested(outer, args, kwargs, generate)
        async with self._waiting_for(self._lock):
            if self._closed:
                # aclose() ran while this call waited for the one before it
                raise RuntimeError(f"{self!r} is closed")
            self._check_manager()  # (it may have closed while this call waited)
            async with _AdmissionTurn(self.manager, self.device, self._check_manager) as turn:
                if self._closed:
                    raise RuntimeError(f"{self!r} is closed")
                self._check_manager()
                forward = nesting.Forward(
                    self, current_task(), turn=turn, parent=nesting.NESTED_IN.get()
                )
                self._forward = forward
                try:
                    return await self._call(turn, generate, args, kwargs)
                finally:
                    forward.done = True
                    self._forward = None

    @contextlib.asynccontextmanager
    async def _waiting_for(self, lock: anyio.Lock) -> AsyncIterator[None]:
        """``async with lock`` for a call: a wait for it ends with this module's
        ``ManagerClosedError`` once the manager closes (see :func:`_acquire`)."""
        try:
            await _acquire(lock, self.manager)
        except ManagerClosedError:
            self._check_manager()  # (raises it, naming this module)
            raise
        try:
            yield
        finally:
            lock.release()

    def _check_manager(self) -> None:
        """``manager.check_thread()``, with a ``ManagerClosedError`` that names this module
        once the manager is closing or closed: the call cannot start."""
        try:
            self.manager.check_thread()
        except ManagerClosedError as error:
            raise ManagerClosedError(
                f"{self.name}: the manager closed, so this call cannot start ({error}); a "
                "streamed module runs only while its manager does (inside 'async with "
                "ResidencyManager(...)')"
            ) from error

    def _names_this_module(self, error: BaseException) -> bool:
        """Whether ``error`` is a ``ManagerClosedError`` of ours (naming this module)."""
        return isinstance(error, ManagerClosedError) and str(error).startswith(f"{self.name}: ")

    async def _call(
        self,
        turn: _AdmissionTurn,
        generate: Callable[..., Any] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """:meth:`_run` once the module's lock and the call's admission turn are held."""
        changed = self._changed_groups()
        if changed:
            await self._refresh(changed)
        self._check_budget()
        keep = self._plan_keep()
        dropped, self.kept = self.kept - keep, keep
        for index in dropped:
            self.release_replica(index)  # the budget shrank: no longer ours to keep
        stream = self._compute_stream()
        on_loop = self._sequential and generate is None
        host_wait = self.host_compute and not on_loop
        cyclic = generate is not None
        call: CallPipeline | RingCall
        if self.ring:
            call = RingCall(self, stream, host_wait=host_wait, keep=keep, cyclic=cyclic)
        else:
            call = CallPipeline(self, stream, host_wait=host_wait, keep=keep, cyclic=cyclic)
        self.current_call = call
        self.calls += 1
        try:
            if isinstance(call, RingCall):
                await call.open()
                turn.end()
            else:
                call.start()
            if on_loop:
                result = await run_sequential(self, call, stream, args, kwargs)
            else:
                fn = self.module if generate is None else generate
                result = await self._threaded.run(call, stream, fn, args, kwargs)
            if call.failures:
                raise call.failures[0]
            return result
        except Exception as error:
            if not self.manager.running and not self._names_this_module(error):
                # The manager closed under the call: whatever broke (a stream of its closed
                # backend, a lease, the manager's own ManagerClosedError, which names no
                # module), the reason is that.
                closed = ManagerClosedError(
                    f"{self.name}: the manager closed during the call ({error})"
                )
                self._raised.add(id(closed))
                raise closed from error
            self._raised.add(id(error))
            raise
        finally:
            try:
                call.finish()
            finally:
                self.current_call = None
                self._forget_gone_kept()

    def call_threadsafe(self, *args: Any, **kwargs: Any) -> Any:
        """``await self(*args, **kwargs)`` for a caller on another thread than the manager's
        event loop: blocks that thread (not the loop) until the call returns.

        From inside the forward of another streamed call in flight (its blocks, a forward
        hook, a model pool's model; a block of a plain ``nn.Sequential``, which runs on the
        simulated backend's stream thread, or on the loop on CUDA), the call is *nested* in
        that one, which cannot go on until it returned: it is refused at once
        (``RuntimeError``) when it could only wait for the outer call (see
        :meth:`_refuse_nested`), and a wait for room that only what the outer call holds
        keeps out is a ``ResidencyBudgetError`` at once, naming both; it is cancelled when
        the outer call is (``RuntimeError`` in the forward)."""
        outer = nesting.current()
        if outer is not None:
            self._refuse_nested(outer)
        try:
            bridge = self.manager.bridge
        except ManagerClosedError as error:
            raise ManagerClosedError(
                f"{self.name}: the manager closed, so this call cannot start ({error})"
            ) from error
        if bridge.on_loop():
            raise RuntimeError("call_threadsafe from the event loop's thread would deadlock")
        if outer is None or outer.bridge != bridge:
            # (a call of a manager on another loop waits for nothing of the outer call's)
            return bridge.run_async(self.__call__, *args, **kwargs)
        return bridge.run_async(self._call_nested, outer, args, kwargs)

    def _refuse_nested(self, outer: nesting.Forward, *, from_task: bool = False) -> None:
        """``RuntimeError`` for a call made from inside the forward of ``outer`` (a streamed
        call in flight, itself perhaps nested in others) that could only wait for a call it
        is nested in, which waits for it in turn: a call of the same module (calls on one
        module are serialized), of a module at a device where a call it is nested in holds
        the admission turn (a call over managed values holds it until it ends), one made on
        the event loop's thread (a plain ``nn.Sequential`` runs its blocks there on CUDA),
        or a plain ``nn.Sequential`` whose blocks would queue on the stream whose thread runs
        the outer call's block (the simulated backend). Otherwise both would wait for ever,
        the outer one even when cancelled (it waits for the thread blocked in this call).
        ``from_task``: the call is awaited in a task the outer call's forward started on the
        loop (the loop is not blocked by it)."""
        for forward in outer.chain():
            name = forward.streamed.name
            made = (
                "from inside its own call's forward"
                if forward is outer
                else f"from inside the forward of {outer.streamed.name}'s call, itself made "
                "from inside its own call's forward"
            )
            if forward.streamed is self:
                raise RuntimeError(
                    f"{self.name}: called {made}; calls on one streamed module run one at a "
                    "time, so this call would wait for ever for the call that makes it (call "
                    "the module's blocks directly inside its forward, or make the second call "
                    "after the first returned)"
                )
            if forward.holds_turn(self.manager, self.device):
                within = "" if forward is outer else f" (which {outer.streamed.name}'s is in)"
                raise RuntimeError(
                    f"{self.name}: called from inside the forward of {name}'s call in flight"
                    f"{within} at {self.device}, which holds the device's admission turn until "
                    "it returns (its blocks stream as managed values, each taking its room as "
                    "it goes), so this call would wait for ever for the call that makes it; "
                    "call it before or after that call, or stream the two as one module"
                )
        name = outer.streamed.name
        if not from_task and self.manager.running and self.manager.bridge.on_loop():
            raise RuntimeError(
                f"{self.name}: called from inside a block of {name}'s call in flight, which "
                "runs its blocks on the event loop's thread (a plain nn.Sequential): this call "
                "needs that loop, so both would wait for ever; call it before or after that "
                "call, or stream the two as one module"
            )
        if (
            outer.stream is not None
            and self._sequential
            and self.device == outer.streamed.device
            and self._compute_stream() is outer.stream
        ):
            raise RuntimeError(
                f"{self.name}: called from inside a block of {name}'s call in flight, which "
                f"runs on {self.device}'s compute stream (a plain nn.Sequential's blocks run "
                "in stream order on the simulated backend); this call's blocks would queue "
                "on that stream behind the block that waits for them, so both would wait for "
                "ever; call it before or after that call, or stream the two as one module"
            )

    async def _call_nested(
        self,
        outer: nesting.Forward,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        generate: Callable[..., Any] | None = None,
    ) -> Any:
        """A call made from inside ``outer``'s forward (:meth:`call_threadsafe`), on the
        loop in a task of its own: what the calls it is nested in hold counts as its own
        (a wait for room only they keep out is refused at once), and cancelling ``outer``
        cancels it (``RuntimeError`` to the forward, which ``outer``'s call then ends with
        its cancellation)."""
        self._check_manager()
        if outer.cancelled:
            raise RuntimeError(
                f"{self.name}: not started: {outer.streamed.name}'s call, which made it from "
                "inside its forward, was cancelled or ended"
            )
        task = current_task()
        unkeep = self.manager.add_task_keeper(nesting.keeper(outer, task, self))
        token = nesting.NESTED_IN.set(outer)
        scope = anyio.CancelScope()
        outer.nested.add(scope)
        try:
            with scope:
                return await self._run(generate, args, kwargs)
        finally:
            outer.nested.discard(scope)
            nesting.NESTED_IN.reset(token)
            unkeep()
        raise RuntimeError(
            f"{self.name}: cancelled with {outer.streamed.name}'s call, which made it from "
            "inside its forward"
        )

    def _ring_reservation(self) -> str | None:
        """The name of the ring reservation the call in flight holds at the device (``None``
        without one)."""
        call = self.current_call
        return call.reservation if isinstance(call, RingCall) else None

    # -- end

    async def aclose(self) -> None:
        """Finish releases, remove the hooks, give the module its own host tensors back, and
        discard the values (their kept device replicas with them). The streamed module cannot
        be called afterwards. The calls running or queued before it end first, as they would
        (one waiting for room, as long as its ``timeout`` allows): cancel them to stop them
        now. Cancelled while it waits for them, nothing is closed; once they ended, the close
        is carried out to the end (natively cancelled on asyncio too), then the cancellation
        is raised. Loop thread, as every call: from another thread it raises ``RuntimeError``
        and closes nothing."""
        if self._closed:
            return
        if not self.manager.running:
            self._close_after_manager()
            return
        self.manager.check_thread()
        async with self._lock:
            if self._closed:
                return  # (closed by another aclose while this one waited for the lock)
            # Cut short, the close left values registered and held that nothing would ever
            # discard (a later aclose returns at once): it finishes, shielded.
            await finish_shielded(self._close_now)

    async def _close_now(self) -> None:
        """:meth:`aclose` once the module's lock is held."""
        self._closed = True
        self._stop_offering()
        try:
            await self.drain()
            self._apply_replaced(self._check_replaced())
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
            self._close_checkpoint()

    def _close_after_manager(self) -> None:
        """``aclose()`` once the manager closed (and freed every replica): remove the hooks
        and give the module its own tensors back; nothing is left to release."""
        self._closed = True
        self._unreclaim = None  # (the closed manager asks no one any more)
        self._threaded.close()
        self._apply_replaced(self._check_replaced())
        self._restore_host_tensors()
        self._registered.clear()
        self.kept.clear()
        self._close_checkpoint()

    def _stop_offering(self) -> None:
        unreclaim, self._unreclaim = self._unreclaim, None
        if unreclaim is not None:
            unreclaim()

    def _close_checkpoint(self) -> None:
        """Close the checkpoint this module opened (one given opened is the caller's)."""
        opened, self._checkpoint = self._checkpoint, None
        if opened is not None and self._owns_checkpoint:
            opened.close()

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
        closed = self._closed or not self.manager.running
        state = "closed" if closed else ("running" if self.current_call else "idle")
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else self.host
        return (
            f"<StreamedModule {self.name!r} {len(self._groups)} blocks -> {self.device} "
            f"prefetch={self.prefetch} from {where} {state} "
            f"[{len(self.kept)} kept, {len(self.releasing)} releasing]>"
        )


def _holds_tensors(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule of it holds a parameter or buffer."""
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _check_blocks(module: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """``blocks=`` as a list, after checking it: modules of ``module`` (the same one may come
    twice, for a block run twice), none inside another (a block's tensors are one value: a
    block nested in another would be streamed twice over, into one buffer)."""
    blocks = list(blocks)
    if not blocks:
        raise ValueError("blocks= is empty: name the submodules to stream, in call order")
    names = {id(sub): name or "(the module itself)" for name, sub in module.named_modules()}
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise TypeError(f"blocks[{i}] is a {type(block).__name__}, not an nn.Module")
        if id(block) not in names:
            raise ValueError(
                f"blocks[{i}] ({type(block).__name__}) is not a submodule of the "
                f"{type(module).__name__} being streamed"
            )
        if block is module:
            raise ValueError("blocks= names the module itself: name its submodules")
    distinct = {id(b): b for b in blocks}
    for outer in distinct.values():
        for inner in outer.modules():
            if inner is not outer and id(inner) in distinct:
                raise ValueError(
                    f"blocks= names {names[id(inner)]!r} inside {names[id(outer)]!r}: blocks "
                    "must not nest (stream the outer block, or the blocks inside it)"
                )
    return blocks


def _requires_grad_at(value: Any, path: str, budget: list[int], depth: int = 0) -> str | None:
    """Where in ``value`` (tuples, lists, dicts, dataclasses, plain objects such as a Hugging
    Face cache, nested) a tensor requires grad, as ``args[0]['x']``; ``None`` if nowhere.
    Looks 8 levels deep and at ``budget[0]`` items at most (a long list of token ids is not
    walked to its end on every call)."""
    budget[0] -= 1
    if isinstance(value, torch.Tensor):
        return path if value.requires_grad else None
    if budget[0] <= 0 or depth >= 8 or isinstance(value, (str, bytes, int, float, bool)):
        return None
    items: Any
    if isinstance(value, dict):
        items = ((f"[{key!r}]", item) for key, item in value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = ((f"[{i}]", item) for i, item in enumerate(value))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f".{f.name}", getattr(value, f.name, None)) for f in dataclasses.fields(value))
    elif hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)):
        items = ((f".{key}", item) for key, item in vars(value).items())
    else:
        return None
    for suffix, item in items:
        found = _requires_grad_at(item, path + suffix, budget, depth + 1)
        if found is not None or budget[0] <= 0:
            return found
    return None


def stream_module(
    manager: ResidencyManager,
    module: nn.Module,
    device: LocationLike = "cuda:0",
    prefetch: int = 2,
    host: HostKind = "pinned-host",
    checkpoint: str | Path | Checkpoint | None = None,
    *,
    blocks: Sequence[nn.Module] | None = None,
    stream: Any = None,
    timeout: float | None = None,
    name: str | None = None,
    keep_resident: bool = True,
    ring: bool | None = None,
    checkpoint_names: CheckpointNames | None = None,
) -> StreamedModule:
    """Register ``module``'s weights with ``manager`` for streaming to ``device``.

    ``prefetch``: how many blocks ahead of the running one may be copied (the ``device`` budget
    may allow fewer). ``host``: where the weights are kept (``"pinned-host"`` for full-speed
    copies, or ``"pageable-host"``, staged through the backend's pinned buffers);
    ``checkpoint``: a safetensors checkpoint to rebuild each block from instead: a file, a
    directory of shards with its ``model.safetensors.index.json``, or that index (opened here,
    reading every shard's header on the calling thread), or a
    :class:`~aresidency.runtime.checkpoints.Checkpoint` opened already (off the loop: ``await
    anyio.to_thread.run_sync(Checkpoint.open, path)``; the caller closes it) (keys are the
    module's ``state_dict`` names; floating-point dtypes are converted to the module's, but
    for float8 and float4, which are refused (``ValueError``: their scales would be ignored);
    a parameter or persistent buffer missing there is a ``KeyError`` naming it; non-persistent
    buffers, such as a rotary embedding's ``inv_freq``, are taken from the module, recovered
    when the module is on the ``meta`` device). ``checkpoint_names``: for a checkpoint whose
    keys are not the module's state_dict names (a model's own loader renames them: transformers
    5 saves GPT-NeoX's ``lm_head.weight`` as ``embed_out.weight``), a mapping from the module's
    name to the checkpoint's (``{"lm_head.weight": "embed_out.weight"}``), or a function of the
    module's name returning the checkpoint's (``None``: the same); the ``KeyError`` for a
    missing tensor names the checkpoint's tensors of its shape the module has no name for.
    ``blocks``: the submodules to stream, in call order, a block once for each time the forward
    runs it (default: see :func:`find_blocks`). ``stream``: the compute stream (default: the
    caller's current stream at each call). ``timeout``: seconds a block may wait for budget
    before ``TimeoutError`` (``None``: as long as it takes; once admitted, the wait for its copy
    is not counted). ``name``: a non-blank string naming the module's values, ring reservations
    and errors (default: the module's class and id; ``TypeError`` or ``ValueError`` otherwise).
    ``keep_resident``: between calls, keep on the device the tensors outside the blocks and the
    blocks that fit beside the prefetch window (spread evenly over the call order), so a call
    copies only what does not fit (see :meth:`StreamedModule.residency`); needs a strict
    ``device`` budget. ``ring``: copy the streamed blocks through a ring of ``prefetch + 1``
    device buffers admitted once per call as one reservation, enqueued from the thread that runs
    the blocks (the cost of a hand-written double buffer; see
    :mod:`aresidency.integrations.streaming.ring`) instead of as managed values one by one;
    ``None`` (the default) uses it wherever it applies (weights in pinned host memory, no
    checkpoint), ``False`` never.

    Call on the manager's event loop (registration copies the weights into host memory
    synchronously: a start-up cost). ``ValueError`` if the largest block plus the tensors
    outside the blocks could never fit the ``device`` budget, or if the module (or one of its
    submodules) is streamed already, by this manager or another, and not ``aclose()``d.
    These refusals, the checkpoint's and a host budget too small for the packed weights come
    before a tensor moves: the module is left as it was.
    A call in flight when the manager closes raises ``ManagerClosedError``.
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
        ring=ring,
        checkpoint_names=checkpoint_names,
    )
