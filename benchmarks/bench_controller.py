"""Controller decisions: time and explored states, and the loop lag while deciding.

The states are built on the pure model (``core.ResidencyState``), so that 10,000 values of
1 MiB need no memory; the controller reads the same model inside a manager. For each size
(100, 1,000, 10,000 values filling ``cuda:0`` exactly, a third of them with a source, half of
them touched in random order) and each number of evictions needed (1, 8, 64), a request for a
new value of that many units is decided:

* ``warm``: the controller's candidate index is kept current between decisions (a few values
  are touched between two decisions, as a running server does); median of the repetitions.
  Goal: < 5 ms for 10,000 values needing 8 evictions.
* ``cold``: the first decision, which builds the index (walks every value once).
* ``mixed`` sizes (1-16 units, 1% optimality gap, the default) next to ``uniform`` ones.

Then the loop lag: ``await controller.decide`` beside a ticker task (``asyncio.sleep(0)`` in a
loop) that records the longest gap between two of its wake-ups (wall clock, and the loop
thread's CPU time, which leaves out the OS preempting the process on a shared machine), for the
10,000/8 case and for a search of tens of thousands of states (many sizes, exact search). Goal:
about a millisecond at most. Prints markdown tables.

    python benchmarks/bench_controller.py [--repeat 20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import time
from typing import Any

from aresidency.controller import (
    CostModel,
    ResidencyController,
    ResidencyRequest,
    ResidencyRequirement,
)
from aresidency.core import ResidencyState, ValueHandle

MIB = 1 << 20


class ModelManager:
    """The part of a manager the controller reads: its state (no devices)."""

    def __init__(self, state: ResidencyState) -> None:
        self.state = state

    @property
    def state_version(self) -> int:
        return self.state.state_version

    def check_thread(self) -> None:
        pass  # the benchmark's own loop owns the state

    async def wait_for_change(self, timeout: float | None = None) -> bool:  # pragma: no cover
        raise NotImplementedError("the benchmark only decides")

    def scope(self, decision: Any, timeout: float | None = None) -> Any:  # pragma: no cover
        raise NotImplementedError("the benchmark only decides")


def build(count: int, sizes: str, seed: int = 0) -> tuple[ResidencyState, list[ValueHandle]]:
    rng = random.Random(seed)
    charges = [MIB if sizes == "uniform" else rng.randint(1, 16) * MIB // 4 for _ in range(count)]
    state = ResidencyState(budgets={"cuda:0": sum(charges), "pinned-host": None})
    handles = [
        state.register(
            name=f"v{i}",
            charge_bytes=charge,
            location="cuda:0",
            has_source=i % 3 == 0,
            source_location="pageable-host" if i % 3 == 0 else None,
        )
        for i, charge in enumerate(charges)
    ]
    for handle in rng.sample(handles, count // 2):
        state.lease(handle, "cuda:0")
        state.unlease(handle, "cuda:0")
    return state, handles


def touch(state: ResidencyState, handles: list[ValueHandle], rng: random.Random) -> None:
    for handle in rng.sample(handles, min(10, len(handles))):
        state.lease(handle, "cuda:0")
        state.unlease(handle, "cuda:0")


def decision_rows(repeat: int, counts: list[int]) -> list[tuple[Any, ...]]:
    rows = []
    for sizes in ("uniform", "mixed"):
        for count in counts:
            for evictions in (1, 8, 64):
                state, handles = build(count, sizes)
                unit = MIB if sizes == "uniform" else 2 * MIB  # mixed: mean charge ~2.1 MiB
                new = state.register(
                    name="new",
                    charge_bytes=evictions * unit,
                    has_source=True,
                    source_location="pageable-host",
                )
                request = ResidencyRequest("bench", [ResidencyRequirement(new, "cuda:0")])
                controller = ResidencyController(ModelManager(state))
                gc.collect()
                started = time.perf_counter()
                decision = controller.decide_nowait(request)
                cold = time.perf_counter() - started
                rng = random.Random(1)
                samples = []
                explored = []
                for _ in range(repeat):
                    touch(state, handles, rng)
                    started = time.perf_counter()
                    decision = controller.decide_nowait(request)
                    samples.append(time.perf_counter() - started)
                    explored.append(decision.explored_states)
                rows.append(
                    (
                        sizes,
                        count,
                        evictions,
                        len(decision.evictions),
                        statistics.median(explored),
                        statistics.median(samples) * 1e3,
                        max(samples) * 1e3,
                        cold * 1e3,
                    )
                )
                controller.close()
    return rows


async def lag(work: Any) -> tuple[Any, float, float, float, int, float]:
    """Run ``work`` beside a ticker: the longest wall-clock gap between two ticks, its 99th
    percentile, the longest loop-thread CPU time between two ticks (what the code on the loop
    used; wall time also counts the OS preempting the process), the tick count, the time."""
    gaps: list[float] = []
    worst_cpu = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst_cpu
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not done:
            await asyncio.sleep(0)
            now, now_cpu = time.perf_counter(), time.thread_time()
            gaps.append(now - last)
            worst_cpu = max(worst_cpu, now_cpu - last_cpu)
            last, last_cpu = now, now_cpu

    task = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)
    started = time.perf_counter()
    result = await work
    elapsed = time.perf_counter() - started
    done = True
    await task
    gaps.sort()
    p99 = gaps[int(len(gaps) * 0.99)] if gaps else 0.0
    return result, gaps[-1] if gaps else 0.0, p99, worst_cpu, len(gaps), elapsed


def hard_case() -> tuple[ResidencyState, ResidencyRequest]:
    rng = random.Random(1)
    sizes = [rng.randint(1, 97) * 512 for _ in range(200)]
    state = ResidencyState(budgets={"cuda:0": sum(sizes), "pinned-host": None})
    handles = [
        state.register(name=f"v{i}", charge_bytes=s, location="cuda:0") for i, s in enumerate(sizes)
    ]
    for handle in rng.sample(handles, 100):
        state.lease(handle, "cuda:0")
        state.unlease(handle, "cuda:0")
    new = state.register(
        name="new", charge_bytes=300 * 512 + 1, has_source=True, source_location="pageable-host"
    )
    return state, ResidencyRequest("hard", [ResidencyRequirement(new, "cuda:0")])


async def lag_rows() -> list[tuple[Any, ...]]:
    rows = []
    gc.disable()
    try:
        state, handles = build(10_000, "uniform")
        new = state.register(
            name="new", charge_bytes=8 * MIB, has_source=True, source_location="pageable-host"
        )
        request = ResidencyRequest("bench", [ResidencyRequirement(new, "cuda:0")])
        controller = ResidencyController(ModelManager(state))
        decision, worst, p99, cpu, ticks, elapsed = await lag(controller.decide(request))
        rows.append(
            (
                "10,000 values, 8 evictions, cold (builds the index)",
                decision.explored_states,
                elapsed,
                worst,
                p99,
                cpu,
                ticks,
            )
        )
        touch(state, handles, random.Random(2))
        decision, worst, p99, cpu, ticks, elapsed = await lag(controller.decide(request))
        rows.append(
            (
                "10,000 values, 8 evictions, warm",
                decision.explored_states,
                elapsed,
                worst,
                p99,
                cpu,
                ticks,
            )
        )
        state, request = hard_case()
        controller = ResidencyController(
            ModelManager(state),
            search_state_limit=200_000,
            optimality_gap=0.0,
            cost_model=CostModel(recency_half_life=64),
        )
        await controller.decide(ResidencyRequest("warm-up"))
        decision, worst, p99, cpu, ticks, elapsed = await lag(controller.decide(request))
        rows.append(
            (
                "200 values of many sizes, exact search",
                decision.explored_states,
                elapsed,
                worst,
                p99,
                cpu,
                ticks,
            )
        )
    finally:
        gc.enable()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="skip the 10,000-value rows")
    args = parser.parse_args()
    counts = [100, 1000] if args.quick else [100, 1000, 10_000]
    print("Decision time (controller.decide_nowait; the candidate index kept current)")
    print()
    print(
        "| sizes | values | evictions needed | evictions | explored states | warm ms (median)"
        " | warm ms (max) | cold ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for sizes, count, need, got, explored, med, worst, cold in decision_rows(args.repeat, counts):
        print(
            f"| {sizes} | {count:,} | {need} | {got} | {explored:.0f} | {med:.2f} | "
            f"{worst:.2f} | {cold:.1f} |"
        )
    print()
    print("Loop lag while `await controller.decide(...)` runs (ticker on asyncio.sleep(0))")
    print()
    print(
        "| case | explored states | decide ms | max lag ms (wall) | p99 lag ms (wall) "
        "| max lag ms (loop CPU) | ticks |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, explored, elapsed, worst, p99, cpu, ticks in asyncio.run(lag_rows()):
        print(
            f"| {label} | {explored:,} | {elapsed * 1e3:.1f} | {worst * 1e3:.2f} | "
            f"{p99 * 1e3:.3f} | {cpu * 1e3:.2f} | {ticks:,} |"
        )


if __name__ == "__main__":
    main()
