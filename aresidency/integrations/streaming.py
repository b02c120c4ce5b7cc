"""Layer-by-layer weight streaming: run an ``nn.Module`` whose weights do not fit a GPU budget.

``stream_module(manager, module, device="cuda:0", prefetch=2)`` packs the tensors (parameters and
buffers) of each *block* of ``module`` into one flat byte buffer and registers it with the
manager as one REPLICABLE value: either kept in host memory (``host="pinned-host"`` or
``"pageable-host"``; the module's own parameters then become views of that managed host copy, so
host memory is not doubled), or rebuilt from a safetensors checkpoint each time
(``checkpoint=path``; the module may then live on the ``meta`` device). ``await streamed(x)``
runs the module as usual while, block by block:

* the copies of the next ``prefetch`` blocks are started with
  :meth:`~aresidency.ResidencyManager.materialize_nowait` (the budget is charged at once and the
  host-to-device copy is enqueued on the manager's copy stream; the host waits for nothing), as
  far as the ``device`` budget allows, in block order;
* block ``i`` runs on the compute stream (the caller's current stream at call time, or
  ``stream=``) under a lease, which makes that stream wait *on the device* for the copy;
* when block ``i`` has been enqueued its lease exits (an event is recorded on the compute stream)
  and its GPU replica is released in the background: the release waits for that event (the
  reaper sees it complete; nothing synchronizes) and then frees the budget, which starts the next
  prefetch. The host copy stays, so nothing is ever copied back.

One block's tensors form one value, so a block costs one copy, one lease, one event and one
release whatever its number of parameters (a many-parameter block would otherwise pay per tensor
in both Python overhead and small-copy bandwidth: ANCHORS.md, 44.6 GB/s at 4 MB against 55 GB/s
for large copies). Inside the flat buffer each tensor starts on a 512-byte boundary (the CUDA
caching allocator's granularity) and keeps its strides, so kernels see the same alignment and
layout as for a tensor of its own and give bit-identical results.

Blocks are found as: the children of an ``nn.Sequential``; otherwise the ``nn.ModuleList`` of
``module`` holding the most parameter and buffer bytes (ties: the first); or ``blocks=`` given
explicitly. Tensors of ``module`` outside the blocks (embeddings, final norm, head) form one
*resident* group, materialized at the start of each call and released at its end.

How a call runs:

* ``nn.Sequential`` (no ``blocks=``): the blocks are run one after the other on the event loop,
  awaiting only when a block's weights are not admitted yet.
* any other module: ``module(*args, **kwargs)`` runs in a worker thread (one per streamed module);
  forward hooks on the blocks ask the event loop for each block's leased weights and hand the
  block back after it ran. The caller's grad mode, inference mode, autocast state and stream are
  carried into that thread.
* the simulated backend (``backend="sim"``): its ``cuda:N`` tensors live in host memory and
  blocks run on the CPU. An ``nn.Sequential``'s blocks are submitted to the simulated compute
  stream, so they run after their copies and before their releases exactly as kernels would
  (a read after release would see the simulation's poison); in the worker thread a block
  starts once its copy has landed. Leases, events and releases are the same as on a GPU.

During a call the module's parameters and buffers are replaced by the leased device tensors
(``module._parameters[name] = tensor``, the way ``torch.func.functional_call`` does it) just for
the block's forward, and put back right after, so the module never points at freed device
memory. Inference only: a call with grad mode enabled and an input that requires grad is
refused (autograd would keep the weights past their release). Calls on one streamed module are
serialized; do not run the module elsewhere while a call is in flight.

Failures and the end: a block that raises, or a cancelled call, exits every lease and releases
every replica (in the background; :meth:`StreamedModule.drain` waits for them). A failed copy
fails the call when it is known by then (always on the simulated backend, which waits for its
blocks); one still in flight when a CUDA call returns is raised by ``drain``. ``aclose`` gives
the module its own host tensors back and discards the values.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, cast

import torch
from torch import nn

from ..core.errors import ResidencyBudgetError, ResidencyError, ResidencyUnavailableError
from ..core.locations import Location, LocationLike
from ..core.state import ReplicaMode, ValueHandle
from ..runtime.leases import Hold, Lease
from ..runtime.manager import ResidencyManager
from ..runtime.sources import CallableSource

__all__ = ["StreamedModule", "find_blocks", "stream_module"]

#: Every tensor of a packed block starts on this boundary (the CUDA caching allocator rounds
#: blocks to 512 bytes), so kernels see the alignment a tensor of its own would have.
ALIGN: Final = 512

_ST_DTYPES: Final[dict[str, torch.dtype]] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride: list[int] = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(stride))


def _dense_stride(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor``'s strides if they lay it out densely without overlap (contiguous, channels-last,
    transposed...), else contiguous strides. Keeping them keeps the kernels the same."""
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    if tensor.numel() == 0:
        return _contiguous_stride(shape)
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return _contiguous_stride(shape)
        expected *= size
    return stride


