"""Feeding a training step from host memory: ``DeviceLoader`` side by side with the usual ways.

A step of tunable compute (a loop of matmuls on the batch, sized so that its compute takes about
as long as copying the batch over the link) is fed batches of 1, 16 and 64 MiB of float32. The
source is a ``Dataset`` in pageable host memory read by a ``DataLoader`` with ``--workers``
worker processes (or, for one row, shards on disk). Methods, each timed in steps per second
(GPU time from the first measured step's start to the last one's end, by CUDA events):

* ``compute``: the batch already on the GPU (the ceiling);
* ``sync .to``: ``DataLoader`` -> ``batch.to(device)`` (synchronous);
* ``pin+non_blocking``: ``DataLoader(pin_memory=True)`` -> ``.to(device, non_blocking=True)``
  (the copy on the compute stream);
* ``pin+side stream``: the same with the copy of the next batch on a side stream, one batch
  ahead, ordered by events (hand-written double buffering);
* ``aresidency``: ``DeviceLoader(manager, dataloader, prefetch=4)`` under a device budget
  (through its ring: device slots it owns, filled by its thread, no per-batch work on the loop;
  pageable batches from 4 MiB up packed into the slots' pinned twins, the default);
* ``aresidency driver staging``: the same with ``pack_min_bytes=None`` (every pageable batch
  through the CUDA driver's own staging, no twins);
* ``aresidency pinned batches``: the same fed by ``DataLoader(pin_memory=True)`` (the
  DataLoader's pin-memory thread takes the workers' batches and pins them; the ring copies
  them by DMA);
* ``aresidency values``: the same with ``ring=False`` (every batch a managed value, on the loop);
* ``aresidency shards``: ``DeviceLoader(manager, ShardSource(...))``: ``.npy`` shards written to
  a temporary directory first, read memory-mapped by the loader's threads straight into its
  pinned staging buffers.
* ``aresidency pinned shards``: the same with ``pin_source=True``: the shard files page-locked
  in place when the first pass starts (the time it took is in the log, ``page-locked ... in``;
  not in the rate, which starts after the warm-up steps) and every batch copied to the device
  straight out of them, no host copy; the files stay locked (and count in the pinned row).

* ``compute on the loop``: the compute-only steps from an async loop with the same ticker as
  the loaders' (below): the event loop's lag that the consumer's own launches cause, the
  baseline for the loaders' lag.

Also per method: GPU idle time, ``1 - steps/s / compute-only steps/s`` (the device's time not
spent on the step's own kernels), and the gaps between steps alone (between one step's last
kernel and the next one's first, by CUDA events around each step's kernels, as a share of the
measured span: it misses a step whose kernels the host launched late, which then lasts longer),
pinned host memory (aresidency: the ``pinned-host`` ledger's peak, which holds the loader's
staging reservation and the backend's staging pool; DataLoader: its pin-memory queue,
``workers x prefetch_factor + 1`` batches, estimated) and, for aresidency, the event loop's lag
p99 (a ticker task sleeping 1 ms and measuring how late it wakes) over the steps after the
warm-up ones (a ``DataLoader``'s start, with its workers starting and the loop idle and on time,
would otherwise dilute the late wakes). The ticker wakes the loop a thousand times a second,
which the alternatives (no loop) do not pay: each aresidency method runs twice, the rate, idle
time and pinned memory from a pass without the ticker, the lag from a second pass with it
(``--lag-in-the-same-pass``: one pass, the ticker running; ``--no-ticker``: no lag at all).
Batches under 16 MiB run eight times the steps, so that the measured span is about a second.
``--repeat N`` runs every method N times, in turn (A B C, A B C, ...), and gives each one's
median pass with the range of its rounds: one pass's rate moved by 10-15% between calls where
every method is bound by the ``DataLoader``'s workers.

Goals: aresidency's step rate >= every alternative at each size; with the shard source >= 0.9x
the compute-only rate at 16 and 64 MiB; GPU idle <= 2% when the copies take less than the
compute; pinned memory bounded; loop lag p99 < 1 ms.

usage: python3 benchmarks/bench_loader.py [--backend cuda|sim] [--quick] [--sizes 1,16,64]
       [--workers 4] [--json PATH] [--markdown PATH]

``--backend sim`` runs small sizes on the simulated backend (a simulation of CUDA devices in host
memory) and the baselines on the CPU: a smoke test of this script, not a measurement. The GPU run
takes about three minutes (``--quick``: about one).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import gc
import json
import math
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aresidency import ResidencyManager
from aresidency.backends.cuda import CudaBackend
from aresidency.backends.sim import SimBackend
from aresidency.core.sizes import format_nbytes
from aresidency.loader import DeviceLoader, ShardSource
from aresidency.loader import shards as shards_module

MiB = 1 << 20
ROW = 1024  # floats per row: a batch is (rows, 1024) float32
METHODS = [
    "compute",
    "compute on the loop",
    "sync .to",
    "pin+non_blocking",
    "pin+side stream",
    "aresidency",
    "aresidency pinned batches",
    "aresidency driver staging",
    "aresidency values",
    "aresidency shards",
    "aresidency pinned shards",
]
PREFETCH = 4
ONLY: set[str] = set()  # --methods: run only these (empty: all)
WAITER: list[str] = ["auto"]  # --waiter: the CUDA backend's event-waiting strategy
SHARD_WORKERS: list[int | None] = [None]  # --shard-workers (None: ShardSource's default)
DUMP_TASKS_AT: list[float] = []  # --dump-after: when to print every task's stack


PREFETCH_FACTOR: list[int] = [2]  # the DataLoader's default; --prefetch-factor


def log(message: str) -> None:
    print(f"[bench_loader {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the workload


class FloatBatches(Dataset[torch.Tensor]):
    """``count`` batches of ``numel`` float32 in pageable host memory, made in the workers: batch
    i is filled with i (cheap, and checkable)."""

    def __init__(self, count: int, numel: int) -> None:
        self.count = count
        self.numel = numel

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.empty(self.numel // ROW, ROW).fill_(float(index))


@dataclass
class Device:
    """Where the step runs: a CUDA GPU, or (``sim``) the CPU for the baselines and the simulated
    backend for aresidency."""

    sim: bool

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.sim else torch.device("cuda:0")

    def to(self, batch: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if self.sim:
            return batch.clone()  # the "copy" of the CPU run
        return batch.to(self.torch_device, non_blocking=non_blocking)

    def synchronize(self) -> None:
        if not self.sim:
            torch.cuda.synchronize()


class StepClock:
    """Marks around each step's kernels: CUDA events on the current stream (the host does not
    wait), or on the simulation host times."""

    def __init__(self, dev: Device) -> None:
        self.dev = dev
        self.starts: list[Any] = []
        self.ends: list[Any] = []

    def _mark(self) -> Any:
        if self.dev.sim:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.starts.append(self._mark())

    def end(self) -> None:
        self.ends.append(self._mark())

    def _ms(self, a: Any, b: Any) -> float:
        return (b - a) * 1e3 if self.dev.sim else float(a.elapsed_time(b))

    def summary(self, warmup: int) -> tuple[float, float]:
        """(steps per second, GPU idle %) over the steps after ``warmup`` (call after a
        synchronize)."""
        first = min(warmup, len(self.starts) - 1)
        span = self._ms(self.starts[first], self.ends[-1])
        idle = sum(
            max(0.0, self._ms(self.ends[i], self.starts[i + 1]))
            for i in range(first, len(self.starts) - 1)
        )
        steps = len(self.starts) - first
        return steps / (span / 1e3), 100.0 * idle / span


@dataclass
class Step:
    """The step's compute: ``reps`` matmuls of the batch's first rows with a 1024x1024 weight."""

    dev: Device
    reps: int
    rows: int
    weight: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.weight = torch.randn(ROW, ROW, device=self.dev.torch_device) / 32

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch[: self.rows]
        for _ in range(self.reps):
            x = torch.tanh(x @ self.weight)
        return x


COMPUTE_FACTOR: list[float] = [1.0]  # --compute-factor: the step's compute / the copy time


def calibrate(dev: Device, batch_bytes: int) -> Step:
    """A step whose compute takes about as long as copying one batch from pinned memory
    (``--compute-factor`` times as long)."""
    rows = min(batch_bytes // (ROW * 4), 4096)
    if dev.sim:
        return Step(dev, 1, min(rows, 16))
    host = torch.empty(batch_bytes // 4).pin_memory()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        start.record()
        host.to("cuda:0", non_blocking=True)
        end.record()
    torch.cuda.synchronize()
    copy_ms = start.elapsed_time(end)
    probe = Step(dev, 20, rows)
    x = torch.randn(rows, ROW, device="cuda:0")
    probe(x)
    start.record()
    probe(x)
    end.record()
    torch.cuda.synchronize()
    per_rep = start.elapsed_time(end) / 20
    reps = max(1, math.ceil(COMPUTE_FACTOR[0] * copy_ms / per_rep))
    log(f"{format_nbytes(batch_bytes)}: copy {copy_ms:.3f} ms, {reps} matmul(s) of {rows} rows")
    return Step(dev, reps, rows)


@dataclass
class Result:
    steps_per_s: float | None = None
    gpu_idle_pct: float | None = None
    pinned_bytes: int | None = None
    loop_lag_p99_ms: float | None = None
    error: str | None = None
    #: with ``--repeat``: every pass's steps per second, in the order they ran (this result is
    #: the pass with the median rate)
    rates: list[float] = field(default_factory=list)


# ---------------------------------------------------------------- the methods


def dataloader(dataset: Dataset[torch.Tensor], workers: int, pin: bool) -> DataLoader[Any]:
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=PREFETCH_FACTOR[0] if workers else None,
        persistent_workers=False,
        # Workers forked from a process that initialized CUDA crash on their first CUDA call
        # (freeing an inherited pinned tensor is one): start them from a clean server.
        multiprocessing_context="forkserver" if workers and torch.cuda.is_initialized() else None,
    )


def run_compute(dev: Device, step: Step, steps: int, warmup: int, batch_bytes: int) -> Result:
    batch = dev.to(torch.ones(batch_bytes // (ROW * 4), ROW))
    clock = StepClock(dev)
    for _ in range(steps):
        clock.start()
        step(batch)
        clock.end()
    dev.synchronize()
    rate, idle = clock.summary(warmup)
    return Result(rate, idle, 0)


async def run_compute_on_loop(
    dev: Device, step: Step, steps: int, warmup: int, batch_bytes: int
) -> Result:
    """The compute-only steps from an async loop, one checkpoint per step, with the ticker:
    the event loop's lag that the consumer alone causes (its launches; once the device is
    behind, a launch blocks when the queue is full), to read the loaders' lag against."""
    batch = dev.to(torch.ones(batch_bytes // (ROW * 4), ROW))
    clock = StepClock(dev)
    async with ticker() as lags:
        steady = math.inf
        for done in range(1, steps + 1):
            await anyio.lowlevel.checkpoint()
            clock.start()
            step(batch)
            clock.end()
            if done == warmup:
                steady = time.perf_counter()
        ended = time.perf_counter()
        await anyio.to_thread.run_sync(dev.synchronize)
    rate, idle = clock.summary(warmup)
    measured = [x for x, t in zip(lags, LAG_TIMES, strict=True) if steady <= t <= ended]
    lag = statistics.quantiles(measured, n=100)[98] * 1e3 if len(measured) >= 2 else None
    return Result(rate, idle, 0, lag)


def run_sync(dev: Device, step: Step, loader: DataLoader[Any], warmup: int) -> Result:
    clock = StepClock(dev)
    for host in loader:
        batch = dev.to(host)
        clock.start()
        step(batch)
        clock.end()
    dev.synchronize()
    rate, idle = clock.summary(warmup)
    return Result(rate, idle, 0)


def pinned_estimate(workers: int, batch_bytes: int) -> int:
    return (max(1, workers) * PREFETCH_FACTOR[0] + 1) * batch_bytes


def run_pinned(
    dev: Device, step: Step, loader: DataLoader[Any], warmup: int, workers: int, nbytes: int
) -> Result:
    clock = StepClock(dev)
    for host in loader:
        batch = dev.to(host, non_blocking=True)
        clock.start()
        step(batch)
        clock.end()
    dev.synchronize()
    rate, idle = clock.summary(warmup)
    return Result(rate, idle, pinned_estimate(workers, nbytes) if not dev.sim else 0)


def run_side_stream(
    dev: Device, step: Step, loader: DataLoader[Any], warmup: int, workers: int, nbytes: int
) -> Result:
    if dev.sim:
        return run_pinned(dev, step, loader, warmup, workers, nbytes)
    copy_stream = torch.cuda.Stream()
    compute_stream = torch.cuda.current_stream()
    clock = StepClock(dev)

    def issue(host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(copy_stream):
            batch = host.to(dev.torch_device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(copy_stream)
        return batch, ready

    iterator = iter(loader)
    ahead: tuple[torch.Tensor, Any] | None = issue(next(iterator))
    while ahead is not None:
        batch, ready = ahead
        try:
            ahead = issue(next(iterator))
        except StopIteration:
            ahead = None
        compute_stream.wait_event(ready)
        batch.record_stream(compute_stream)  # the caching allocator must not reuse it early
        clock.start()
        step(batch)
        clock.end()
    dev.synchronize()
    rate, idle = clock.summary(warmup)
    return Result(rate, idle, pinned_estimate(workers, nbytes))


@asynccontextmanager
async def ticker() -> AsyncIterator[list[float]]:
    """Measure the event loop's lag: a task sleeping 1 ms, recording how late each wake is.
    Also notes the wakes a garbage collection overlapped (``GC_LAGS``: CPython's collector
    stops every thread; the lag without them is what the loader itself caused)."""
    lags: list[float] = []
    GC_LAGS.clear()
    LAG_TIMES.clear()
    if not TICKER[0]:  # --no-ticker: the loop's lag not measured (what measuring it costs)
        yield lags
        return
    collecting: list[float] = []  # (start, end) pairs, flat

    def collections(phase: str, info: dict[str, Any]) -> None:
        collecting.append(time.perf_counter())

    async def tick() -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(0.001)
            end = time.perf_counter()
            lag = max(0.0, end - start - 0.001)
            lags.append(lag)
            LAG_TIMES.append(end)
            pauses = zip(collecting[::2], collecting[1::2])
            if any(b < end and start < e for b, e in pauses):
                GC_LAGS.append(lag)
            collecting.clear()

    gc.callbacks.append(collections)

    async def dump_tasks() -> None:
        # --dump-after: the stack of every task too (faulthandler shows only threads)
        await anyio.sleep(max(0.0, DUMP_TASKS_AT[0] - time.monotonic()))
        import asyncio

        for task in asyncio.all_tasks():
            task.print_stack(limit=12)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(tick)
        if DUMP_TASKS_AT:
            tasks.start_soon(dump_tasks)
        try:
            yield lags
        finally:
            tasks.cancel_scope.cancel()
            gc.callbacks.remove(collections)


class ThreadSampler:
    """--sample-threads: every 0.5 ms (when it gets the interpreter lock), note where each other
    thread is: which Python line of which thread runs (or sits in a call that released the
    lock) while the loop is late. Printed per run, most frequent first."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        names = {}
        while not self._stop.wait(0.0005):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                where = (
                    f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
                )
                self.counts[f"{names.get(ident, ident)}: {where}"] += 1

    def __enter__(self) -> ThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        total = sum(self.counts.values()) or 1
        for key, count in self.counts.most_common(25):
            log(f"    {100 * count / total:5.1f}%  {key}")


SAMPLE_THREADS: list[bool] = [False]
TICKER: list[bool] = [True]  # --no-ticker clears it
SEPARATE_LAG_PASS: list[bool] = [True]  # --lag-in-the-same-pass clears it
GC_LAGS: list[float] = []  # the ticker's lags that a garbage collection overlapped
LAG_TIMES: list[float] = []  # when each of the ticker's lags ended (perf_counter)


def manager_for(dev: Device, batch_bytes: int) -> ResidencyManager:
    budget = (PREFETCH + 3) * batch_bytes + 16 * MiB
    backend: Any = SimBackend() if dev.sim else CudaBackend(waiter=WAITER[0])
    return ResidencyManager(budgets={"cuda:0": budget}, backend=backend)


async def run_aresidency(
    dev: Device,
    step: Step,
    source: Any,
    warmup: int,
    steps: int,
    batch_bytes: int,
    ring: bool | None = None,
    pin_source: bool = False,
    **options: Any,
) -> Result:
    """``options``: further ``DeviceLoader`` arguments (``pack_min_bytes``: its default
    unless given)."""
    clock = StepClock(dev)
    async with manager_for(dev, batch_bytes) as m, ticker() as lags:
        async with DeviceLoader(
            m,
            source,
            "cuda:0",
            prefetch=PREFETCH,
            ring=ring,
            pin_source=pin_source,
            **options,
        ) as loader:
            done = 0
            sampler = ThreadSampler() if SAMPLE_THREADS[0] else contextlib.nullcontext()
            sampler.__enter__()
            iterating = time.perf_counter()
            steady = math.inf  # after the warm-up steps, as the rate is
            while done < steps:  # a shard source holds fewer batches: several passes
                async for batch in loader:
                    clock.start()
                    step(batch if isinstance(batch, torch.Tensor) else batch["x"])
                    clock.end()
                    done += 1
                    if done == warmup:
                        steady = time.perf_counter()
                    if done == steps:
                        break
            stats = loader.stats()
            iterated = time.perf_counter()
            sampler.__exit__(None, None, None)
        await anyio.to_thread.run_sync(dev.synchronize)
        pinned = m.snapshot().location("pinned-host").peak_bytes
    rate, idle = clock.summary(warmup)
    # The loop's lag over the same steps as the rate: a DataLoader's start (its workers
    # starting, the loop idle and on time) would otherwise dilute the late wakes.
    measured = [x for x, t in zip(lags, LAG_TIMES, strict=True) if steady <= t <= iterated]
    lag = statistics.quantiles(measured, n=100)[98] * 1e3 if len(measured) >= 2 else None
    log(f"  {stats}")
    if lags:
        slow = [x for x in lags if x > 0.001]
        in_gc = [x for x in GC_LAGS if x > 0.001]
        during = [x for x, t in zip(lags, LAG_TIMES, strict=True) if iterating <= t <= iterated]
        late = sum(x > 0.001 for x in during)
        log(
            f"  loop lag: {len(slow)} of {len(lags)} wakes over 1 ms late, {len(in_gc)} of them "
            f"during a garbage collection; worst {max(lags) * 1e3:.1f} ms; while iterating "
            f"(not opening or closing the loader): {late} of {len(during)} over 1 ms, worst "
            f"{max(during, default=0) * 1e3:.1f} ms; after the warm-up steps (the table's "
            f"p99): {sum(x > 0.001 for x in measured)} of {len(measured)} over 1 ms"
        )
    return Result(rate, idle, pinned, lag)


async def rate_then_lag(name: str, arun: Callable[[], Awaitable[Result]]) -> Result:
    """The rate, GPU idle and pinned memory from a pass without the ticker, the loop's lag from
    a second pass with it. The ticker wakes the loop a thousand times a second; the
    alternatives run without a loop and pay nothing of the kind, so it would be counted
    against aresidency alone (at 1 MiB, 722 steps/s with it against 861 without, in two runs
    on the H200)."""
    TICKER[0] = False
    try:
        rated = await arun()
    finally:
        TICKER[0] = True
    lagged = await arun()
    rate = "-" if lagged.steps_per_s is None else f"{lagged.steps_per_s:.1f}"
    log(f"  {name}, the second pass (with the ticker, for the loop's lag): {rate} steps/s")
    return replace(rated, loop_lag_p99_ms=lagged.loop_lag_p99_ms)


def write_shards(directory: Path, batches: int, batch_bytes: int) -> list[Path]:
    """``batches`` batches' worth of (rows, 1024) float32 samples in 4 ``.npy`` shards."""
    rows = batches * (batch_bytes // (ROW * 4))
    paths = []
    per = -(-rows // 4)
    for number in range(4):
        count = min(per, rows - number * per)
        if count <= 0:
            break
        path = directory / f"x-{number:03d}.npy"
        np.save(path, np.full((count, ROW), float(number), dtype=np.float32))
        paths.append(path)
    return paths


# ---------------------------------------------------------------- the run


def median_result(results: list[Result]) -> Result:
    """The pass with the median rate (the lower middle one of an even count), carrying every
    pass's rate; an error if any pass failed."""
    failed = [r for r in results if r.error or r.steps_per_s is None]
    if failed:
        return failed[0]
    ranked = sorted(results, key=lambda r: r.steps_per_s or 0.0)
    middle = ranked[(len(ranked) - 1) // 2]
    return replace(middle, rates=[r.steps_per_s or 0.0 for r in results])


async def run_size(
    dev: Device,
    mib: float,
    steps: int,
    warmup: int,
    workers: int,
    tmp: Path,
    step: Step | None = None,
) -> dict[str, Result]:
    batch_bytes = int(mib * MiB) // (ROW * 4) * (ROW * 4)
    if step is None:
        step = calibrate(dev, batch_bytes)
    dataset = FloatBatches(steps, batch_bytes // 4)
    results: dict[str, Result] = {}
    runs: dict[str, Callable[[], Any]] = {
        "compute": lambda: run_compute(dev, step, steps, warmup, batch_bytes),
        "sync .to": lambda: run_sync(dev, step, dataloader(dataset, workers, False), warmup),
        "pin+non_blocking": lambda: run_pinned(
            dev, step, dataloader(dataset, workers, not dev.sim), warmup, workers, batch_bytes
        ),
        "pin+side stream": lambda: run_side_stream(
            dev, step, dataloader(dataset, workers, not dev.sim), warmup, workers, batch_bytes
        ),
    }
    for name, run in runs.items():
        if ONLY and name not in ONLY:
            continue
        log(f"{mib} MiB: {name}")
        try:
            results[name] = run()
        except Exception as error:
            traceback.print_exc()
            results[name] = Result(error=f"{type(error).__name__}: {error}")

    async def shards(pin: bool = False) -> Result:
        shard_dir = tmp / f"{batch_bytes}B{'-pinned' if pin else ''}"
        written = shard_dir.exists()  # the second pass of rate_then_lag: the same files
        shard_dir.mkdir(exist_ok=True)
        # At most 1 GiB of files (each new pass over them starts with an empty pipeline, so
        # more batches per pass mean fewer refills; 64 MiB batches: 16 per pass).
        in_files = min(steps, max(16, (1 << 30) // batch_bytes))
        paths = (
            sorted(shard_dir.glob("x-*.npy"))
            if written
            else write_shards(shard_dir, in_files, batch_bytes)
        )
        with ShardSource(
            paths, batch_size=batch_bytes // (ROW * 4), drop_last=True, workers=SHARD_WORKERS[0]
        ) as source:
            # three times the steps: at the compute's pace a pass takes tens of milliseconds,
            # where the loader's start would weigh too much
            return await run_aresidency(
                dev, step, source, warmup, 3 * steps, batch_bytes, pin_source=pin
            )

    ours: dict[str, Callable[[], Awaitable[Result]]] = {
        "aresidency": lambda: run_aresidency(
            dev, step, dataloader(dataset, workers, False), warmup, steps, batch_bytes
        ),
        "aresidency pinned batches": lambda: run_aresidency(
            dev, step, dataloader(dataset, workers, not dev.sim), warmup, steps, batch_bytes
        ),
        "aresidency driver staging": lambda: run_aresidency(
            dev,
            step,
            dataloader(dataset, workers, False),
            warmup,
            steps,
            batch_bytes,
            pack_min_bytes=None,
        ),
        "aresidency values": lambda: run_aresidency(
            dev, step, dataloader(dataset, workers, False), warmup, steps, batch_bytes, False
        ),
        "aresidency shards": shards,
        "aresidency pinned shards": lambda: shards(pin=True),
    }
    ours["compute on the loop"] = lambda: run_compute_on_loop(
        dev, step, 3 * steps, warmup, batch_bytes
    )
    for name, arun in ours.items():
        if ONLY and name not in ONLY:
            continue
        log(f"{mib} MiB: {name}")
        try:
            if name == "compute on the loop" or not TICKER[0] or not SEPARATE_LAG_PASS[0]:
                results[name] = await arun()
            else:
                results[name] = await rate_then_lag(name, arun)
        except Exception as error:
            traceback.print_exc()
            results[name] = Result(error=f"{type(error).__name__}: {error}")
    return results


def markdown(report: dict[str, dict[str, Result]], env: str) -> str:
    lines = [f"DeviceLoader vs the usual ways, {env}.", ""]
    head = ["batch", *METHODS]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for size, results in report.items():
        compute = results.get("compute", Result()).steps_per_s

        def idle(r: Result, compute: float | None = compute) -> str:
            # The device's time not spent on the step's own kernels: 1 - rate / compute-only
            # rate. Gaps between steps alone miss a step whose kernels were launched late
            # (the host's launches, not the device, set its length).
            if not compute or r.steps_per_s is None:
                return "-"
            return f"{max(0.0, 100.0 * (1.0 - r.steps_per_s / compute)):.1f}"

        def rate(r: Result) -> str:
            if len(r.rates) < 2:
                return f"{r.steps_per_s:.1f}"
            return f"{r.steps_per_s:.1f} ({min(r.rates):.1f}-{max(r.rates):.1f})"

        for what, cell in (
            ("steps/s", rate),
            ("GPU idle %", idle),
            ("gaps between steps %", lambda r: f"{r.gpu_idle_pct:.1f}"),
            ("pinned", lambda r: format_nbytes(r.pinned_bytes or 0)),
            (
                "loop lag p99 ms",
                lambda r: "" if r.loop_lag_p99_ms is None else f"{r.loop_lag_p99_ms:.2f}",
            ),
        ):
            cells = [f"{size} {what}"]
            for method in METHODS:
                result = results.get(method, Result(error="not run"))
                cells.append(f"error: {result.error}" if result.error else cell(result))
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.extend(goals(report))
    return "\n".join(lines)


def goals(report: dict[str, dict[str, Result]]) -> list[str]:
    out = ["Goals:"]
    for size, results in report.items():
        ours = [
            results.get("aresidency"),
            results.get("aresidency shards"),
            results.get("aresidency pinned shards"),
        ]
        # like for like: the loader fed by the same DataLoader as the alternatives
        best_ours = (results.get("aresidency") or Result()).steps_per_s or 0.0
        others = [
            results[m].steps_per_s or 0.0
            for m in ("sync .to", "pin+non_blocking", "pin+side stream")
            if m in results
        ]
        compute = results.get("compute", Result()).steps_per_s or 0.0
        shards = results.get("aresidency shards", Result()).steps_per_s or 0.0
        pinned = results.get("aresidency pinned shards", Result()).steps_per_s or 0.0
        alone = results.get("compute on the loop", Result()).loop_lag_p99_ms
        baseline = "not run" if alone is None else f"{alone:.2f} ms"
        lags = [r.loop_lag_p99_ms for r in ours if r is not None and r.loop_lag_p99_ms is not None]
        lag_met = all(lag < 1.0 for lag in lags) if lags else "not measured"
        out.append(
            f"* {size}: aresidency >= every alternative: {best_ours >= max(others, default=0)}; "
            f"shards / compute = {shards / compute if compute else 0:.2f}, pinned shards / "
            f"compute = {pinned / compute if compute else 0:.2f} (goal >= 0.9 at 16 and "
            f"64 MiB); loop lag p99 < 1 ms: {lag_met} (the consumer alone, "
            f"compute on the loop: {baseline})"
        )
    return out


def environment(dev: Device) -> str:
    if dev.sim:
        return f"simulated backend (smoke test, not a measurement), torch {torch.__version__}"
    return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"


async def main(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    dev = Device(sim=args.backend == "sim")
    if args.slow_callbacks:
        import asyncio
        import logging

        logging.basicConfig(level=logging.WARNING)
        loop = asyncio.get_running_loop()
        loop.set_debug(True)
        loop.slow_callback_duration = 0.001
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
        log(f"switch interval {sys.getswitchinterval() * 1e3:.2f} ms")
    if args.sharing_strategy is not None:
        # every method's DataLoader hands its batches over this way (torch's default on Linux:
        # file_descriptor, a descriptor passed per tensor through a socket)
        torch.multiprocessing.set_sharing_strategy(args.sharing_strategy)
    log(f"sharing strategy {torch.multiprocessing.get_sharing_strategy()}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1, got {args.repeat}")
    if not dev.sim and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --backend sim for the smoke test")
    sizes = [float(s) for s in args.sizes.split(",")]
    scale = 1 / 64 if dev.sim else 1.0  # the simulation: tiny batches, a smoke test
    steps = 12 if dev.sim else (60 if args.quick else 160)
    warmup = 2 if dev.sim else 10
    env = environment(dev)
    log(env)
    report: dict[str, dict[str, Result]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_loader-") as tmp:
        for mib in sizes:
            # Small batches go fast: more of them, so that the measured span is about a
            # second at 1 MiB (a few hundred steps there were a fifth of a second, and ten
            # percent apart between two runs of the same method).
            steps_here = steps if mib >= 16 or dev.sim else steps * 8
            label = f"{mib:g} MiB"
            if dev.sim:
                label += f" (sim: {format_nbytes(int(mib * scale * MiB))})"
            # --repeat: the methods run in turn, round after round (A B C, A B C, ...), with
            # one calibrated step, so that a slow spell of the host falls on every method
            batch_bytes = int(mib * scale * MiB) // (ROW * 4) * (ROW * 4)
            step = calibrate(dev, batch_bytes)
            rounds: dict[str, list[Result]] = {}
            for round_number in range(args.repeat):
                if args.repeat > 1:
                    log(f"{label}: round {round_number + 1} of {args.repeat}")
                got = await run_size(
                    dev, mib * scale, steps_here, warmup, args.workers, Path(tmp), step
                )
                for method, result in got.items():
                    rounds.setdefault(method, []).append(result)
            report[label] = {m: median_result(rs) for m, rs in rounds.items()}
    if args.repeat > 1:
        env += f", the median of {args.repeat} rounds (their range in brackets)"
    env += f", sharing strategy {torch.multiprocessing.get_sharing_strategy()}"
    env += f", DataLoader prefetch_factor {PREFETCH_FACTOR[0]}"
    text = markdown(report, env)
    print("\n" + text, flush=True)
    data = {
        "env": env,
        "results": {s: {m: asdict(r) for m, r in res.items()} for s, res in report.items()},
    }
    return text, data


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "sim"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--sizes", default="1,16,64", help="batch sizes in MiB")
    parser.add_argument("--workers", type=int, default=4, help="DataLoader worker processes")
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)"
    )
    parser.add_argument(
        "--sharing-strategy",
        choices=["file_descriptor", "file_system"],
        default=None,
        help="torch.multiprocessing's sharing strategy for the DataLoader workers' batches",
    )
    parser.add_argument(
        "--prefetch-factor",
        type=int,
        default=2,
        help="every method's DataLoader(prefetch_factor=...): batches each worker works ahead",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of every method, in turn; the table gives each method's median pass "
        "(and the range of the rounds)",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="only these methods (comma-separated; _ for a space: aresidency_shards)",
    )
    parser.add_argument("--shard-workers", type=int, default=None, help="ShardSource workers")
    parser.add_argument(
        "--waiter",
        choices=["auto", "hybrid", "hostfunc", "poll", "blocking"],
        default="auto",
        help="the CUDA backend's event-waiting strategy",
    )
    parser.add_argument(
        "--shard-read",
        choices=["pread", "mapping"],
        default="pread",
        help="how ShardSource reads runs of samples: preadv (the default where the OS has it), "
        "or torch's copy from the file's mapping (one call, torch's own threads)",
    )
    parser.add_argument(
        "--min-piece-mib",
        type=float,
        default=None,
        help="the smallest piece ShardSource cuts a batch into (default its own: 1 MiB; a "
        "large value reads each batch in one piece)",
    )
    parser.add_argument(
        "--compute-factor",
        type=float,
        default=1.0,
        help="the step's compute time over the copy time (above 1: copies take less than the "
        "compute, the case of the GPU-idle goal)",
    )
    parser.add_argument(
        "--sample-threads", action="store_true", help="where the threads are while iterating"
    )
    parser.add_argument(
        "--no-ticker",
        action="store_true",
        help="no ticker task measuring the loop's lag (its wakes cost the loop's thread time)",
    )
    parser.add_argument(
        "--lag-in-the-same-pass",
        action="store_true",
        help="aresidency's rate and loop lag from one pass, with the ticker running (default: "
        "the rate from a pass without it, the lag from a second pass)",
    )
    parser.add_argument(
        "--slow-callbacks",
        action="store_true",
        help="asyncio debug mode: log every step of the loop that ran over 1 ms (a lag's cause)",
    )
    parser.add_argument(
        "--dump-after",
        type=float,
        default=None,
        help="print every thread's stack and exit after this many seconds (a hang's diagnosis)",
    )
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--markdown", help="write the markdown table to this path")
    arguments = parser.parse_args()
    SHARD_WORKERS[0] = arguments.shard_workers
    WAITER[0] = arguments.waiter
    # Module settings of ShardSource, for this process only (the benchmark's own variants).
    shards_module.PREAD = shards_module.PREAD and arguments.shard_read == "pread"
    if arguments.min_piece_mib is not None:
        shards_module.MIN_PIECE = int(arguments.min_piece_mib * MiB)
    COMPUTE_FACTOR[0] = arguments.compute_factor
    if arguments.prefetch_factor < 1:
        raise SystemExit(f"--prefetch-factor must be >= 1, got {arguments.prefetch_factor}")
    PREFETCH_FACTOR[0] = arguments.prefetch_factor
    SAMPLE_THREADS[0] = arguments.sample_threads
    TICKER[0] = not arguments.no_ticker
    SEPARATE_LAG_PASS[0] = not arguments.lag_in_the_same_pass
    if arguments.dump_after:
        faulthandler.dump_traceback_later(arguments.dump_after, exit=True)
        DUMP_TASKS_AT.append(time.monotonic() + max(1.0, arguments.dump_after - 5))
    if arguments.methods:
        # "_" stands for a space ("aresidency_shards"), for shells and LOADER_ARGS, in a name
        # that is not a method's as it is ("pin+non_blocking" is)
        ONLY.update(
            m if m in METHODS else m.replace("_", " ") for m in arguments.methods.split(",")
        )
        if unknown := sorted(ONLY - set(METHODS)):
            parser.error(f"--methods: no method {unknown}; the methods: {METHODS}")
    text, data = anyio.run(main, arguments)
    if arguments.markdown:
        Path(arguments.markdown).write_text(text + "\n")
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(data, indent=1, default=str))
    log("done")
