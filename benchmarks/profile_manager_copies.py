"""Where the host time of the manager's small copies goes: ``--count`` values of ``--size``
bytes materialized on ``cuda:0`` at once (a task each, as ``bench_copy.py``'s manager row
does), then released, under ``cProfile`` (the event loop's thread). Prints the host time per
copy and the functions that take it, by own time and by cumulative time.

    python3 benchmarks/profile_manager_copies.py                 # CUDA if present, else sim
    python3 benchmarks/profile_manager_copies.py --backend sim --size 4MiB --count 64
    python3 benchmarks/profile_manager_copies.py --one-plan --dump copies.prof

On the simulated backend (CUDA simulated in host memory) the figures include the simulation's
own allocation and poisoning of device memory: a smoke test of the script, not a measurement
of the CUDA path.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import anyio
import torch

from aresidency import Materialize, ReplicaMode, ResidencyManager, ResidencyPlan
from aresidency.core.sizes import parse_nbytes


async def main(args: argparse.Namespace) -> None:
    gpu = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    nbytes = parse_nbytes(args.size)
    pin = gpu  # pinned sources on a GPU: the copy itself is DMA, the host work is ours
    async with ResidencyManager(backend="cuda" if gpu else "sim") as m:
        handles = []
        for i in range(args.count):
            source = torch.empty(nbytes // 4, dtype=torch.float32)
            if pin:
                source = source.pin_memory()
            handles.append(m.register(source, name=f"v{i}", replica_mode=ReplicaMode.REPLICABLE))

        async def round_trip() -> None:
            if args.one_plan:
                await m.execute(ResidencyPlan(enter=[Materialize(h, "cuda:0") for h in handles]))
            else:
                async with anyio.create_task_group() as tasks:
                    for h in handles:
                        tasks.start_soon(m.materialize, h, "cuda:0")
            async with anyio.create_task_group() as tasks:
                for h in handles:
                    tasks.start_soon(m.release, h, "cuda:0")

        await round_trip()  # warm-up
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for _ in range(args.rounds):
            await round_trip()
        profile.disable()
        elapsed = time.perf_counter() - start
        if args.dump:
            profile.dump_stats(args.dump)  # for pstats on another machine
    copies = args.rounds * args.count
    print(
        f"{copies} copies of {args.size} ({args.count} at once), backend "
        f"{'cuda' if gpu else 'sim (simulation)'}: {elapsed / copies * 1e6:.0f} us per copy and "
        "release, profiled (the profiler adds its own overhead)"
    )
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
        print(f"\n-- by {key}\n{out.getvalue()}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("auto", "cuda", "sim"), default="auto")
    parser.add_argument("--size", default="4MiB")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--one-plan", action="store_true", help="every copy in one plan, not a task each"
    )
    parser.add_argument("--dump", help="also write the raw profile here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    anyio.run(main, parse())
