"""How a streamed module's blocks are run: on the loop (an ``nn.Sequential``) or through the
module's own forward in a worker thread (anything else), and the thread-local torch state a
block run elsewhere needs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from ...runtime.shield import finish_shielded, wait_shielded
from . import nesting
from .packing import TensorGroup
from .pipeline import CallPipeline, Slot
from .ring import RingCall, RingSlot

if TYPE_CHECKING:
    from .module import StreamedModule

__all__ = ["ThreadedRunner", "TorchState", "run_sequential"]

T = TypeVar("T")


def _storage_of(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # meta, sparse...: shares nothing of ours
        return None


def storage_of(tensors: list[torch.Tensor]) -> int | None:
    """The memory a group's device tensors are views of (one flat buffer per group)."""
    return _storage_of(tensors[0]) if tensors else None


def owned(output: Any, storage: int | None) -> Any:
    """``output`` with every tensor in it that is a view of ``storage`` (a group's device
    replica or ring buffer, released or reused once the block or the call is done) replaced
    by a copy, as a plain module's output would stay valid; ``output`` itself when none is
    (the usual case: nothing is rebuilt). Looks through what ``torch.utils._pytree`` knows
    (tuples, lists, dicts, namedtuples, Hugging Face outputs)."""
    if storage is None:
        return output
    leaves = tree_leaves(output)
    if not any(isinstance(t, torch.Tensor) and _storage_of(t) == storage for t in leaves):
        return output
    return tree_map_only(
        torch.Tensor, lambda t: t.clone() if _storage_of(t) == storage else t, output
    )


@dataclass(frozen=True, slots=True)
class TorchState:
    """The caller's thread-local torch state, carried into the thread that runs the blocks."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def capture(cls) -> TorchState:
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


async def run_sequential(
    streamed: StreamedModule,
    call: CallPipeline | RingCall,
    stream: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run the children in order, enqueuing each block's work on the compute stream from
    the loop: kernels on CUDA; where compute runs on the host (the simulation) the block is
    run by the stream's worker, so it runs after its copy and before its release exactly as
    kernels would (a read after release would see the simulation's poison)."""
    if kwargs or len(args) != 1:
        raise TypeError("an nn.Sequential takes exactly one positional input")
    backend = streamed.manager.backend
    box: list[Any] = [args[0]]
    errors: list[BaseException] = []
    torch_state = TorchState.capture() if streamed.host_compute else None
    forward = streamed._forward
    if forward is not None and streamed.host_compute:
        forward.stream = stream  # (the blocks run on the stream's own thread)

    def run(block: nn.Module, group: TensorGroup | None, tensors: list[torch.Tensor]) -> None:
        if errors:
            return  # an earlier block failed: the rest of the stream's work is moot
        if group is not None:
            group.swap_in(tensors)
        try:
            with nesting.running(forward):
                if torch_state is not None:
                    with torch_state.enter():
                        box[0] = owned(block(box[0]), storage_of(tensors))
                else:
                    box[0] = owned(block(box[0]), storage_of(tensors))
        except BaseException as error:
            errors.append(error)
        finally:
            if group is not None:
                group.restore(capture=True)

    try:
        for block, group in zip(streamed.blocks, streamed.block_groups):
            if group is None:
                backend.run_in_stream_order(stream, functools.partial(run, block, None, []))
                continue
            slot = await call.take(group.index)
            tensors = slot.tensors
            assert tensors is not None
            if slot.ready_event is not None:
                backend.stream_wait(stream, slot.ready_event)
            backend.run_in_stream_order(stream, functools.partial(run, block, group, tensors))
            del tensors  # no reference may outlive the lease
            call.give_back(group.index, backend.record_event(stream))
            if errors:
                break
    except BaseException:
        if forward is not None:
            forward.cancel()  # (a block enqueued may wait for a call nested in it)
        raise
    finally:
        if streamed.host_compute:
            # The result exists once the stream ran the blocks; wait for it even when
            # cancelled, so that no block touches the module after the call returned.
            # (a native asyncio cancellation meanwhile is raised once the stream ran them)
            ran: Any
            try:
                ran = backend.record_event(stream)
            except Exception:
                if streamed.manager.running:
                    raise
                ran = None  # the manager closed its backend: its streams run nothing more
            if ran is not None:
                try:
                    await backend.wait(ran)
                except anyio.get_cancelled_exc_class():
                    # A block may wait for a call made from inside it: cancel that call, so
                    # that the block ends, then wait for the stream all the same.
                    if forward is not None:
                        forward.cancel()
                    await finish_shielded(backend.wait, ran)
                    raise
    if errors:
        raise errors[0]
    # A call cancelled while every block was ready (so it never awaited) still ends
    # cancelled: its output is dropped, as for any cancelled call.
    await anyio.lowlevel.checkpoint_if_cancelled()
    return box[0]


