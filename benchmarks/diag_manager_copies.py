"""Where a small copy through the manager spends its time, without a profiler: ``--count``
registered values of ``--size`` bytes (pinned sources) copied to ``cuda:0`` at once, timed in
parts. Each row is the median of ``--rounds`` rounds, in microseconds per copy:

* ``torch issue`` / ``torch total``: plain torch (``.to(device, non_blocking=True)`` on a side
  stream, then that stream synchronized), as ``bench_copy.py``'s torch column;
* ``backend issue`` / ``backend total``: ``CudaBackend.copy`` for every value (the host's issue
  time), then every transfer awaited and freed (the whole round);
* ``copy_many issue`` / ``copy_many total``: the same copies in one ``CudaBackend.copy_many``
  (one stream switch and one completion event for all);
* ``... device span`` (CUDA only): the device's own time for that row's copies, between a timing
  event recorded on the copy stream before the first copy and one after the last; the row's
  total minus it is what the host added (the first issue and the notice of the last completion);
* ``nowait issue`` / ``nowait total``: ``materialize_nowait`` for every value, then every
  pending operation awaited (the runtime's admission, plan, commit and settle on top);
* ``release nowait``: ``release_nowait`` for every value and their awaits;
* ``tasks``: one task per value calling ``await manager.materialize`` (``bench_copy.py``'s
  manager row);
* ``4 KiB tasks``: the same with 4 KiB values, where the device's copy time is negligible:
  the runtime's own cost per operation;
* ``one plan`` / ``4 KiB one plan``: every copy in one plan
  (``await manager.execute(ResidencyPlan(enter=[Materialize(...), ...]))``): admission, plan
  and commit once for all of them.

The GB/s column is the size over the row's time per copy.

``bench_copy.py`` times the same tasks lower than this script's ``tasks`` row; two ways its
cells differ can be put here one at a time: ``--release-with tasks|plan`` releases every row's
copies the one way (by default the task rows release with a task each and the plan rows with
one plan), and ``--second-backend`` starts a second ``CudaBackend`` beside the manager's, as
``bench_copy.py`` does for its backend column, and runs a round of copies through it before
each row. ``--only`` names the rows to run (comma-separated, as printed).

    python3 benchmarks/diag_manager_copies.py                 # CUDA if present, else sim
    python3 benchmarks/diag_manager_copies.py --size 4MiB --count 64 --rounds 15

On the simulated backend (CUDA simulated in host memory) the figures are the simulation's: a
smoke test of the script, not a measurement of the CUDA path.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aresidency import Materialize, Release, ReplicaMode, ResidencyManager, ResidencyPlan
from aresidency.backends.base import CopyRequest
from aresidency.core.locations import Location
from aresidency.core.sizes import format_nbytes, parse_nbytes


def _sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


async def _median_us(
    fn: Callable[[], Awaitable[dict[str, float]]], rounds: int, count: int
) -> dict[str, float]:
    await fn()  # warm-up
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        for key, seconds in (await fn()).items():
            samples.setdefault(key, []).append(seconds / count * 1e6)
    return {key: statistics.median(values) for key, values in samples.items()}


class GcClock:
    """Collections of the cyclic garbage collector while the rounds run, and the time they took
    (``gc.callbacks``), per generation."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            generation = info["generation"]
            self.count[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._start

    def summary(self, copies: int) -> str:
        parts = [
            f"gen{g} {n} x, {s * 1e3:.1f} ms"
            for g, (n, s) in enumerate(zip(self.count, self.seconds, strict=True))
        ]
        return (
            f"garbage collector during the rounds: {'; '.join(parts)}; "
            f"{sum(self.seconds) / copies * 1e6:.1f} us per copy"
        )


async def main(args: argparse.Namespace) -> None:
    gpu = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    nbytes = parse_nbytes(args.size)
    count = args.count
    rows: dict[str, float] = {}
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    chosen: Any = "sim"
    if gpu:
        from aresidency.backends import CudaBackend

        chosen = CudaBackend(waiter=args.waiter)
    async with ResidencyManager(backend=chosen) as m:
        backend: Any = m.backend
        host, dev = (
            Location.parse("pinned-host" if gpu else "pageable-host"),
            Location.parse("cuda:0"),
        )

        def sources(size: int) -> list[torch.Tensor]:
            out = []
            for _ in range(count):
                t = torch.empty(size // 4, dtype=torch.float32)
                out.append(t.pin_memory() if gpu else t)
            return out

        big = sources(nbytes)
        handles = [
            m.register(s, name=f"v{i}", replica_mode=ReplicaMode.REPLICABLE, location=host)
            for i, s in enumerate(big)
        ]
        small = [
            m.register(s, name=f"s{i}", replica_mode=ReplicaMode.REPLICABLE, location=host)
            for i, s in enumerate(sources(4096))
        ]

        def span_markers(stream: Any) -> tuple[Any, Any]:
            """Two timing events on the stream the copies go to: the first recorded now (before
            the copies), the second to be recorded after them. The device's own time for the
            copies is the span between them; the round's time minus it is the host's share
            (the issue before the first copy and the notice after the last)."""
            if not gpu:
                return None, None
            first, last = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            first.record(stream)
            return first, last

        def device_span(first: Any, last: Any) -> float:
            if first is None:
                return 0.0
            last.synchronize()
            return float(first.elapsed_time(last)) / 1e3

        def h2d_stream() -> Any:
            if not gpu:
                return None
            from aresidency.backends.cuda import copy_streams

            return copy_streams(0).h2d

        async def copy_round(through: Any, label: str = "backend") -> dict[str, float]:
            """Every source copied to the device by ``through`` (a backend), awaited, freed."""
            _sync(gpu)
            stream = h2d_stream()
            t0 = time.perf_counter()
            first, last = span_markers(stream)
            if label == "copy_many":
                requests = [CopyRequest(s, host, dev) for s in big]
                transfers = through.copy_many(requests)
            else:
                transfers = [through.copy(s, host, dev) for s in big]
            t1 = time.perf_counter()
            if last is not None:
                last.record(stream)
            for t in transfers:
                await t.wait()
            t2 = time.perf_counter()
            span = device_span(first, last)
            for t in transfers:
                through.free(t.tensor, dev)
            out = {f"{label} issue": t1 - t0, f"{label} total": t2 - t0}
            if gpu:
                out[f"{label} device span"] = span
            return out

        async def torch_round() -> dict[str, float]:
            """Plain torch, as ``bench_copy.py``'s torch column: every source ``.to(device,
            non_blocking=True)`` on one side stream, then the stream synchronized."""
            _sync(gpu)
            stream = torch.cuda.Stream() if gpu else None
            t0 = time.perf_counter()
            first, last = span_markers(stream)
            with torch.cuda.stream(stream) if gpu else contextlib.nullcontext():
                outs = [s.to("cuda:0" if gpu else "cpu", non_blocking=True) for s in big]
            t1 = time.perf_counter()
            if last is not None:
                last.record(stream)
                stream.synchronize()
            t2 = time.perf_counter()
            span = device_span(first, last)
            del outs
            out = {"torch issue": t1 - t0, "torch total": t2 - t0}
            if gpu:
                out["torch device span"] = span
            return out

        async def backend_round() -> dict[str, float]:
            return await copy_round(backend)

        async def copy_many_round() -> dict[str, float]:
            return await copy_round(backend, "copy_many")

        async def nowait_round() -> dict[str, float]:
            _sync(gpu)
            t0 = time.perf_counter()
            pending = [m.materialize_nowait(h, dev) for h in handles]
            t1 = time.perf_counter()
            for p in pending:
                await p
            t2 = time.perf_counter()
            released = [m.release_nowait(h, dev) for h in handles]
            for p in released:
                await p
            t3 = time.perf_counter()
            return {"nowait issue": t1 - t0, "nowait total": t2 - t0, "release nowait": t3 - t2}

        async def release_tasks(which: list[Any]) -> None:
            async with anyio.create_task_group() as tasks:
                for h in which:
                    tasks.start_soon(m.release, h, dev)

        async def release_plan(which: list[Any]) -> None:
            await m.execute(ResidencyPlan(reclaim=[Release(h, dev) for h in which]))

        def releaser(default: Callable[[list[Any]], Awaitable[None]]) -> Any:
            return {"tasks": release_tasks, "plan": release_plan}.get(args.release_with, default)

        def tasks_round(which: list[Any], label: str) -> Callable[[], Awaitable[dict[str, float]]]:
            release = releaser(release_tasks)

            async def run() -> dict[str, float]:
                _sync(gpu)
                t0 = time.perf_counter()
                async with anyio.create_task_group() as tasks:
                    for h in which:
                        tasks.start_soon(m.materialize, h, dev)
                t1 = time.perf_counter()
                await release(which)
                return {label: t1 - t0}

            run.__name__ = label
            return run

        def plan_round(which: list[Any], label: str) -> Callable[[], Awaitable[dict[str, float]]]:
            release = releaser(release_plan)

            async def run() -> dict[str, float]:
                _sync(gpu)
                t0 = time.perf_counter()
                await m.execute(ResidencyPlan(enter=[Materialize(h, dev) for h in which]))
                t1 = time.perf_counter()
                await release(which)
                return {label: t1 - t0}

            run.__name__ = label
            return run

        second: Any = None
        if args.second_backend and gpu:
            second = type(backend)()
            second.start()

        rows_to_run = [
            torch_round,
            backend_round,
            copy_many_round,
            nowait_round,
            tasks_round(handles, "tasks"),
            tasks_round(small, "4 KiB tasks"),
            plan_round(handles, "one plan"),
            plan_round(small, "4 KiB one plan"),
        ]
        only = {o.strip() for o in args.only.split(",")} if args.only else set()
        unknown = only - {getattr(fn, "__name__", "") for fn in rows_to_run}
        if unknown:
            raise SystemExit(f"--only: no row named {sorted(unknown)}")
        for fn in rows_to_run:
            if only and getattr(fn, "__name__", "") not in only:
                continue
            if second is not None:
                await copy_round(second)
            if args.gc == "freeze":
                gc.collect()
                gc.freeze()
            elif args.gc == "off":
                gc.disable()
            clock = GcClock()
            gc.callbacks.append(clock)
            try:
                rows.update(await _median_us(fn, args.rounds, count))
            finally:
                gc.callbacks.remove(clock)
                gc.enable()
            name = getattr(fn, "__name__", "")
            print(f"{name}: {clock.summary((args.rounds + 1) * count)}")
    if second is not None:
        await second.aclose()
    where = "cuda" if gpu else "sim (simulation, not a measurement)"
    print(
        f"{count} copies of {format_nbytes(nbytes)} at once, {where}, torch {torch.__version__}, "
        f"median of {args.rounds} rounds, waiter {args.waiter}, switch interval "
        f"{sys.getswitchinterval() * 1e3:.2f} ms, released with {args.release_with}"
        f"{', a second backend beside it' if second is not None else ''}"
    )
    print("| part | us per copy | GB/s |")
    print("|---|---|---|")
    for key, us in rows.items():
        size = 4096 if key.startswith("4 KiB") else nbytes
        rate = "" if "issue" in key or "release" in key else f"{size / us / 1e3:.1f}"
        # (a device span is the copies' own time on the device: its GB/s is the link's)
        print(f"| {key} | {us:.1f} | {rate} |")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("auto", "cuda", "sim"), default="auto")
    parser.add_argument("--size", default="4MiB")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--waiter", default="auto", help="the CUDA backend's event waiter")
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)"
    )
    parser.add_argument(
        "--gc",
        choices=("default", "freeze", "off"),
        default="default",
        help="the cyclic garbage collector during the rounds: as it is, every object alive "
        "before them frozen (gc.freeze), or disabled",
    )
    parser.add_argument(
        "--release-with",
        choices=("default", "tasks", "plan"),
        default="default",
        help="how every row releases its copies after each round (default: a task each "
        "after the task rows, one plan after the plan rows)",
    )
    parser.add_argument(
        "--second-backend",
        action="store_true",
        help="a second CudaBackend started beside the manager's, with a round of copies "
        "through it before each row (as bench_copy.py's cells run)",
    )
    parser.add_argument("--only", default="", help="only these rows (comma-separated names)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    anyio.run(main, parse())
