"""The event loop's lag while a ``DeviceLoader`` starts passes over a ``DataLoader`` with worker
processes: how the workers are started decides it.

``iter(dataloader)`` starts the workers, in the loader's source thread. Forking a worker holds
the interpreter lock while the kernel copies the process's page tables, so the event loop
cannot run meanwhile, however idle it is. This runs a few short passes and records the longest
gap of a ticker on the loop (``anyio.lowlevel.checkpoint()`` in a loop), for the ways a
``DataLoader`` can start its workers. On the simulated backend (a simulation of CUDA devices
in host memory, with copies at memory speed): the lag measured is the host's.

    python3 benchmarks/bench_loader_workers_lag.py [--passes 4] [--workers 2] [--batch-kib 32]

``--batch-kib 1024``: batches of 1 MiB (8 rows of 128 KiB) instead of 32 KiB.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import anyio
import anyio.lowlevel
import torch
from torch.utils.data import DataLoader, Dataset

from aresidency import DeviceLoader, ResidencyManager
from aresidency.backends.sim import SimBackend


class Rows(Dataset[torch.Tensor]):
    def __init__(self, row_numel: int = 1024) -> None:
        self.row_numel = row_numel

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.row_numel,), float(index))


async def lag_of(dataloader: DataLoader[Any], passes: int) -> tuple[float, float, int]:
    """The longest and the 99th-percentile gap of the loop's ticker over ``passes`` passes
    (ms), and how many batches were handed out."""
    gaps: list[float] = []
    stop = False
    got = 0

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop:
            await anyio.lowlevel.checkpoint()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with (
        ResidencyManager(backend=SimBackend()) as manager,
        anyio.create_task_group() as tasks,
    ):
        tasks.start_soon(ticker)
        async with DeviceLoader(manager, dataloader, "cuda:0", prefetch=2) as loader:
            for _ in range(passes):
                async for _batch in loader:
                    got += 1
        stop = True
    gaps.sort()
    p99 = gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0
    return (gaps[-1] if gaps else 0.0) * 1e3, p99 * 1e3, got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch-kib", type=int, default=32, help="KiB per batch of 8 rows")
    args = parser.parse_args()
    row_numel = args.batch_kib * 1024 // 4 // 8
    cases: dict[str, dict[str, Any]] = {
        "fork (the default on Linux), new workers each pass": {"multiprocessing_context": "fork"},
        "fork, persistent_workers=True": {
            "multiprocessing_context": "fork",
            "persistent_workers": True,
        },
        "forkserver, new workers each pass": {"multiprocessing_context": "forkserver"},
        "no workers (num_workers=0)": {},
    }
    print(
        f"Loop lag while a DeviceLoader runs {args.passes} passes over a DataLoader "
        f"({args.workers} workers, batches of 8 x {args.batch_kib // 8} KiB), median of "
        f"{args.repeat} runs; simulated backend (a simulation of CUDA devices in host memory)"
    )
    print()
    print("| workers started by | longest gap (ms) | p99 gap (ms) |")
    print("|---|---|---|")
    for label, options in cases.items():
        workers = args.workers if options else 0
        worst, p99 = [], []
        for _ in range(args.repeat):
            dataloader = DataLoader(Rows(row_numel), batch_size=8, num_workers=workers, **options)
            longest, tail, got = anyio.run(lag_of, dataloader, args.passes)
            assert got == 8 * args.passes, got
            # anyio.run's cancelled tasks leave a reference cycle (a CancelledError's traceback)
            # that keeps the main coroutine, and so this DataLoader, alive until a collection:
            # its persistent workers would live on, and the next case's forked workers would
            # inherit its iterator (torch's "can only test a child process" at their exit).
            del dataloader
            gc.collect()
            worst.append(longest)
            p99.append(tail)
        print(f"| {label} | {statistics.median(worst):.1f} | {statistics.median(p99):.2f} |")


if __name__ == "__main__":
    main()
