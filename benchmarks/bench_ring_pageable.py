"""The loader's ring fed from pageable host memory without a ``DataLoader``: pinned twins
(``pack_min_bytes=0``: each batch packed into its slot's pinned twin in the ring's thread,
then one DMA) against the driver's own staging (``pack_min_bytes=None``: the pageable copy
waits for the copy stream first; the loader's default). The source is a list of pageable
tensors in memory, so the ring, not a ``DataLoader``'s workers, sets the pace.

    python3 benchmarks/bench_ring_pageable.py [--sizes 1,4,16,64] [--batches 64]

Prints batches/s per size for each way, and the same copies done by hand for scale
(``tensor.to(device, non_blocking=True)`` from the same pageable tensors, in order). Each
step sums its batch on the compute stream. Needs a GPU.
"""

from __future__ import annotations

import argparse
import time

import anyio
import torch

from aresidency import ResidencyManager
from aresidency.loader import DeviceLoader

MiB = 1 << 20


async def ring(data: list[torch.Tensor], twins: bool) -> tuple[float, int]:
    async with ResidencyManager(budgets={"cuda:0": 16 * max(t.nbytes for t in data)}) as m:
        pack = 0 if twins else None  # every pageable batch packed, or none
        async with DeviceLoader(m, data, "cuda:0", prefetch=4, pack_min_bytes=pack) as loader:
            torch.cuda.synchronize()
            start = time.perf_counter()
            sums = [batch.sum() async for batch in loader]
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            packed = loader.stats().packed_bytes
    assert len(sums) == len(data)
    return len(data) / elapsed, packed


def by_hand(data: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for tensor in data:
        tensor.to("cuda:0", non_blocking=True).sum()
    torch.cuda.synchronize()
    return len(data) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default="1,4,16,64", help="batch sizes in MiB")
    parser.add_argument("--batches", type=int, default=64)
    args = parser.parse_args()
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; at least {args.batches} "
        "batches (256 MiB in all for small ones); best of two alternating runs each"
    )
    print("\n| batch | ring, pinned twins | ring, driver staging | .to(non_blocking) by hand |")
    print("|---|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        count = max(args.batches, 256 // size)  # small batches: enough for a steady rate
        data = [torch.full((size * MiB // 4,), float(i)) for i in range(count)]
        by_hand(data[:4])  # warm-up
        rates = {}
        for twins in (True, False, True, False):  # alternating: the host's speed drifts
            rate, packed = anyio.run(ring, data, twins)
            assert (packed > 0) == twins
            rates.setdefault(twins, []).append(rate)
        hand = by_hand(data)
        print(f"| {size} MiB | {max(rates[True]):.0f} | {max(rates[False]):.0f} | {hand:.0f} |")


if __name__ == "__main__":
    main()
