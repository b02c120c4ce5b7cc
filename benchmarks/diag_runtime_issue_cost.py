"""The runtime's own host cost of issuing a copy, without the backend's: ``--count`` values
materialized at ``cuda:0`` with ``materialize_nowait``, the backend's ``copy_many`` timed apart
and subtracted (collector off while issuing), median of ``--rounds``. Then, with ``--loader``,
how much a ring ``DeviceLoader``'s loop thread does per batch (CPU time and Python calls under
``cProfile``, batches of ``--batch-mib``).

    python3 benchmarks/diag_runtime_issue_cost.py                # CUDA if present, else sim
    python3 benchmarks/diag_runtime_issue_cost.py --backend sim --loader

On the simulated backend (CUDA simulated in host memory) the runtime's part is the same Python
as on a GPU; the backend's part is the simulation's, not CUDA's."""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import time
from typing import Any

import anyio
import torch

from aresidency import ReplicaMode, ResidencyManager
from aresidency.loader import DeviceLoader


async def issue_cost(args: argparse.Namespace, backend: str) -> None:
    async with ResidencyManager(backend=backend) as m:
        be: Any = m.backend
        spent = [0.0]
        copy_many = be.copy_many

        def timed(requests: Any) -> Any:
            start = time.perf_counter()
            try:
                return copy_many(requests)
            finally:
                spent[0] += time.perf_counter() - start

        be.copy_many = timed
        pin = backend == "cuda"
        handles = []
        for i in range(args.count):
            source = torch.empty(args.numel)
            handles.append(
                m.register(
                    source.pin_memory() if pin else source,
                    name=f"v{i}",
                    replica_mode=ReplicaMode.REPLICABLE,
                )
            )
        rows = []
        for _ in range(args.rounds):
            gc.collect()
            gc.disable()
            spent[0] = 0.0
            start = time.perf_counter()
            pending = [m.materialize_nowait(h, "cuda:0") for h in handles]
            issued = time.perf_counter() - start
            gc.enable()
            for p in pending:
                await p
            for p in [m.release_nowait(h, "cuda:0") for h in handles]:
                await p
            rows.append(((issued - spent[0]) / args.count * 1e6, spent[0] / args.count * 1e6))
        runtime = statistics.median(r[0] for r in rows)
        own = statistics.median(r[1] for r in rows)
        print(
            f"backend {backend}: {args.count} copies of {args.numel * 4} B per round, "
            f"{args.rounds} rounds: runtime {runtime:.1f} us per copy, backend copy_many "
            f"{own:.1f} us per copy"
        )


async def loader_cost(args: argparse.Namespace, backend: str) -> None:
    numel = args.batch_mib << 18
    data = [torch.randn(numel) for _ in range(16)]
    batches = 400
    async with ResidencyManager(budgets={"cuda:0": 64 << 20}, backend=backend) as m:
        source = (data[i % 16] for i in range(batches))
        async with DeviceLoader(m, source, "cuda:0", prefetch=2) as loader:
            iterator = loader.__aiter__()
            await iterator.__anext__()
            profile = cProfile.Profile()
            cpu = time.thread_time()
            profile.enable()
            count = 1
            async for _ in iterator:
                count += 1
            profile.disable()
            cpu = time.thread_time() - cpu
    calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    print(
        f"loader ({backend}, ring, {args.batch_mib} MiB batches): loop thread "
        f"{cpu / count * 1e6:.0f} us CPU per batch under cProfile, {calls / count:.0f} Python "
        "calls per batch"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("auto", "sim", "cuda"), default="auto")
    parser.add_argument("--count", type=int, default=512)
    parser.add_argument("--numel", type=int, default=1024, help="float32 elements per value")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loader", action="store_true")
    parser.add_argument("--batch-mib", type=int, default=1)
    args = parser.parse_args()
    gpu = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    backend = "cuda" if gpu else "sim"
    anyio.run(issue_cost, args, backend)
    if args.loader:
        anyio.run(loader_cost, args, backend)


if __name__ == "__main__":
    main()
