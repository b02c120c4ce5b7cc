"""Scope overhead: CPU time per enter+exit of a one-value plan.

Two cases, each on the backend given (default: the simulated backend, which needs no GPU):

* ``resident``: the value is already where the plan wants it; nothing moves. Goal: < 50 us.
* ``transfer``: the plan moves a small value in on entry and back out on exit.

Also the ``acquire`` fast path (lease enter+exit on a resident value). Prints a markdown table.

``--backend instant`` is a SIMULATION whose copies complete synchronously, in the calling
thread, with no poisoning of freed memory: what it measures is the runtime's own host cost per
scope (the layers above the backend), without a device and without the simulation's streams.
On a CPU-only machine that is the figure to follow; ``cuda`` adds the real backend's.

    python benchmarks/bench_scope.py [--backend sim|instant|cuda] [--iterations 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch

from aresidency import Materialize, Move, ResidencyManager, ResidencyPlan
from aresidency.backends.base import Backend, Transfer
from aresidency.backends.events import HostEvent
from aresidency.backends.sim import SimBackend
from aresidency.core.locations import Location

_DONE = HostEvent(done=True, label="instant")
T = TypeVar("T")


class InstantBackend(SimBackend):
    """A SIMULATION whose copies complete in the calling thread (see the module docstring)."""

    name = "instant"

    def allocate(self, shape, dtype, location):  # type: ignore[no-untyped-def]
        loc = Location.parse(location)
        tensor = torch.empty(tuple(shape), dtype=dtype)
        with self._lock:
            self._owned[tensor.untyped_storage().data_ptr()] = loc
        return tensor

    def copy(self, src, src_location, dst_location, *, wait_events=()):  # type: ignore[no-untyped-def]
        dst_loc = Location.parse(dst_location)
        dst = self.allocate(src.shape, src.dtype, dst_loc)
        dst.copy_(src)
        nbytes = src.numel() * src.element_size()
        transfer = Transfer(self, dst, nbytes, Location.parse(src_location), dst_loc, "instant")
        transfer._finish_issue(_DONE)
        return transfer

    copy_many = Backend.copy_many  # one copy() each

    def free(self, tensor, location):  # type: ignore[no-untyped-def]
        with self._lock:
            self._owned.pop(tensor.untyped_storage().data_ptr(), None)


def make_backend(name: str) -> object:
    return InstantBackend() if name == "instant" else name


async def profile_transfer(backend: str, iterations: int, dump: str | None = None) -> None:
    """cProfile of the transfer case: where the host time of a scope goes."""
    import cProfile
    import pstats

    async with ResidencyManager(budgets={"cuda:0": 1 << 30}, backend=make_backend(backend)) as m:
        moving = m.register(torch.randn(1024), name="moving", location="pinned-host")
        plan = ResidencyPlan(enter=[Move(moving, "cuda:0")], exit=[Move(moving, "pinned-host")])
        for _ in range(100):
            async with m.scope(plan):
                pass
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(iterations):
            async with m.scope(plan):
                pass
        profiler.disable()
        waiter = getattr(m.backend, "waiter", None)
        if waiter is not None:
            print(
                f"{iterations} scopes: completions seen by the loop's polls {waiter.loop_hits}, "
                f"the waiter thread woke {waiter.wakeups} times ({waiter!r})"
            )
        if dump:
            profiler.dump_stats(dump)  # for pstats or snakeviz on another machine
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(25)


async def measure(backend: str, iterations: int) -> list[tuple[str, float, float]]:
    rows = []
    async with ResidencyManager(budgets={"cuda:0": 1 << 30}, backend=make_backend(backend)) as m:
        # A populated manager: 1,000 other values, so costs that grow with the state show up.
        for i in range(1000):
            m.register(torch.empty(256), name=f"other{i}")
        resident = m.register(torch.randn(1024), name="resident", location="cuda:0")
        moving = m.register(torch.randn(1024), name="moving", location="pinned-host")
        cases = {
            "scope, value already resident": ResidencyPlan(enter=[Materialize(resident, "cuda:0")]),
            "scope, 4 KiB in on entry and out on exit": ResidencyPlan(
                enter=[Move(moving, "cuda:0")], exit=[Move(moving, "pinned-host")]
            ),
        }
        for label, plan in cases.items():
            n = iterations if "resident" in label else max(1, iterations // 10)
            samples_cpu = []
            samples_wall = []
            for _ in range(5):
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for _ in range(n):
                    async with m.scope(plan):
                        pass
                samples_cpu.append((time.process_time() - cpu0) / n * 1e6)
                samples_wall.append((time.perf_counter() - wall0) / n * 1e6)
            rows.append((label, statistics.median(samples_cpu), statistics.median(samples_wall)))
        samples_cpu, samples_wall = [], []
        for _ in range(5):
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(iterations):
                async with m.acquire(resident, "cuda:0"):
                    pass
            samples_cpu.append((time.process_time() - cpu0) / iterations * 1e6)
            samples_wall.append((time.perf_counter() - wall0) / iterations * 1e6)
        rows.append(
            (
                "lease enter+exit, resident",
                statistics.median(samples_cpu),
                statistics.median(samples_wall),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="sim")
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    parser.add_argument("--profile", action="store_true", help="cProfile the transfer case")
    parser.add_argument("--dump", help="with --profile: also write the raw profile here")
    args = parser.parse_args()
    run: Callable[[Coroutine[Any, Any, T]], T] = asyncio.run
    if args.uvloop:
        import uvloop

        run = uvloop.run
    if args.profile:
        run(profile_transfer(args.backend, args.iterations, args.dump))
        return
    rows = run(measure(args.backend, args.iterations))
    loop = "uvloop" if args.uvloop else "asyncio"
    print(
        f"backend={args.backend} loop={loop} torch={torch.__version__} "
        "(CPU time includes the loop's own and every thread's)"
    )
    print("| case | CPU us per enter+exit | wall us | goal |")
    print("|---|---|---|---|")
    for label, cpu, wall in rows:
        goal = "< 50" if "already resident" in label else "<= 150" if "4 KiB" in label else ""
        print(f"| {label} | {cpu:.1f} | {wall:.1f} | {goal} |")


if __name__ == "__main__":
    main()
