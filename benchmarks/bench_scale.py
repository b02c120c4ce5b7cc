"""How explain, snapshot, admission and churn scale with plan and state size (CPU only).

Measured on the simulated backend (a simulation of CUDA devices in host memory): none of this
touches a device, so the figures are the runtime's own host cost.

* ``explain``: a plan of N moves (N up to 10,000) against a manager holding V values (V up to
  100,000): time per call, and per action.
* ``snapshot``: the first snapshot of V values (built whole), then one after 100 changes (only
  the changed values are rebuilt: O(changes), not O(V)); and the first one with
  ``snapshot_async`` (built in slices) with the longest the loop went without a ticker task.
* scope entry: a scope whose plan moves N values, entered while a ticker task measures the
  longest time the loop went without running it (the loop-blocking figure), and the same
  leaving out the stretches in which CPython's garbage collector ran (``gc.callbacks``): a
  full collection stops every thread, whatever it is doing.
* churn: register, move, lease, discard, 100,000 operations: time per operation and Python heap
  in each tenth of the run (they must stay flat).

    python3 benchmarks/bench_scale.py [--quick] [--json out.json] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio.lowlevel

from aresidency import Move, ResidencyManager, ResidencyPlan


async def ticker(gaps: list[tuple[float, float]], stop: list[bool]) -> None:
    """Note every stretch between two of its turns on the loop: (start, end)."""
    last = time.perf_counter()
    while not stop[0]:
        await anyio.lowlevel.checkpoint()
        now = time.perf_counter()
        gaps.append((last, now))
        last = now


class Collections:
    """The garbage collector's pauses while installed: (generation, start, end)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], self._start, time.perf_counter()))

    def __enter__(self) -> Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def overlaps(self, start: float, end: float) -> bool:
        return any(b < end and start < e for _, b, e in self.pauses)


async def with_values(count: int) -> tuple[ResidencyManager, list[Any]]:
    m = ResidencyManager(backend="sim", trace_capacity=0)
    await m.__aenter__()
    small = torch.zeros(1)
    handles = [m.register(small.clone(), name=f"v{i}") for i in range(count)]
    return m, handles


async def bench_explain(sizes: list[int], actions: list[int]) -> list[dict[str, Any]]:
    rows = []
    for values in sizes:
        m, handles = await with_values(values)
        for n in actions:
            if n > values:
                continue
            plan = ResidencyPlan(enter=[Move(h, "cuda:0") for h in handles[:n]])
            m.explain(plan)  # warm
            runs = []
            for _ in range(3):
                start = time.perf_counter()
                m.explain(plan)
                runs.append(time.perf_counter() - start)
            best = min(runs)
            rows.append(
                {
                    "values": values,
                    "actions": n,
                    "explain_ms": best * 1e3,
                    "us_per_action": best * 1e6 / n,
                }
            )
        await m.__aexit__(None, None, None)
    return rows


async def bench_snapshot(sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for values in sizes:
        m, handles = await with_values(values)
        start = time.perf_counter()
        m.snapshot()
        first = time.perf_counter() - start
        for h in handles[:100]:
            m.hold(h, "pageable-host").release()
        start = time.perf_counter()
        snap = m.snapshot()
        after = time.perf_counter() - start
        start = time.perf_counter()
        m.snapshot()
        unchanged = time.perf_counter() - start
        assert len(snap.values) == values
        await m.__aexit__(None, None, None)
        # The first snapshot again, with snapshot_async (slices of 0.5 ms) while a ticker runs.
        m, handles = await with_values(values)
        gaps: list[tuple[float, float]] = []
        stop = [False]
        with Collections() as collections:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker, gaps, stop)
                await anyio.sleep(0.01)
                gaps.clear()
                collections.pauses.clear()
                start = time.perf_counter()
                sliced = await m.snapshot_async()
                first_async = time.perf_counter() - start
                stop[0] = True
        assert len(sliced.values) == values
        blocked = max(
            (end - begin for begin, end in gaps if not collections.overlaps(begin, end)),
            default=0.0,
        )
        rows.append(
            {
                "values": values,
                "first_ms": first * 1e3,
                "after_100_changes_ms": after * 1e3,
                "unchanged_ms": unchanged * 1e3,
                "first_async_ms": first_async * 1e3,
                "first_async_loop_blocked_max_ms": blocked * 1e3,
            }
        )
        await m.__aexit__(None, None, None)
    return rows


