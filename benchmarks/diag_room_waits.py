"""The host cost of the hold-and-wait check (``manager.room_wait``): ``--tasks`` request
handlers each inside ``pool.use`` of one model iterate a ``DeviceLoader`` whose batch waits
for room a reservation block of another task holds (no cycle: that task does not wait), so
every handler's wait is registered and each new one is checked against all the others. Prints
the check's time per wait (max, median) and in all, on the simulated backend (CUDA simulated
in host memory: the check is the same Python on a GPU).

    python3 benchmarks/diag_room_waits.py --tasks 8 32 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serving._models import TinyLM  # the serving tests' small model
from serving.test_pool import TOTAL

import aresidency.runtime.admission as admission
from aresidency import ResidencyManager
from aresidency.loader import DeviceLoader
from aresidency.serving import ModelPool


async def measure(tasks: int) -> list[float]:
    times: list[float] = []
    check = admission.AdmissionQueue.waiting_on_each_other

    def timed(self: Any, wait: Any) -> Any:
        start = time.perf_counter()
        try:
            return check(self, wait)
        finally:
            times.append(time.perf_counter() - start)

    admission.AdmissionQueue.waiting_on_each_other = timed  # type: ignore[method-assign]
    try:
        async with ResidencyManager(budgets={"cuda:0": TOTAL + 64 * 1024}, backend="sim") as m:
            pool = ModelPool(m)
            pool.add("a", TinyLM(seed=0))
            release, held = anyio.Event(), anyio.Event()

            async def blocker() -> None:
                async with m.reservation("big", "cuda:0", 64 * 1024):
                    held.set()
                    await release.wait()

            async def handler() -> None:
                await held.wait()
                async with pool.use("a"):
                    data = [torch.randn(4096)]
                    async with DeviceLoader(m, data, "cuda:0", prefetch=0) as loader:
                        async for _ in loader:
                            pass

            async with anyio.create_task_group() as group:
                group.start_soon(blocker)
                for _ in range(tasks):
                    group.start_soon(handler)
                with anyio.fail_after(60):
                    while len(m.room_waits()) < tasks:
                        await m.wait_for_change(0.01)
                release.set()
            await pool.aclose()
    finally:
        admission.AdmissionQueue.waiting_on_each_other = check  # type: ignore[method-assign]
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, nargs="+", default=[8, 32, 64])
    args = parser.parse_args()
    print("| waiting tasks | checks | max ms | median ms | all ms |")
    print("|---|---|---|---|---|")
    for tasks in args.tasks:
        times = anyio.run(measure, tasks)
        print(
            f"| {tasks} | {len(times)} | {max(times) * 1e3:.1f} | "
            f"{statistics.median(times) * 1e3:.2f} | {sum(times) * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
