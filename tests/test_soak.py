"""A churn soak on the simulated backend (a simulation of CUDA devices in host memory):
register, move, lease and discard over and over. Nothing the runtime keeps may grow with the
number of operations: the state's values, the payloads, the listeners, the watched
completions, the snapshot's persistent map, the trace (a bounded ring), and the Python heap.
(Per-operation time over 100k operations is measured by ``benchmarks/bench_scale.py``.)

It lives outside ``tests/runtime`` on purpose: it collects garbage between rounds to measure
the heap, which the loop-stall guard there (it pauses automatic collection) would count as a
stall."""

from __future__ import annotations

import gc
import itertools
import tracemalloc

import pytest
import torch

from aresidency import ResidencyManager

pytestmark = pytest.mark.anyio

ROUNDS = 6
PER_ROUND = 300  # operations per round: 1,800 in all (the benchmark runs 100,000)


async def test_churn_keeps_every_structure_and_the_heap_flat() -> None:
    async with ResidencyManager(
        budgets={"cuda:0": 1 << 20}, backend="sim", trace_capacity=1024
    ) as m:
        keep = [m.register(torch.ones(256), name=f"keep{i}") for i in range(16)]
        sizes: list[tuple[int, ...]] = []
        heap: list[int] = []
        tracemalloc.start()
        try:
            for round_ in range(ROUNDS):
                for i in range(PER_ROUND // 3):
                    h = m.register(torch.full((256,), float(i)), name=f"churn{round_}.{i}")
                    await m.move(h, "cuda:0")
                    async with m.acquire(h, "cuda:0") as lease:
                        assert float(lease.tensor[0]) == float(i)
                    await m.discard(h)
                m.snapshot()  # keeps the persistent map current
                gc.collect()
                sizes.append(
                    (
                        len(m.snapshot().values),
                        sum(1 for _ in m.state.values()),
                        len(m.state.changed_values),
                        len(m.trace().transitions),
                        m.waiting,
                    )
                )
                heap.append(tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
        # From the second round on (the bounded trace is full by then) nothing changes.
        assert all(s == sizes[1] for s in sizes[1:]), sizes
        assert sizes[1][0] == len(keep) and sizes[1][3] == 1024
        # The heap after the first round (caches, the loop's own structures warmed up) does
        # not grow with the rounds: a leak of even one small object per operation would add
        # 100 bytes x 300 operations to every round. A table that resizes once is no leak (on
        # trio the heap has been seen to step up by about 150 KB in one round and stay flat):
        # the growth counted leaves out the largest single step.
        steps = [after - before for before, after in itertools.pairwise(heap[1:])]
        growth = sum(steps) - max(steps)
        assert growth < 64 * 1024, heap
