"""The pipelined data loader: the next batches already on the GPU when the step starts.

``DeviceLoader(manager, source, "cuda:0", prefetch=4)`` is an async iterator over the batches of
``source`` with every tensor already on the device when it is handed out, copied under the
manager's byte budgets, with the copies overlapped with the consumer's compute and no
``torch.cuda.synchronize``::

    async with ResidencyManager(budgets={"cuda:0": 8 << 30}) as manager:
        async with DeviceLoader(manager, dataloader, "cuda:0", prefetch=4) as loader:
            async for batch in loader:              # batch["x"] is on cuda:0
                loss = model(batch["x"], batch["y"])
                loss.backward()

Two ways through
    By default (``ring=None``) every source on a GPU goes through the **ring**
    (:mod:`~aresidency.loader.ring`): device slots the pass owns, charged as named
    reservations, filled by the loader's own thread with one ``copy_into`` per tensor, handed
    out and released with events only, so the event loop does no work per batch.
    ``ring=False`` makes every tensor of every batch a **managed value**, as
    described below step by step (the ring keeps the same order, budget, lifetimes, errors
    and cancellation; only the per-batch bookkeeping differs).

How a batch travels (managed values)
    1. *Source.* A synchronous iterable (a ``DataLoader``, a generator) is iterated in a thread
       of its own, never on the event loop; an async iterable by a task of the loader; a staged
       source (:class:`ShardSource`) by ``workers`` threads that read each batch from
       memory-mapped files straight into the loader's pinned staging buffers. The source runs
       at most ``read_ahead`` batches ahead of admission (:mod:`~aresidency.loader.feeder`).
    2. *Admission.* In source order, at most ``prefetch`` batches ahead of the consumer, and
       only when the whole batch fits the device budget now: each tensor is registered with the
       manager where it lives (``pageable-host`` or ``pinned-host``; a staged batch is one value
       whose source is its buffer) and materialized on the device with
       ``materialize_nowait``: the budget is charged at once and the copy enqueued on the
       backend's copy stream (pageable memory goes through the backend's pinned staging, pinned
       memory directly). When the budget is full (another tenant, a streamed model, batches the
       consumer keeps) the loader waits for room; it never fails for lack of it, unless one
       batch alone is larger than the whole budget: that batch then raises
       ``ResidencyBudgetError`` with the arithmetic, at its place in the order.
    3. *Hand-out.* The consumer gets the batch once its copies are issued: leases are entered
       on the consumer's stream (the device's current stream at that moment, or ``stream=``),
       which makes that stream wait for the copies *on the device*; the host never waits. Where
       compute runs on the host (the simulated backend), once the copies completed.
    4. *Release.* The leases exit, recording an event on the consumer's stream after the
       kernels the step enqueued; each value is discarded (its device memory returns to the
       budget) once the manager saw that event complete. Nothing synchronizes.

Lifetimes: when a batch is released
    * ``async for batch in loader`` (the source's own structure, with device tensors): when the
      next batch is asked for, so the step's kernels may use it freely; keep nothing of it past
      the step but ``.clone()``\\ s.
    * ``async for batch in loader.batches()`` (:class:`DeviceBatch`): at the end of
      ``async with batch as data:`` (which may span steps: the batch is then kept), at
      ``batch.release()``, or else at the next step.
    * At the source's end: every batch but those an open ``async with batch`` block keeps (a
      worker task's): each of those when its block ends, and at the latest when the loader
      closes (the next pass does not release them).
    * Always at any other end of the pass: breaking out of the loop or an exception leaving
      it (the dropped iterator ends its pass, as an async generator's finalizer would:
      scheduled on the loop, awaiting nothing), ``await loader.aclose()``, the end of
      ``async with loader``, or cancellation of the consuming task (cancellation while it
      waits for a batch ends the pass at once, as it would an async generator). Then nothing
      the loader made is leased, held, charged or registered any more; copies in flight are
      cancelled first. For a release at a point of your choosing, and waited for, use
      ``async with loader`` or ``aclose`` (the other ends do not wait; see
      :mod:`~aresidency.loader.lifetime`).
    * The manager's close ends every pass (their threads stop): the consumer, and a later
      ``aclose`` that no step reported it to, get ``ManagerClosedError``.
    * A released batch's memory leaves the budget when the device finished reading it;
      ``await loader.drain()`` waits for that.

Failures: the source's exception reaches the consumer with its own type and traceback, at the
batch where it happened, after the batches before it; the pass then ends. (A ``StopIteration``
or ``StopAsyncIteration`` the source leaks comes as a ``RuntimeError`` naming the batch, its
cause the source's exception: raised as it is, it would end the pass quietly.) A copy that fails
before its batch is handed out raises at that batch; on CUDA a copy can fail after (the batch
is handed out once its copy is issued): the next step, or ``aclose``, raises
``ResidencyUnavailableError`` for it.

Measurements: :meth:`DeviceLoader.stats` (:class:`LoaderStats`) gives batches, bytes, the time
the consumer waited and why (source, budget, copy), the source's own rate and the copies' rate,
so a user sees which side is slow.

Modules: ``loader`` (:class:`DeviceLoader`), ``ring`` (one pass through the ring),
``pipeline`` (one pass of managed values: admission, readiness, release), ``records`` (the
batches in flight), ``budget`` (admission arithmetic and its errors), ``feeder`` (reading the
source), ``fills`` (filling the staging buffers from a staged source),
``batch`` (:class:`DeviceBatch`), ``lifetime`` (ends nobody asked for: the manager's close, a
dropped iterator), ``structure`` (nested batches), ``staging`` (the pinned
staging buffers and the :class:`StagedSource` protocol), ``shards`` (:class:`ShardSource`),
``stats``. See ``docs/loader.md`` for a guide.
"""

from .batch import DeviceBatch
from .loader import DeviceLoader
from .shards import ShardSource
from .staging import StagedSource, TensorSpec
from .stats import LoaderStats

__all__ = [
    "DeviceBatch",
    "DeviceLoader",
    "LoaderStats",
    "ShardSource",
    "StagedSource",
    "TensorSpec",
]