def _inert(*_args: Any) -> None:
    """What a streaming hook becomes in a copy of the module: nothing (the copy is not
    streamed)."""
    return None


class _Hook:
    """A block's streaming hook. A copy of the module (``copy.deepcopy``, ``torch.save`` and
    ``torch.load``) gets an inert hook in its place, not a copy of the streaming machinery
    (its locks cannot be copied or pickled), so a streamed model can be copied and saved."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert_hook, ())


def _inert_hook() -> Callable[..., None]:
    return _inert


def run_once(box: list[Callable[[], T]]) -> T:
    """The worker thread: run the one callable in ``box``, dropping every reference to it (and
    so to the tensors it holds) before returning or raising. The executor's work item keeps
    its arguments until the thread takes its next item, which is after the future completed:
    had it held the work itself, a ring slot or a replica the call used would stay allocated
    on the device for a moment after the loop freed it and reused its room."""
    work = box.pop()
    try:
        return work()
    except BaseException as error:
        # The error goes to the loop; the locals of the frames it passed through (a block's
        # weights, the call's slots) need not go with it.
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        del work


class ThreadedRunner:
    """Runs a module's own forward in one worker thread; forward hooks on its blocks take each
    block's weights from the call's pipeline and hand them back (see the pipeline module).

    The call runs in the module's own worker thread, or in the one its
    :meth:`~aresidency.integrations.streaming.module.StreamedModule.call_executor` names.

    State: ``_executor`` (the one worker thread, made on first use), ``_worker_ident`` (set
    while the worker runs a call: hooks fire only then, and only in that thread), ``_hooks``.
    """

    def __init__(self, streamed: StreamedModule) -> None:
        self.streamed = streamed
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._worker_ident: int | None = None
        self._hooks: list[Any] = []

    def install_hooks(self) -> None:
        """One pre/post hook pair per block with tensors, once for a block listed twice (it
        takes its one group each time it runs; the call's order says which run it is)."""
        streamed = self.streamed
        hooked: set[int] = set()
        for block, group in zip(streamed.blocks, streamed.block_groups):
            if group is None or id(block) in hooked:
                continue
            hooked.add(id(block))
            self._hooks.append(
                block.register_forward_pre_hook(_Hook(functools.partial(self._pre_hook, group)))
            )
            self._hooks.append(
                block.register_forward_hook(
                    _Hook(functools.partial(self._post_hook, group)), always_call=True
                )
            )

    def close(self) -> None:
        """Remove the hooks; let the worker thread go (it has no call)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def executor(self) -> concurrent.futures.Executor:
        """Where the next call runs: the executor the module's
        :meth:`~aresidency.integrations.streaming.module.StreamedModule.call_executor` names,
        else the module's own worker thread (made on first use)."""
        streamed = self.streamed
        executor = streamed.call_executor()
        if executor is not None:
            return executor
        if self._executor is None:
            # The thread gets the caller's intra-op thread count (torch.set_num_threads): a
            # new thread's BLAS sets its own up from the default on its first operation, so
            # the first forward there could split a CPU matmul otherwise, and round
            # differently, than the same forward run in the caller's thread.
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"aresidency-stream-{streamed.name}",
                initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),),
            )
        return self._executor

    async def submit(
        self,
        work: Callable[[], T],
        on_cancel: Callable[[], None] | None = None,
        pipeline: CallPipeline | None = None,
    ) -> T:
        """Run ``work()`` in :meth:`executor` and await it without blocking the loop. When the
        await is cancelled, call ``on_cancel()`` (if given), wait (shielded) until the thread
        is done with ``work``, then raise: nothing of the call outlives the await.
        ``work`` runs in a copy of the caller's context, as ``asyncio.to_thread`` runs a
        function: a context variable the caller set (a request id, a tracing span) is the
        forward's too. ``pipeline``: the call's pipeline, which the awaiting task parks in
        (see :meth:`CallPipeline.park`: it watches the manager while the pipeline waits for a
        change, so that a manager that closes then stops the call and the thread with it)."""
        context = contextvars.copy_context()
        box: list[Callable[[], T]] = [functools.partial(context.run, work)]
        future = self.executor().submit(run_once, box)
        del box
        del work  # the thread's reference is the only one: it drops it before the future ends
        done = anyio.Event()
        bridge = self.streamed.manager.bridge

        def finished() -> None:
            done.set()
            if pipeline is not None:
                pipeline.unpark()

        future.add_done_callback(lambda _: bridge.call_soon_quietly(finished))
        try:
            if pipeline is None:
                await done.wait()
            else:
                while not done.is_set():
                    await pipeline.park(done)
        except anyio.get_cancelled_exc_class():
            if on_cancel is not None:
                on_cancel()
            await wait_shielded(done)  # a second, native, cancellation does not cut it short
            raise
        return future.result()

    def run_direct(
        self,
        stream: Any,
        torch_state: TorchState,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        forward: nesting.Forward | None = None,
    ) -> tuple[Any, Any]:
        """The worker thread, for a call whose tensors are all swapped in already (no hooks
        fire: the call is not the pipeline's): run ``fn`` with the caller's torch state and
        the compute stream current; return its output and an event after its last kernel.
        ``forward``: the call, as a call made from inside it sees it (see :mod:`.nesting`)."""
        backend = self.streamed.manager.backend
        with torch_state.enter(), backend.stream_context(stream), nesting.running(forward):
            output = fn(*args, **kwargs)
            for group in self.streamed.all_groups:
                group.capture_replaced()  # (before the reader event lets the replicas go)
            return output, self._reader_event(stream)

    async def run(
        self,
        call: CallPipeline | RingCall,
        stream: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` (the module itself, or its ``generate``) in the worker
        thread; its blocks' hooks take and give back their weights through the pipeline (no
        round trip to the loop when ready). Awaits the thread; cancelling the await aborts
        the call at the next block boundary and waits (shielded) for the thread to unwind."""
        streamed = self.streamed
        resident = streamed.resident_group
        resident_slot: Slot | RingSlot | None = None
        if resident is not None:
            resident_slot = await call.take(resident.index)
            assert resident_slot.tensors is not None
            resident.swap_in(resident_slot.tensors)
        forward = streamed._forward
        try:
            work = functools.partial(
                self._work,
                call,
                stream,
                resident_slot,
                TorchState.capture(),
                forward,
                fn,
                args,
                kwargs,
            )
            # Cancelled: the worker's next block fails, and a call made from inside the
            # forward is cancelled; wait for the thread to unwind.

            def cancel() -> None:
                call.abort()
                if forward is not None:
                    forward.cancel()

            pipeline = call if isinstance(call, CallPipeline) else None
            result, event = await self.submit(work, on_cancel=cancel, pipeline=pipeline)
            if resident is not None:
                call.give_back(resident.index, event)
            return result
        finally:
            if resident is not None:
                resident.restore()

    def _work(
        self,
        call: CallPipeline | RingCall,
        stream: Any,
        resident: Slot | RingSlot | None,
        torch_state: TorchState,
        forward: nesting.Forward | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Any]:
        """The worker thread: run ``fn`` with the caller's thread-local torch state and the
        compute stream current (marked as running ``forward``: see :mod:`.nesting`); return
        its output and an event after its last kernel."""
        streamed = self.streamed
        backend = streamed.manager.backend
        with torch_state.enter(), backend.stream_context(stream), nesting.running(forward):
            self._worker_ident = threading.get_ident()
            try:
                if resident is not None and resident.ready_event is not None:
                    backend.stream_wait(stream, resident.ready_event)
                output = fn(*args, **kwargs)
                if resident is not None and resident.tensors is not None:
                    # (the blocks' outputs were made the caller's own by their hooks)
                    output = owned(output, storage_of(resident.tensors))
                    # what the forward put in place of the resident tensors, read before the
                    # reader event lets their replica go
                    assert streamed.resident_group is not None
                    streamed.resident_group.restore(capture=True)
                return output, self._reader_event(stream)
            finally:
                self._worker_ident = None
                for group in streamed.groups:
                    group.restore()

    def _reader_event(self, stream: Any) -> Any:
        """An event after the work this thread enqueued (compute on the host: done now)."""
        streamed = self.streamed
        return streamed.manager.backend.record_event(None if streamed.host_compute else stream)

    # -- hooks (worker thread)

    def _pre_hook(self, group: TensorGroup, module: nn.Module, args: Any) -> None:
        if self._worker_ident != threading.get_ident():
            return
        call = self.streamed.current_call
        assert call is not None
        slot = call.take_blocking(group.index)
        if slot.ready_event is not None and not self.streamed.host_compute:
            self.streamed.manager.backend.stream_wait(call.stream, slot.ready_event)
        tensors = slot.tensors
        assert tensors is not None
        group.swap_in(tensors)

    def _post_hook(self, group: TensorGroup, module: nn.Module, args: Any, output: Any) -> Any:
        # Also called when the block (or its pre-hook) raised: give back only what was taken.
        if self._worker_ident != threading.get_ident():
            return None
        storage = group.swapped_storage()
        group.restore(capture=True)
        call = self.streamed.current_call
        assert call is not None
        if group.index not in call.taken:
            return None
        # An output that is a view of the block's weights or buffers outlives the replica:
        # a copy of it (enqueued before the reader event, which then covers the copy too).
        mine = owned(output, storage)
        call.give_back_threadsafe(group.index, call.reader_event(call.stream, group.index))
        return None if mine is output else mine
