"""How often the runtime's operations bring on a full (generation 2) collection of Python's
garbage collector, which stops the event loop for tens of milliseconds once torch is imported.
On ``host_cost_ab.py``'s instant SIMULATION (copies complete in the calling thread; 1,000 other
values registered), with the collector as it is:

* ``tasks``: rounds of 64 tasks, each awaiting ``materialize``, then each value released;
* ``scopes``: scopes moving a 4 KiB value in on entry and out on exit, one after the other.

Prints the operations, the host time per operation (collections included) and the full
collections with the time they took. To compare with an earlier commit, run it with that
commit's package first on ``PYTHONPATH`` (a ``git worktree`` of it).

    python benchmarks/diag_full_collections.py [--rounds 1200] [--scopes 40000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch  # (imported first, as a program of the runtime does: its objects fill the heap)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_cost_ab

import aresidency

N = 64


class FullCollections:
    """A ``gc.callbacks`` entry counting generation-2 collections and their time."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif info["generation"] == 2:
            self.count += 1
            self.seconds += time.perf_counter() - self._start


async def measure(args: argparse.Namespace) -> list[tuple[str, int, float, FullCollections]]:
    out = []
    backend = host_cost_ab.instant_backend(aresidency)
    async with aresidency.ResidencyManager(budgets={"cuda:0": 1 << 30}, backend=backend) as m:
        handles, plan = host_cost_ab.populate(aresidency, m, N)

        async def tasks_round() -> None:
            running = [asyncio.create_task(m.materialize(h, "cuda:0")) for h in handles]
            for task in running:
                await task
            for h in handles:
                await m.release(h, "cuda:0")

        async def scopes(count: int) -> None:
            for _ in range(count):
                async with m.scope(plan):
                    pass

        for label, run, ops in (
            ("tasks (materialize + release)", _rounds(tasks_round, args.rounds), N * args.rounds),
            ("scopes (4 KiB in and out)", lambda: scopes(args.scopes), args.scopes),
        ):
            await _rounds(tasks_round, 3)()  # warm-up
            gc.collect()
            clock = FullCollections()
            gc.callbacks.append(clock)
            t0 = time.perf_counter()
            try:
                await run()
            finally:
                gc.callbacks.remove(clock)
            out.append((label, ops, time.perf_counter() - t0, clock))
    return out


def _rounds(fn: Any, count: int) -> Any:
    async def run() -> None:
        for _ in range(count):
            await fn()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=1200, help="rounds of 64 tasks")
    parser.add_argument("--scopes", type=int, default=40000)
    args = parser.parse_args()
    rows = asyncio.run(measure(args))
    where = Path(aresidency.__file__).resolve().parent
    print(
        f"aresidency at {where}, torch {torch.__version__}, Python {sys.version.split()[0]}, "
        "instant simulation (not a GPU measurement)"
    )
    print("| operations | count | us per operation | full collections | their ms |")
    print("|---|---|---|---|---|")
    for label, ops, seconds, clock in rows:
        print(
            f"| {label} | {ops} | {seconds / ops * 1e6:.1f} | {clock.count} | "
            f"{clock.seconds * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