# ---------------------------------------------------------------- block discovery


def _tensor_bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks streaming runs one by one: the children of an ``nn.Sequential``, else the
    ``nn.ModuleList`` inside ``module`` holding the most parameter and buffer bytes (ties: the
    first in ``named_modules`` order). ``ValueError`` if there is none: pass ``blocks=``."""
    if isinstance(module, nn.Sequential):
        return list(module)
    best: nn.ModuleList | None = None
    best_bytes = -1
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 0:
            nbytes = _tensor_bytes(sub)
            if nbytes > best_bytes:
                best, best_bytes = sub, nbytes
    if best is None:
        raise ValueError(
            f"{type(module).__name__} is not an nn.Sequential and holds no nn.ModuleList of "
            "blocks; pass blocks=[...] (the submodules to stream one at a time, in call order)"
        )
    return list(best)


# ---------------------------------------------------------------- packing


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a group: where it sits in the flat buffer and every slot that names it."""

    tensor: torch.Tensor  # the module's own Parameter or buffer object
    names: tuple[str, ...]  # qualified names in the root module (state_dict keys)
    slots: tuple[tuple[dict[str, Any], str], ...]  # (module._parameters or _buffers, attribute)
    dtype: torch.dtype
    element_size: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # bytes from the start of the flat buffer, a multiple of ALIGN
    span_bytes: int  # bytes the strided layout covers