async def bench_scope_entry(sizes: list[int], actions: list[int]) -> list[dict[str, Any]]:
    rows = []
    for values in sizes:
        for n in actions:
            if n > values:
                continue
            m, handles = await with_values(values)
            gaps: list[tuple[float, float]] = []
            stop = [False]
            plan = ResidencyPlan(
                enter=[Move(h, "cuda:0") for h in handles[:n]],
                exit=[Move(h, "pageable-host") for h in handles[:n]],
            )
            # The set-up's objects move to the permanent generation (as a long-running
            # server's do): a full collection over them is not the runtime blocking.
            gc.collect()
            gc.freeze()
            with Collections() as collections:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ticker, gaps, stop)
                    await anyio.sleep(0.01)
                    gaps.clear()
                    collections.pauses.clear()
                    start = time.perf_counter()
                    async with m.scope(plan):
                        pass
                    entered = time.perf_counter() - start
                    stop[0] = True
            gc.unfreeze()
            lengths = sorted(end - begin for begin, end in gaps)
            # The stretches with no collection in them: what the runtime itself blocked.
            own = max(
                (end - begin for begin, end in gaps if not collections.overlaps(begin, end)),
                default=0.0,
            )
            full = [e - b for g, b, e in collections.pauses if g == 2]
            rows.append(
                {
                    "values": values,
                    "actions": n,
                    "enter_and_exit_ms": entered * 1e3,
                    "loop_blocked_max_ms": lengths[-1] * 1e3,
                    "loop_blocked_p99_ms": lengths[int(len(lengths) * 0.99)] * 1e3,
                    "loop_blocked_max_without_gc_ms": own * 1e3,
                    "full_collections": len(full),
                    "longest_full_collection_ms": max(full, default=0.0) * 1e3,
                }
            )
            await m.__aexit__(None, None, None)
    return rows


async def bench_churn(operations: int) -> dict[str, Any]:
    async with ResidencyManager(
        budgets={"cuda:0": 1 << 30}, backend="sim", trace_capacity=4096
    ) as m:
        tenth = operations // 10
        times: list[float] = []
        heap: list[int] = []
        tracemalloc.start()
        data = torch.zeros(64)
        try:
            for part in range(10):
                gc.collect()
                start = time.perf_counter()
                for i in range(tenth // 4):
                    h = m.register(data.clone(), name=f"c{part}.{i}")
                    await m.move(h, "cuda:0")
                    async with m.acquire(h, "cuda:0"):
                        pass
                    await m.discard(h)
                elapsed = time.perf_counter() - start
                times.append(elapsed * 1e6 / tenth)
                gc.collect()
                heap.append(tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
    return {
        "operations": operations,
        "us_per_op_by_tenth": times,
        "heap_kib_by_tenth": [h / 1024 for h in heap],
        "first_tenth_us": times[0],
        "last_tenth_us": times[-1],
        "ratio_last_to_first": times[-1] / times[0],
    }


def markdown(result: dict[str, Any]) -> str:
    lines = ["### explain (a plan of N moves against V values)", ""]
    lines.append("| values | actions | explain ms | us per action |")
    lines.append("|---|---|---|---|")
    for r in result["explain"]:
        lines.append(
            f"| {r['values']:,} | {r['actions']:,} | {r['explain_ms']:.2f} | "
            f"{r['us_per_action']:.1f} |"
        )
    lines += [
        "",
        "### snapshot",
        "",
        "| values | first ms | after 100 changes ms | unchanged ms | first with snapshot_async "
        "ms | its loop blocked max ms (outside collections) |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for r in result["snapshot"]:
        lines.append(
            f"| {r['values']:,} | {r['first_ms']:.1f} | {r['after_100_changes_ms']:.2f} | "
            f"{r['unchanged_ms']:.3f} | {r['first_async_ms']:.1f} | "
            f"{r['first_async_loop_blocked_max_ms']:.2f} |"
        )
    lines += ["", "### scope entry and exit (N moves in, N out)", ""]
    lines.append(
        "| values | actions | enter + exit ms | loop blocked max ms | p99 ms | max outside a "
        "collection ms | full collections (longest ms) |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for r in result["scope"]:
        lines.append(
            f"| {r['values']:,} | {r['actions']:,} | {r['enter_and_exit_ms']:.1f} | "
            f"{r['loop_blocked_max_ms']:.2f} | {r['loop_blocked_p99_ms']:.2f} | "
            f"{r['loop_blocked_max_without_gc_ms']:.2f} | {r['full_collections']} "
            f"({r['longest_full_collection_ms']:.1f}) |"
        )
    c = result["churn"]
    lines += [
        "",
        f"### churn: {c['operations']:,} operations (register, move, lease, discard)",
        "",
        "| tenth | " + " | ".join(str(i + 1) for i in range(10)) + " |",
        "|---" * 11 + "|",
        "| us per op | " + " | ".join(f"{t:.0f}" for t in c["us_per_op_by_tenth"]) + " |",
        "| heap KiB | " + " | ".join(f"{h:.0f}" for h in c["heap_kib_by_tenth"]) + " |",
        "",
        f"last tenth / first tenth: {c['ratio_last_to_first']:.2f}",
    ]
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    actions = [100, 1_000] if args.quick else [100, 1_000, 10_000]
    churn_ops = 10_000 if args.quick else 100_000
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "explain": await bench_explain(sizes, actions),
        "snapshot": await bench_snapshot(sizes),
        "scope": await bench_scope_entry(sizes[:2], actions),
        "churn": await bench_churn(churn_ops),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parsed = parser.parse_args()
    result = anyio.run(main, parsed)
    text = markdown(result)
    print(text)
    if parsed.json:
        parsed.json.write_text(json.dumps(result, indent=2))
    if parsed.markdown:
        parsed.markdown.write_text(text + "\n")
