"""Automatic Example 17: a DataLoader's batches are on the GPU before the step asks, in a budget.

A training loop iterates ``DeviceLoader(manager, DataLoader(...), "cuda:0", prefetch=2)``
instead of the ``DataLoader`` itself. The loader's own thread copies each batch into device
slots that are charged to the ``cuda:0`` budget, two batches ahead of the step, and gives each
slot back once the step's kernels that read it have run (events, no synchronize). Batches from
the ``DataLoader``'s worker processes arrive in shared memory; the loader gives that memory back
without holding the interpreter lock, so the event loop keeps running on time.

Runs on a GPU when there is one (backend "auto") and on the simulated backend otherwise, which
makes ``cuda:N`` out of host memory (a simulation, said so in the output; smaller batches).

    python examples/17_data_loader.py
"""

from __future__ import annotations

import asyncio

import torch
from torch.utils.data import DataLoader, Dataset

from aresidency import ResidencyManager
from aresidency.loader import DeviceLoader

MiB = 1 << 20


class Samples(Dataset[dict[str, torch.Tensor]]):
    """Deterministic batches: features from a seeded generator, and the batch's number."""

    def __init__(self, count: int, numel: int) -> None:
        self.count = count
        self.numel = numel

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(i)
        return {"x": torch.randn(self.numel, generator=generator), "i": torch.tensor(i)}


async def main() -> None:
    on_gpu = torch.cuda.is_available()
    batch_mib = 16 if on_gpu else 1
    numel = batch_mib * MiB // 4
    count = 24
    budget = 4 * batch_mib * MiB  # room for prefetch=2 batches, the one in use, and one more
    source = DataLoader(
        Samples(count, numel),
        batch_size=None,
        num_workers=2,
        # Workers forked from a process that started CUDA would crash: start them clean.
        multiprocessing_context="forkserver" if on_gpu else None,
    )
    sums: list[torch.Tensor] = []  # one per step, left on the device (nothing waits for it)
    async with ResidencyManager(budgets={"cuda:0": budget}) as manager:
        note = "" if on_gpu else " (a simulation of CUDA devices made of host memory)"
        print(f"backend: {manager.backend.name}{note}")
        in_order = True
        async with DeviceLoader(manager, source, "cuda:0", prefetch=2) as loader:
            async for batch in loader:
                in_order &= int(batch["i"]) == len(sums)
                sums.append((batch["x"] * 2).sum())  # the step: kernels that read the batch
            stats = loader.stats()
        snapshot = manager.snapshot().location("cuda:0")
        device = sums[0].device
        # The same kernels on the source's own batches, copied plainly: equal bit for bit.
        samples = Samples(count, numel)
        expected = [(samples[i]["x"].to(device) * 2).sum() for i in range(count)]
        print(f"{len(sums)} batches of {batch_mib} MiB, in order: {in_order}")
        same = all(torch.equal(a, b) for a, b in zip(sums, expected, strict=True))
        print(f"every step read its batch as the source made it: {same}")
        print(
            f"peak at cuda:0 {snapshot.peak_bytes // MiB} MiB within the budget of "
            f"{budget // MiB} MiB: {snapshot.peak_bytes <= budget}"
        )
        print(f"nothing left at cuda:0 after the loader closed: {snapshot.used_bytes == 0}")
        print(stats)


if __name__ == "__main__":
    asyncio.run(main())