class _Group:
    """The tensors of one block (or the resident rest) packed into one managed value.

    State: ``entries`` (the layout), ``nbytes`` (the flat buffer's size, a multiple of ALIGN),
    ``handle`` (the value), ``hold`` (keeps the host copy from being moved away while the
    module's parameters point into it), ``from_source`` (rebuilt from a checkpoint).
    """

    def __init__(self, index: int, name: str, entries: list[_Entry], nbytes: int) -> None:
        self.index = index
        self.name = name
        self.entries = entries
        self.nbytes = nbytes
        self.charge_bytes = nbytes
        self.handle: ValueHandle | None = None
        self.hold: Hold | None = None
        self.from_source = False
        self.host_flat: torch.Tensor | None = None
        self._dtypes = sorted({e.dtype for e in entries}, key=str)
        # (slot dict, attribute, entry index) flattened once: swapping is the per-call hot path.
        self._slots = [(d, attr, i) for i, e in enumerate(entries) for d, attr in e.slots]
        self._originals = [e.tensor for e in entries]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each entry's tensor as a strided view of ``flat`` (one op per tensor; no copy)."""
        typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        for dtype in self._dtypes:
            view = flat.view(dtype)
            typed[dtype] = (view, int(view.storage_offset()))
        out = []
        for e in self.entries:
            view, base = typed[e.dtype]
            out.append(view.as_strided(e.shape, e.stride, base + e.offset // e.element_size))
        return out

    def swap_in(self, tensors: Sequence[torch.Tensor]) -> None:
        for slots, attr, i in self._slots:
            slots[attr] = tensors[i]

    def restore(self) -> None:
        originals = self._originals
        for slots, attr, i in self._slots:
            slots[attr] = originals[i]

    def pack_from(self, flat: torch.Tensor, skip: Callable[[_Entry], bool] | None = None) -> None:
        """Copy the module's tensors into ``flat`` (host side, at start-up or in a load)."""
        for entry, view in zip(self.entries, self.views(flat)):
            if skip is None or not skip(entry):
                view.copy_(entry.tensor.detach())

    def __repr__(self) -> str:
        return f"<_Group {self.name!r} {len(self.entries)} tensors {self.nbytes} B>"


def _pack_layout(
    modules: Sequence[nn.Module], qualified: dict[int, list[str]], keep_strides: bool
) -> list[_Entry]:
    """Lay out the tensors held directly by ``modules`` (each module's own tables only; a tensor
    held twice, a tied weight, is laid out once and every slot naming it is kept). Strides are
    the tensor's own when ``keep_strides`` and dense, else contiguous (a checkpoint's)."""
    found: dict[int, tuple[torch.Tensor, list[str], list[tuple[dict[str, Any], str]]]] = {}
    seen_slots: set[tuple[int, str]] = set()
    for sub in modules:
        for table in (sub._parameters, sub._buffers):
            for attr, tensor in table.items():
                if tensor is None or (id(sub), attr) in seen_slots:
                    continue
                seen_slots.add((id(sub), attr))
                record = found.setdefault(id(tensor), (tensor, [], []))
                for base in qualified.get(id(sub), []):
                    record[1].append(f"{base}.{attr}" if base else attr)
                record[2].append((cast(dict[str, Any], table), attr))
    entries: list[_Entry] = []
    offset = 0
    for tensor, names, slots in found.values():
        stride = _dense_stride(tensor) if keep_strides else _contiguous_stride(tensor.shape)
        span = 0
        if tensor.numel():
            span = 1 + sum((size - 1) * st for size, st in zip(tensor.shape, stride))
        span_bytes = span * tensor.element_size()
        entries.append(
            _Entry(
                tensor=tensor,
                names=tuple(names),
                slots=tuple(slots),
                dtype=tensor.dtype,
                element_size=tensor.element_size(),
                shape=tuple(tensor.shape),
                stride=stride,
                offset=offset,
                span_bytes=span_bytes,
            )
        )
        offset = _align(offset + span_bytes)
    return entries


def _make_group(index: int, name: str, entries: list[_Entry]) -> _Group | None:
    if not entries:
        return None
    return _Group(index, name, entries, _align(entries[-1].offset + entries[-1].span_bytes))


def _collect_groups(
    root: nn.Module, blocks: Sequence[nn.Module], prefix: str, keep_strides: bool
) -> tuple[list[_Group | None], _Group | None]:
    """One group per block (``None`` for a block without tensors) and the resident group: the
    tensors of ``root``'s modules outside every block."""
    qualified: dict[int, list[str]] = {}
    for name, sub in root.named_modules(remove_duplicate=False):
        qualified.setdefault(id(sub), []).append(name)
    groups: list[_Group | None] = []
    inside: set[int] = set()
    for index, block in enumerate(blocks):
        modules = list(block.modules())
        inside.update(id(sub) for sub in modules)
        groups.append(
            _make_group(
                index, f"{prefix}.block{index}", _pack_layout(modules, qualified, keep_strides)
            )
        )
    outside = [sub for sub in root.modules() if id(sub) not in inside]
    resident = _make_group(
        len(blocks), f"{prefix}.resident", _pack_layout(outside, qualified, keep_strides)
    )
    return groups, resident


# ---------------------------------------------------------------- checkpoints


def _read_safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, header) of a safetensors file; reads only the header."""
    with open(path, "rb") as file:
        raw = file.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 << 20:
            raise ValueError(f"{path}: implausible safetensors header length {length}")
        header = json.loads(file.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return 8 + length, header


class _CheckpointBlock:
    """Loads one group's flat buffer: tensors found in the checkpoint are read straight from the
    file into their place (one copy, the GIL released by the read); the others (non-persistent
    buffers) are copied from the module's own tensors. Runs in a worker thread."""

    def __init__(
        self,
        group: _Group,
        path: Path,
        ranges: list[tuple[int, int, int]],
        from_module: list[int],
    ) -> None:
        self.group = group
        self.path = path
        self.ranges = ranges  # (offset in flat, offset in file, nbytes)
        self.from_module = set(from_module)

    def __call__(self) -> torch.Tensor:
        flat = torch.empty(self.group.nbytes, dtype=torch.uint8)
        if self.ranges:
            target = memoryview(cast(Any, flat.numpy()))
            with open(self.path, "rb", buffering=0) as file:
                for dst, src, nbytes in self.ranges:
                    file.seek(src)
                    done = 0
                    while done < nbytes:
                        got = file.readinto(target[dst + done : dst + nbytes])
                        if not got:
                            raise OSError(f"{self.path}: unexpected end of file at {src + done}")
                        done += got
        if self.from_module:
            entries = self.group.entries
            for index, view in enumerate(self.group.views(flat)):
                if index in self.from_module:
                    view.copy_(entries[index].tensor.detach())
        return flat


def _checkpoint_plan(
    group: _Group, path: Path, data_start: int, header: dict[str, Any]
) -> _CheckpointBlock:
    ranges: list[tuple[int, int, int]] = []
    from_module: list[int] = []
    for index, entry in enumerate(group.entries):
        found = next((name for name in entry.names if name in header), None)
        if found is None:
            if entry.tensor.is_meta:
                raise KeyError(
                    f"{path} has no tensor named {' or '.join(map(repr, entry.names))} and the "
                    "module's own tensor is on the meta device"
                )
            from_module.append(index)
            continue
        info = header[found]
        dtype = _ST_DTYPES.get(str(info.get("dtype")))
        shape = tuple(int(d) for d in info.get("shape", ()))
        if dtype != entry.dtype or shape != entry.shape:
            raise ValueError(
                f"{path}:{found} is {info.get('dtype')} {list(shape)}, but the module's tensor "
                f"is {entry.dtype} {list(entry.shape)}"
            )
        begin, end = (int(x) for x in info["data_offsets"])
        if end - begin != entry.span_bytes:
            raise ValueError(f"{path}:{found} holds {end - begin} B, expected {entry.span_bytes}")
        if (
            ranges
            and ranges[-1][0] + ranges[-1][2] == entry.offset
            and (ranges[-1][1] + ranges[-1][2] == data_start + begin)
        ):
            dst, src, nbytes = ranges.pop()
            ranges.append((dst, src, nbytes + end - begin))
        else:
            ranges.append((entry.offset, data_start + begin, end - begin))
    return _CheckpointBlock(group, path, ranges, from_module)


# ---------------------------------------------------------------- one call


class _Call:
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
        self.s = streamed
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
        s = self.s
        if s._resident is not None:
            yield s._resident.index
        if self.requested is not None:
            yield self.requested
        order = s._order
        ahead = s.prefetch + 1 if self.window_open else 1
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
            if index in self.s._releasing or not self._start(index):
                break  # keep block order: a later block never takes an earlier one's room

    def _fits(self, group: _Group) -> bool:
        """Whether the device budget has room for ``group`` now, counting our checkpoint loads
        in flight (a load may charge the device only once loaded). A cheap pre-check: the
        manager's own admission stays the authority."""
        ledger = self.manager._state.ledger(self.s.device)
        if ledger.budget_bytes is None:
            return True
        promised = sum(self.promised.values())
        return ledger.charged_bytes + promised + group.charge_bytes <= ledger.budget_bytes

    def _start(self, index: int) -> bool:
        group = self.s._group(index)
        assert group.handle is not None
        if not self._fits(group):
            if group.charge_bytes > (self.manager._state.ledger(self.s.device).budget_bytes or 0):
                self._fail(index, self.s._never_fits(group))
            return False
        ledger = self.manager._state.ledger(self.s.device)
        before = ledger.charged_bytes
        try:
            task = self.manager.materialize_nowait(group.handle, self.s.device)
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
        here = self.s._position.get(index, -1)
        window = set(self.s._order[here : here + self.s.prefetch + 1]) if here >= 0 else set()
        resident = self.s._resident.index if self.s._resident is not None else -1
        for other, task in list(self.started.items()):
            if other in self.leases or other in window or other in (index, resident):
                continue
            del self.started[other]
            self.s._spawn_release(other, task)

    async def _wait_started(self, index: int) -> asyncio.Task[None]:
        timeout = self.s.timeout
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
                record = self.manager.snapshot().location(self.s.device)
                raise TimeoutError(
                    f"{self.s._group(index).name} was not admitted at {self.s.device} within "
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
                f"{self.s._group(index).name} is already in use in this call (a block that "
                "calls itself?); streaming runs each block once at a time"
            )
        group = self.s._group(index)
        assert group.handle is not None
        position = self.s._position.get(index)
        if position is not None:
            self.pos = position
        self.requested = index
        try:
            while True:
                task = await self._wait_started(index)
                try:
                    lease = self.manager.acquire(group.handle, self.s.device, stream=self.stream)
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
        if not self.window_open and not self.manager._issued(group.handle, self.s.device):
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
        if self.s._resident is None or index != self.s._resident.index:
            position = self.s._position.get(index)
            if position is not None and position + 1 > self.pos:
                self.pos = position + 1
        self.s._spawn_release(index, task)
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
            self.s._spawn_release(index, task)


async def _finish_shielded(awaitable: Any) -> None:
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


async def _await_shielded(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` (a worker thread's result) to settle, whatever is cancelled."""
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(future)


# ---------------------------------------------------------------- the streamed module


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
        groups, self._resident = _collect_groups(
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
        self._groups: list[_Group] = [g for g in groups if g is not None]
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
        self._call: _Call | None = None
        self._hooks: list[Any] = []
        self._closed = False
        self._registered: list[_Group] = []
        try:
            self._register_all()
            self._check_budget()
            if not self._sequential:
                self._install_hooks()
        except BaseException:
            self._unregister_now()
            raise

    # -- set-up

    def _group(self, index: int) -> _Group:
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

    def _all_groups(self) -> list[_Group]:
        return [*self._groups, *([self._resident] if self._resident is not None else [])]

    def _register_all(self) -> None:
        manager = self.manager
        header: tuple[int, dict[str, Any]] | None = None
        if self.checkpoint is not None:
            header = _read_safetensors_header(self.checkpoint)
        repointed: set[int] = set()
        for group in self._all_groups():
            if header is not None:
                assert self.checkpoint is not None
                load = _checkpoint_plan(group, self.checkpoint, *header)
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

    def _never_fits(self, group: _Group) -> ResidencyBudgetError:
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

    def _pre_hook(self, group: _Group, module: nn.Module, args: Any) -> None:
        if self._worker_ident != threading.get_ident():
            return
        call = self._call
        assert call is not None
        loop = self.manager._loop
        assert loop is not None
        entering = call.enter(group.index, wait_copy=self._host_compute)
        tensors = asyncio.run_coroutine_threadsafe(entering, loop).result()
        group.swap_in(tensors)

    def _post_hook(self, group: _Group, module: nn.Module, args: Any, output: Any) -> None:
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
            call = _Call(self, stream)
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
                    await _finish_shielded(call.finish())
                finally:
                    self._call = None

    def _raise_copy_failure(self, call: _Call) -> None:
        """A copy of this call that already failed fails the call (its block read garbage).
        One still in flight when the call returns (CUDA) is raised by :meth:`drain`."""
        for task in call.tasks:
            if task.done() and not task.cancelled():
                error = task.exception()
                if error is not None and not isinstance(error, ResidencyBudgetError):
                    raise error

    async def _run_sequential(
        self, call: _Call, stream: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
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

        def run(block: nn.Module, group: _Group | None, tensors: list[torch.Tensor]) -> None:
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
                await _finish_shielded(backend.wait_event(backend.record_event(stream)))
        if errors:
            raise errors[0]
        return box[0]

    async def _run_threaded(
        self, call: _Call, stream: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
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
                await _await_shielded(future)
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
