"""Copy bandwidth and event wake-up, aresidency's CUDA backend beside plain torch, one run.

Needs a CUDA GPU. Prints plain-text tables and a markdown block for benchmarks/RESULTS.md.

Copies: GB/s = bytes moved / wall time from issuing to the host knowing the data arrived,
median of 8 (after one warm-up). Plain torch is timed with ``torch.cuda.synchronize()``; the
backend from ``copy()`` to ``await transfer.wait()`` on a running asyncio loop, destination
allocation included (as ``.to()`` includes it); the manager with one task per copy calling
``await manager.materialize`` (registered values; a single copy is awaited directly, as the
backend's is, without a task group around it), and, for several copies at once, with one
plan for all of them (``await manager.execute(ResidencyPlan(enter=[Materialize(...), ...]))``:
the runtime's admission, plan and commit once per plan, not per copy). The reference figures
of docs/performance.md are shown beside them.

Wake-up: a ~2 ms ``torch.cuda._sleep`` kernel, then an event; each strategy awaits it on the
loop. ``wake us`` = median(launch -> task resumed) - median(launch -> completion seen by a
thread spinning on ``query()``); ``CPU %`` = process CPU time / wall time over the waits
(100 = one core busy), and above the baseline row's (the loop itself blocked in
``synchronize()``: the harness's own launches, records and one wake-up per wait); ``lag p99``
= 99th percentile delay between a helper thread's ``call_soon_threadsafe`` (every 0.5 ms) and
the callback running on the loop, while waiting.

usage: python benchmarks/bench_copy.py [--quick | --staging-only] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aresidency.backends import CudaBackend, EventWaiter, PinnedAllocator, hostfunc_available
from aresidency.core.locations import Location
from aresidency.core.plans import Materialize, ResidencyPlan
from aresidency.core.values import ReplicaMode

MB = 1 << 20
SIZES = {"4 MB": 4 * MB, "64 MB": 64 * MB, "256 MB": 256 * MB, "1 GB": 1024 * MB}
ANCHORS: dict[str, dict[str, float]] = {
    "pinned -> cuda": {"4 MB": 44.6, "64 MB": 55.1, "256 MB": 55.4, "1 GB": 55.5},
    "cuda -> pinned": {"4 MB": 49.0, "64 MB": 55.1, "256 MB": 55.3, "1 GB": 55.4},
    "pageable -> cuda": {"4 MB": 13.1, "64 MB": 12.3, "256 MB": 9.0, "1 GB": 9.1},
    "cuda -> pageable": {"4 MB": 13.3, "64 MB": 17.1, "256 MB": 16.3, "1 GB": 17.0},
    "both directions": {"1 GB": 101.4},
    "cuda:0 -> cuda:1": {"1 GB": 382.0},
}
ITERS = 8
BASELINE = "(baseline) the loop itself blocked in synchronize() of a blocking-sync event"
PAGEABLE, PINNED, CUDA0 = (Location.parse(x) for x in ("pageable-host", "pinned-host", "cuda:0"))


def host_data(n: int) -> torch.Tensor:
    """``n`` pageable bytes of a repeated random 1 MB block (fast to make for 1 GB)."""
    block = torch.randint(0, 255, (MB,), dtype=torch.uint8)
    return block.repeat(-(-n // MB))[:n].clone()


def median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def time_sync(fn: Callable[[], Any], iters: int = ITERS) -> list[float]:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
        del result
    return out


async def time_async(fn: Callable[[], Awaitable[Any]], iters: int = ITERS) -> list[float]:
    await fn()
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


def backend_copy(backend: CudaBackend, src: torch.Tensor, a: Location, b: Location):
    async def run() -> None:
        transfer = backend.copy(src, a, b)
        await transfer.wait()
        backend.free(transfer.tensor, b)

    return run


# ---------------------------------------------------------------------------- copies

# (path, source location, destination location); "fresh" destinations are allocated per copy.
PATHS = [
    ("pinned -> cuda", "pinned-host", "cuda:0"),
    ("cuda -> pinned (fresh destination)", "cuda:0", "pinned-host"),
    ("pageable -> cuda", "pageable-host", "cuda:0"),
    ("cuda -> pageable", "cuda:0", "pageable-host"),
]
ANCHOR_OF = {
    "pinned -> cuda": "pinned -> cuda",
    "cuda -> pinned (fresh destination)": "cuda -> pinned",
    "pageable -> cuda": "pageable -> cuda",
    "cuda -> pageable": "cuda -> pageable",
}
HOST_BYTES_IN_FLIGHT = 4 << 30  # 64 concurrent copies, at most 4 GB of sources in flight


def concurrency_for(n: int) -> int:
    return max(1, min(64, HOST_BYTES_IN_FLIGHT // n))


def make_sources(loc: str, n: int, count: int) -> list[torch.Tensor]:
    block = host_data(n)
    if loc == "cuda:0":
        first = block.to("cuda:0")
        return [first] + [first.clone() for _ in range(count - 1)]
    if loc == "pinned-host":
        return [block.pin_memory() for _ in range(count)]
    return [block] + [block.clone() for _ in range(count - 1)]


def torch_copies(srcs: list[torch.Tensor], dst: str) -> Callable[[], Any]:
    """What plain torch code does: non-blocking copies on one side stream where it can."""
    stream = torch.cuda.Stream()

    def run() -> Any:
        if dst == "cuda:0":
            with torch.cuda.stream(stream):
                outs = [s.to("cuda:0", non_blocking=True) for s in srcs]
            stream.synchronize()
        elif dst == "pinned-host":
            with torch.cuda.stream(stream):
                outs = []
                for s in srcs:
                    out = torch.empty(s.shape, dtype=s.dtype, pin_memory=True)
                    out.copy_(s, non_blocking=True)
                    outs.append(out)
            stream.synchronize()
        else:
            outs = [s.cpu() for s in srcs]
        return outs

    return run


def backend_copies(
    backend: CudaBackend, srcs: list[torch.Tensor], src: str, dst: str
) -> Callable[[], Awaitable[None]]:
    a, b = Location.parse(src), Location.parse(dst)

    async def run() -> None:
        transfers = [backend.copy(s, a, b) for s in srcs]
        for t in transfers:
            await t.wait()
        for t in transfers:
            backend.free(t.tensor, b)

    return run


def manager_copies(m: Any, handles: list[Any], dst: str) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        async with anyio.create_task_group() as tasks:
            for h in handles:
                tasks.start_soon(m.materialize, h, dst)
        # not timed separately: dropping the copies is part of the next iteration's setup
        async with anyio.create_task_group() as tasks:
            for h in handles:
                tasks.start_soon(m.release, h, dst)

    return run


async def time_async_split(
    fn: Callable[[], Awaitable[Any]], timed_part: Callable[[], Awaitable[Any]], iters: int
) -> list[float]:
    """Time ``timed_part`` (the copies), after a full warm-up of ``fn``."""
    await fn()
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        await timed_part()
        out.append(time.perf_counter() - t0)
    return out


async def bench_copies(
    sizes: dict[str, int], rows: list[dict[str, Any]], staging_only: bool = False
) -> None:
    from aresidency import ResidencyManager
    from aresidency.backends.streamcopy import streaming_memmove, streaming_memmove_status

    streaming_memmove()  # built now, not inside the first timed copy
    print(f"streaming host copy (device-to-host lane): {streaming_memmove_status()}")
    backend = CudaBackend()
    backend.start()
    manager_backend = CudaBackend()
    try:
        async with ResidencyManager(backend=manager_backend) as m:
            for label, n in sizes.items():
                for conc in (1,) if staging_only else (1, concurrency_for(n)):
                    for path, src, dst in PATHS:
                        if staging_only and "pageable" not in path:
                            continue
                        try:
                            await bench_cell(backend, m, path, src, dst, label, n, conc, rows)
                        except Exception:
                            traceback.print_exc()
                        gc.collect()
                        torch.cuda.empty_cache()
            n = sizes.get("1 GB", max(sizes.values()))
            label = next(k for k, v in sizes.items() if v == n)
            sections = [bench_both_directions(backend, n, label, rows)]
            sections.append(bench_staging_configs(n, label, rows))
            if torch.cuda.device_count() >= 2:
                sections.append(bench_peer(backend, m, n, label, rows))
            for section in sections:
                try:
                    await section
                except Exception:
                    traceback.print_exc()
            print(f"  waiter: {backend.waiter!r} {backend.waiter.degraded or ''}", flush=True)
            print(f"  loop-polled completions: {backend.waiter.loop_hits}", flush=True)
            print(f"  manager backend: {manager_backend!r}", flush=True)
            for name, b in (("backend", backend), ("manager backend", manager_backend)):
                print(f"  {name}'s pageable cache: {b.pageable_cache!r}", flush=True)
    finally:
        await backend.aclose()


async def bench_cell(
    backend: CudaBackend,
    m: Any,
    path: str,
    src: str,
    dst: str,
    label: str,
    n: int,
    conc: int,
    rows: list[dict[str, Any]],
) -> None:
    srcs = make_sources(src, n, conc)
    iters = ITERS if n * conc <= (1 << 30) else 3
    raw = time_sync(torch_copies(srcs, dst), iters)
    ours = await time_async(backend_copies(backend, srcs, src, dst), iters)
    handles = [m.register(s, None, ReplicaMode.REPLICABLE, location=src) for s in srcs]

    async def materialize_all() -> None:
        if len(handles) == 1:  # one copy: awaited where it is asked for, as the backend's is
            await m.materialize(handles[0], dst)
            return
        async with anyio.create_task_group() as tasks:
            for h in handles:
                tasks.start_soon(m.materialize, h, dst)

    async def release_all() -> None:
        if len(handles) == 1:
            await m.release(handles[0], dst)
            return
        async with anyio.create_task_group() as tasks:
            for h in handles:
                tasks.start_soon(m.release, h, dst)

    async def materialize_in_one_plan() -> None:
        await m.execute(ResidencyPlan(enter=[Materialize(h, dst) for h in handles]))

    async def timed(materialize: Callable[[], Awaitable[None]]) -> list[float]:
        """Seconds per round of ``materialize`` (after one warm-up), releasing after each."""
        out = []
        for i in range(iters + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await materialize()
            if i:
                out.append(time.perf_counter() - t0)
            await release_all()
        return out

    managed = await timed(materialize_all)
    in_one_plan = await timed(materialize_in_one_plan) if conc > 1 else []
    for h in handles:
        await m.discard(h)
    total = n * conc
    row = {
        "path": path,
        "size": label,
        "concurrent": conc,
        "torch": median_gbps(total, raw),
        "ours": median_gbps(total, ours),
        "manager": median_gbps(total, managed),
        "one_plan": median_gbps(total, in_one_plan) if in_one_plan else None,
        "anchor": ANCHORS.get(ANCHOR_OF[path], {}).get(label) if conc == 1 else None,
        "note": "",
    }
    rows.append(row)
    print(
        f"  {path:36s} {label:>6s} x{conc:<3d} torch {fmt(row['torch'])}  backend "
        f"{fmt(row['ours'])}  manager {fmt(row['manager'])}  one plan {fmt(row['one_plan'])}  "
        f"anchor {fmt(row['anchor'])}",
        flush=True,
    )


async def bench_both_directions(
    backend: CudaBackend, n: int, label: str, rows: list[dict[str, Any]]
) -> None:
    dev = torch.device("cuda", 0)
    pageable = host_data(n)
    pinned = pageable.pin_memory()
    on_dev = pageable.to(dev)
    dst_dev = torch.empty_like(on_dev)
    dst_pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def raw() -> None:
        with torch.cuda.stream(s1):
            dst_dev.copy_(pinned, non_blocking=True)
        with torch.cuda.stream(s2):
            dst_pinned.copy_(on_dev, non_blocking=True)

    def pair(up_src: torch.Tensor, up_loc: Location, down_loc: Location):
        async def run() -> None:
            up = backend.copy(up_src, up_loc, CUDA0)
            down = backend.copy(on_dev, CUDA0, down_loc)
            await up.wait()
            await down.wait()
            backend.free(up.tensor, CUDA0)
            backend.free(down.tensor, down_loc)

        return run

    raw_s = time_sync(raw)
    pinned_s = await time_async(pair(pinned, PINNED, PINNED))
    staged_s = await time_async(pair(pageable, PAGEABLE, PAGEABLE))
    for path, t, o, note in (
        ("both directions, pinned", raw_s, pinned_s, "torch: pinned both ways, two streams"),
        ("both directions, pageable", raw_s, staged_s, "aresidency: both staging lanes"),
    ):
        rows.append(
            {
                "path": path,
                "size": label,
                "concurrent": 2,
                "torch": 2 * n / statistics.median(t) / 1e9,
                "ours": 2 * n / statistics.median(o) / 1e9,
                "manager": None,
                "anchor": ANCHORS["both directions"].get(label),
                "note": note + " (GB/s total)",
            }
        )
        r = rows[-1]
        print(f"  {path:36s} {label:>6s}  torch {fmt(r['torch'])}  backend {fmt(r['ours'])}")


async def bench_staging_configs(n: int, label: str, rows: list[dict[str, Any]]) -> None:
    pageable = host_data(n)
    on_dev = pageable.to("cuda:0")
    variants: list[tuple[str, dict[str, Any]]] = [
        (
            "3 x 32 MB, 1 memcpy thread, torch.empty dst",
            dict(staging_memcpy_threads=1, pageable_mmap_bytes=None),
        ),
        (
            "3 x 32 MB, 8 memcpy threads, torch.empty dst",
            dict(staging_memcpy_threads=8, pageable_mmap_bytes=None),
        ),
        ("3 x 32 MB, 8 memcpy threads, huge-page dst", dict(staging_memcpy_threads=8)),
        (
            "3 x 32 MB, 8 memcpy threads, huge-page dst, plain memmove",
            dict(staging_memcpy_threads=8, staging_streaming_stores=False),
        ),
        ("3 x 32 MB, 16 memcpy threads, huge-page dst", dict(staging_memcpy_threads=16)),
        (
            "3 x 64 MB, 16 memcpy threads, huge-page dst",
            dict(staging_chunk_bytes=64 * MB, staging_memcpy_threads=16),
        ),
        (
            "3 x 64 MB, 16 memcpy threads, huge-page dst, plain memmove",
            dict(
                staging_chunk_bytes=64 * MB,
                staging_memcpy_threads=16,
                staging_streaming_stores=False,
            ),
        ),
        (
            "4 x 32 MB, 8 memcpy threads, huge-page dst",
            dict(staging_buffers=4, staging_memcpy_threads=8),
        ),
        (
            "4 x 32 MB, 4 memcpy threads, huge-page dst",
            dict(staging_buffers=4, staging_memcpy_threads=4),
        ),
        (
            "6 x 16 MB, 8 memcpy threads, huge-page dst",
            dict(staging_buffers=6, staging_chunk_bytes=16 * MB, staging_memcpy_threads=8),
        ),
        ("2 x 32 MB", dict(staging_buffers=2)),
    ]
    for name, kwargs in variants:
        b = CudaBackend(**kwargs)
        b.start()
        try:
            up = await time_async(backend_copies(b, [pageable], "pageable-host", "cuda:0"), iters=5)
            down = await time_async(backend_copies(b, [on_dev], "cuda:0", "pageable-host"), iters=5)

            async def both(b: CudaBackend = b) -> None:
                transfers = [
                    b.copy(pageable, PAGEABLE, CUDA0),
                    b.copy(on_dev, CUDA0, PAGEABLE),
                ]
                for t in transfers:
                    await t.wait()
                b.free(transfers[0].tensor, CUDA0)
                b.free(transfers[1].tensor, PAGEABLE)

            both_ways = await time_async(both, iters=5)
        finally:
            await b.aclose()
        for path, t, moved in (
            ("pageable -> cuda", up, n),
            ("cuda -> pageable", down, n),
            ("both directions, pageable (total)", both_ways, 2 * n),
        ):
            rows.append(
                {
                    "path": f"{path} [{name}]",
                    "size": label,
                    "concurrent": 2 if moved > n else 1,
                    "torch": None,
                    "ours": median_gbps(moved, t),
                    "manager": None,
                    "anchor": None,
                    "note": "staging variant, median of 5",
                }
            )
            r = rows[-1]
            print(f"  {r['path']:70s} {label:>6s}  backend {fmt(r['ours'])}", flush=True)


async def bench_peer(
    backend: CudaBackend, m: Any, n: int, label: str, rows: list[dict[str, Any]]
) -> None:
    src = host_data(n).to("cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    raw = time_sync(lambda: dst.copy_(src, non_blocking=True))
    ours = await time_async(backend_copies(backend, [src], "cuda:0", "cuda:1"))
    h = m.register(src, None, ReplicaMode.REPLICABLE, location="cuda:0")
    managed = []
    for i in range(ITERS + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        await m.materialize(h, "cuda:1")
        if i:
            managed.append(time.perf_counter() - t0)
        await m.release(h, "cuda:1")
    await m.discard(h)
    rows.append(
        {
            "path": "cuda:0 -> cuda:1",
            "size": label,
            "concurrent": 1,
            "torch": median_gbps(n, raw),
            "ours": median_gbps(n, ours),
            "manager": median_gbps(n, managed),
            "anchor": ANCHORS["cuda:0 -> cuda:1"].get(label),
            "note": "peer streams",
        }
    )
    r = rows[-1]
    print(
        f"  cuda:0 -> cuda:1 {label} torch {fmt(r['torch'])} backend {fmt(r['ours'])}"
        f" manager {fmt(r['manager'])}"
    )


# ---------------------------------------------------------------------------- wake-up


def sleep_cycles_for(ms: float) -> int:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


class LagProbe:
    """A helper thread posts a callback to the loop every 0.5 ms; records the delay."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lags: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _record(self, t0: float) -> None:
        self.lags.append(time.perf_counter() - t0)

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self.loop.call_soon_threadsafe(self._record, time.perf_counter())

    def __enter__(self) -> LagProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def thread_cpu(threads: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) of each named native thread of this process (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, tid in threads.items():
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def bench_wakeup(rows: list[dict[str, Any]], waits: int) -> None:
    short, long = sleep_cycles_for(2.0), sleep_cycles_for(20.0)
    stream = torch.cuda.Stream()
    loop = asyncio.get_running_loop()

    def launch(
        event: Any, record: Callable[[], Any] | None, cycles: int = short
    ) -> tuple[Any, float]:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        if record is not None:
            event = record()
        else:
            event.record(stream)
        return event, time.perf_counter()

    # Reference: when does a thread spinning on query() see completion?
    ref = []
    for _ in range(30):
        event, t0 = launch(torch.cuda.Event(), None)
        while not event.query():
            pass
        ref.append(time.perf_counter() - t0)
    reference = statistics.median(ref)

    async def poll(interval: float, event: Any) -> None:
        while True:
            if event.query():
                return
            await asyncio.sleep(interval)

    async def to_thread(event: Any) -> None:
        await loop.run_in_executor(None, event.synchronize)

    async def blocked(event: Any) -> None:
        event.synchronize()  # the loop itself sleeps in the driver: no waiting strategy at all
        await asyncio.sleep(0)  # then lets the loop run once, as every awaited wait does

    strategies: list[tuple[str, Callable[[], Any], Callable[[Any], Awaitable[None]], Any]] = [
        (
            BASELINE,
            lambda: torch.cuda.Event(blocking=True),
            blocked,
            None,
        ),
        ("poll asyncio.sleep(0)", torch.cuda.Event, lambda e: poll(0, e), None),
        ("poll every 100 us", torch.cuda.Event, lambda e: poll(1e-4, e), None),
        (
            "thread in event.synchronize() (blocking-sync event)",
            lambda: torch.cuda.Event(blocking=True),
            to_thread,
            None,
        ),
    ]
    waiters: list[CudaBackend] = []
    choices: list[tuple[str, Any]] = [
        (
            "hybrid (default: the loop's timed polls from 2% + 40 us before the predicted end, "
            "every 20 us; hostfunc fallback)",
            "hybrid",
        ),
        (
            "hybrid, loop_timer=False: the thread's 40 us polls from 8% + 60 us before",
            EventWaiter("hybrid", loop_timer=False),
        ),
        (
            "hybrid, the loop's timed polls every 40 us",
            EventWaiter("hybrid", timer_poll_s=40e-6),
        ),
        ("hostfunc only", "hostfunc"),
        ("poll thread (50 us .. 1 ms backoff)", "poll"),
        ("blocking-sync thread", "blocking"),
    ]
    for label, spec in choices:
        if spec in ("hybrid", "hostfunc") and not hostfunc_available():
            continue
        try:
            b = CudaBackend(waiter=spec, staging_chunk_bytes=MB, staging_buffers=1)
        except RuntimeError:
            continue
        b.start()
        waiters.append(b)
        strategies.append((f"aresidency waiter: {label}", lambda: None, b.wait_event, b))

    # Warm every strategy up first (thread start, driver and module loading, first notify
    # stream): the first one measured used to carry those costs. The default is measured again
    # last, so that an order effect would show as two different rows.
    for _name, make, wait, b in strategies:
        record = (lambda b=b: b.record_event(stream)) if b is not None else None
        for _ in range(20):
            event, _t0 = launch(make(), record)
            await wait(event)
    defaults = [s for s in strategies if s[0].startswith("aresidency waiter: hybrid (default")]
    strategies += [(f"{s[0]} [again, last]", *s[1:]) for s in defaults]

    for name, make, wait, b in strategies:
        record = (lambda b=b: b.record_event(stream)) if b is not None else None
        lat: list[float] = []
        gc.disable()
        waiter_thread = b.waiter._thread if b is not None else None
        threads = {"loop": threading.get_native_id()}
        cpu0, wall0 = time.process_time(), time.perf_counter()
        per0 = thread_cpu(threads)
        waiter0 = None
        for i in range(waits):
            event, t0 = launch(make(), record)
            await wait(event)
            lat.append(time.perf_counter() - t0)
            if i == 0 and b is not None and b.waiter._thread is not None:
                threads["waiter"] = b.waiter._thread.native_id or 0
                waiter0 = thread_cpu(threads).get("waiter")
        wall = time.perf_counter() - wall0
        cpu_short = (time.process_time() - cpu0) / wall * 100
        per1 = thread_cpu(threads)
        loop_cpu = (per1["loop"] - per0["loop"]) / wall * 100
        waiter_cpu = (
            (per1["waiter"] - waiter0) / wall * 100
            if waiter0 is not None and "waiter" in per1
            else None
        )
        del waiter_thread
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(10):
            event, _t0 = launch(make(), record, long)
            await wait(event)
        cpu_long = (time.process_time() - cpu0) / (time.perf_counter() - wall0) * 100
        with LagProbe(loop) as probe:
            for _ in range(waits):
                event, _t0 = launch(make(), record)
                await wait(event)
        gc.enable()
        wake = sorted(x - reference for x in lat)
        rows.append(
            {
                "strategy": name,
                "wake_us_median": statistics.median(wake) * 1e6,
                "wake_us_p90": wake[int(0.9 * len(wake))] * 1e6,
                "cpu_percent": cpu_short,
                "cpu_loop_percent": loop_cpu,
                "cpu_waiter_percent": waiter_cpu,
                "cpu_percent_20ms": cpu_long,
                "lag_p99_ms": p99(probe.lags) * 1e3,
                "lag_median_ms": statistics.median(probe.lags) * 1e3 if probe.lags else None,
            }
        )
        r = rows[-1]
        print(
            f"  {name:62s} wake {r['wake_us_median']:7.1f} us (p90 {r['wake_us_p90']:7.1f})"
            f"  CPU {cpu_short:5.1f} % (loop {loop_cpu:5.1f}, waiter {fmt(waiter_cpu)}) / "
            f"{cpu_long:5.1f} %  lag p99 {r['lag_p99_ms']:6.3f} ms",
            flush=True,
        )
    # The idle loop's own lag, for reference.
    with LagProbe(loop) as probe:
        await asyncio.sleep(0.3)
    rows.append(
        {
            "strategy": "(idle loop, no waiting)",
            "wake_us_median": None,
            "wake_us_p90": None,
            "cpu_percent": None,
            "cpu_percent_20ms": None,
            "lag_p99_ms": p99(probe.lags) * 1e3,
            "lag_median_ms": statistics.median(probe.lags) * 1e3,
        }
    )
    print(f"  idle loop lag p99 {rows[-1]['lag_p99_ms']:.3f} ms")
    base = next((r for r in rows if r["strategy"] == BASELINE), None)
    for r in rows:
        if base is not None and r["cpu_percent"] is not None:
            r["cpu_over_baseline"] = r["cpu_percent"] - base["cpu_percent"]
    for b in waiters:
        await b.aclose()


def bench_pinned_alloc(rows: list[dict[str, Any]]) -> None:
    """What one exactly-sized pinned allocation costs, beside torch's first pin_memory."""
    empty_cache = getattr(torch._C, "_host_emptyCache", None)
    for label in ("64 MB", "256 MB", "1 GB"):
        n = SIZES[label]
        for name, make in (
            ("exact: mmap + prefault + cudaHostRegister", PinnedAllocator(prefault=True)),
            ("exact: mmap + cudaHostRegister", PinnedAllocator(prefault=False)),
            ("torch pin_memory, empty cache (cudaHostAlloc)", None),
        ):
            alloc_s, free_s = [], []
            for _ in range(3):
                if make is None:
                    if empty_cache is not None:
                        empty_cache()
                    t0 = time.perf_counter()
                    t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                    alloc_s.append(time.perf_counter() - t0)
                    del t
                    continue
                t0 = time.perf_counter()
                t = make.empty((n,), torch.uint8)
                alloc_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                make.release(t)
                free_s.append(time.perf_counter() - t0)
                del t
            timings = dict(make.timings) if make is not None else {}
            rows.append(
                {
                    "what": name,
                    "size": label,
                    "alloc_ms": statistics.median(alloc_s) * 1e3,
                    "free_ms": statistics.median(free_s) * 1e3 if free_s else None,
                    "timings": timings,
                }
            )
            r = rows[-1]
            print(
                f"  {name:48s} {label:>6s} alloc {r['alloc_ms']:8.1f} ms  "
                f"free {fmt(r['free_ms'])} ms  {timings}",
                flush=True,
            )


# ---------------------------------------------------------------------------- output


def fmt(x: float | None, spec: str = "6.1f") -> str:
    return "     -" if x is None else format(x, spec)


def markdown(
    copy_rows: list[dict[str, Any]],
    wake_rows: list[dict[str, Any]],
    alloc_rows: list[dict[str, Any]],
    meta: str,
) -> str:
    lines = [
        f"### Copies ({meta})",
        "",
        "GB/s, median of 8 (variants: 5), wall time from issue to data known to be there.",
        "",
        "| path | size | copies at once | plain torch | aresidency backend | aresidency manager "
        "| manager, one plan | anchor | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in copy_rows:
        lines.append(
            f"| {r['path']} | {r['size']} | {r.get('concurrent', 1)} | {fmt(r['torch']).strip()} | "
            f"{fmt(r['ours']).strip()} | {fmt(r.get('manager')).strip()} | "
            f"{fmt(r.get('one_plan')).strip()} | {fmt(r['anchor']).strip()} | {r['note']} |"
        )
    lines += [
        "",
        "### Waking the loop when a CUDA event completes (2 ms kernel)",
        "",
        "| strategy | wake-up us (median) | p90 | CPU % (2 ms waits) | above the baseline "
        "| of it: loop thread | of it: waiter thread | CPU % (20 ms waits) | loop lag p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in wake_rows:
        lines.append(
            f"| {r['strategy']} | {fmt(r['wake_us_median'], '.1f').strip()} | "
            f"{fmt(r['wake_us_p90'], '.1f').strip()} | {fmt(r['cpu_percent'], '.1f').strip()} | "
            f"{fmt(r.get('cpu_over_baseline'), '.1f').strip()} | "
            f"{fmt(r.get('cpu_loop_percent'), '.1f').strip()} | "
            f"{fmt(r.get('cpu_waiter_percent'), '.1f').strip()} | "
            f"{fmt(r['cpu_percent_20ms'], '.1f').strip()} | {r['lag_p99_ms']:.3f} |"
        )
    lines += [
        "",
        "Reference (docs/performance.md): polling with sleep(0) burns a core; polling every "
        "100 us costs ~6% of a core and adds ~0.1 ms; a thread in event.synchronize() wakes "
        "~0.2 ms later and added ~1 ms loop lag p99. The baseline row is the harness alone: "
        "the loop launches each kernel and then sleeps in synchronize() of a blocking-sync "
        "event itself (blocked, hence its lag); 'above the baseline' is what a strategy's "
        "waiting costs beyond launching, recording and one wake-up per wait.",
    ]
    if alloc_rows:
        lines += [
            "",
            "### One pinned allocation (median of 3)",
            "",
            "| allocation | size | alloc ms | free ms |",
            "|---|---|---|---|",
        ]
        for r in alloc_rows:
            lines.append(
                f"| {r['what']} | {r['size']} | {r['alloc_ms']:.1f} | "
                f"{fmt(r['free_ms'], '.1f').strip()} |"
            )
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sizes = {"4 MB": 4 * MB, "64 MB": 64 * MB} if args.quick else SIZES
    if args.staging_only:
        sizes = {"1 GB": SIZES["1 GB"]}
    props = torch.cuda.get_device_properties(0)
    loop_name = "uvloop" if args.uvloop else "asyncio"
    meta = (
        f"{props.name}, {torch.cuda.device_count()} GPU(s), torch {torch.__version__}, "
        f"{loop_name}, {time.strftime('%Y-%m-%d')}"
    )
    print(f"# bench_copy: {meta}", flush=True)
    print(
        f"# hostfunc available: {hostfunc_available()}; default waiter: "
        f"{EventWaiter('auto').strategy}",
        flush=True,
    )
    wake_rows: list[dict[str, Any]] = []
    copy_rows: list[dict[str, Any]] = []
    alloc_rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    if not args.staging_only:
        print("## wake-up", flush=True)
        try:
            await bench_wakeup(wake_rows, waits=40 if args.quick else 100)
        except Exception:
            traceback.print_exc()
    if not args.wakeup_only:
        print("## copies", flush=True)
        try:
            await bench_copies(sizes, copy_rows, staging_only=args.staging_only)
        except Exception:
            traceback.print_exc()
    if not (args.wakeup_only or args.staging_only):
        print("## pinned allocation", flush=True)
        try:
            bench_pinned_alloc(alloc_rows)
        except Exception:
            traceback.print_exc()
    md = markdown(copy_rows, wake_rows, alloc_rows, meta)
    print("\n" + md)
    print(f"\n# total {time.perf_counter() - started:.1f} s")
    return {
        "meta": meta,
        "copies": copy_rows,
        "wakeup": wake_rows,
        "pinned_alloc": alloc_rows,
        "markdown": md,
    }


def run(args: argparse.Namespace) -> None:
    if args.uvloop:
        import uvloop

        result = uvloop.run(main(args))
    else:
        result = asyncio.run(main(args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(result["markdown"] + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 MB and 64 MB only, fewer waits")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    parser.add_argument("--wakeup-only", action="store_true", help="skip the copy benchmark")
    parser.add_argument(
        "--staging-only",
        action="store_true",
        help="only the pageable copies of 1 GB, both directions and the staging variants",
    )
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    if not torch.cuda.is_available():
        sys.exit("bench_copy.py needs a CUDA GPU")
    run(parser.parse_args())
