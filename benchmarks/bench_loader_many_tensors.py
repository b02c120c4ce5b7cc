"""The host's cost per batch when a batch holds many tensors (a dict of hundreds of small
features, as a recommender's or a tabular model's collate makes), through both copy paths.

On the simulated backend (a SIMULATION of CUDA devices in host memory: copies run on worker
threads at memory speed), so what is measured is the host's work per batch: the ring packs a
batch into one slot with one copy per tensor, while managed values (``ring=False``) register,
move, protect and release one value per tensor. Each row is the median of ``--repeats`` passes
of ``--batches`` batches, in ms per batch, with 256 float32 elements (1 KiB) per tensor.

    python3 benchmarks/bench_loader_many_tensors.py [--batches 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import torch

from aresidency import DeviceLoader, ResidencyManager
from aresidency.backends.sim import SimBackend

COUNTS = (25, 50, 100, 200)


async def ms_per_batch(tensors: int, ring: bool, batches: int) -> float:
    source = [
        {f"f{j}": torch.full((256,), float(i)) for j in range(tensors)} for i in range(batches)
    ]
    async with ResidencyManager(backend=SimBackend()) as manager:
        start = time.perf_counter()
        async with DeviceLoader(manager, source, "cuda:0", ring=ring) as loader:
            seen = 0
            async for batch in loader:
                if batch[f"f{tensors - 1}"][0].item() != seen:
                    raise AssertionError(f"batch {seen} is not the source's")
                seen += 1
        elapsed = time.perf_counter() - start
    if seen != batches:
        raise AssertionError(f"{seen} batches of {batches}")
    return elapsed / batches * 1e3


async def main(batches: int, repeats: int) -> None:
    print(f"torch {torch.__version__}; simulated backend (a SIMULATION); ms per batch")
    print("| tensors per batch | ring | managed values |")
    print("|---|---|---|")
    for count in COUNTS:
        cells = []
        for ring in (True, False):
            runs = [await ms_per_batch(count, ring, batches) for _ in range(repeats)]
            cells.append(f"{statistics.median(runs):.1f}")
        print(f"| {count} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    anyio.run(main, args.batches, args.repeats)
