"""Odd batches through a ``DeviceLoader`` again and again, every handed-out tensor checked bit
for bit against what the source yielded: a hunt for a rare wrong read (a race between the
ring's thread, the copies and the consumer). Runs on the simulated backend (CUDA simulated in
host memory: freed and unfilled device memory reads as NaN or the byte 0xA5) unless
``--backend cuda``.

Each pass takes a random ``prefetch`` (0, 1, 2 or 4), the ring or managed values, and on even
seeds a consumer that sometimes sleeps up to 2 ms. ``--processes N`` runs the passes in N
fresh interpreters instead, one after the other (a process's first pass has timings the
later ones do not: imports, first kernels, new threads).

    python benchmarks/diag_loader_odd_batches.py --passes 2000
    python benchmarks/diag_loader_odd_batches.py --processes 40 --passes 2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import random
import subprocess
import sys
import time
from typing import Any

import torch

from aresidency import ResidencyManager
from aresidency.loader import DeviceLoader

Pair = collections.namedtuple("Pair", ["empty", "flags"])


@dataclasses.dataclass
class Tagged:
    x: torch.Tensor
    tag: str


def batches(seed: int) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.arange(64, dtype=torch.float32)
    twice = torch.arange(8.0)
    wide = torch.randn(48, 40, generator=generator)
    return [
        {"same": twice, "again": twice},
        [base[:16], base[16:48], base[48:]],
        (base[::3],),
        Pair(torch.zeros(0), torch.tensor([True, False, True])),
        Tagged(wide.t(), "meta"),
        {"n": 5, "s": "text", "none": None, "nested": {"deep": [torch.tensor(7)]}},
        torch.tensor([1 + 2j, 3 - 1j, -0.5j]),
        torch.arange(6.0).to(torch.bfloat16),
        wide[3:9, 5:30],
    ]


def leaves(batch: Any) -> list[Any]:
    if isinstance(batch, dict):
        return [x for v in batch.values() for x in leaves(v)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [x for f in dataclasses.fields(batch) for x in leaves(getattr(batch, f.name))]
    if isinstance(batch, (list, tuple)):
        return [x for v in batch for x in leaves(v)]
    return [batch]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


async def one_pass(seed: int, backend: str) -> str | None:
    """One pass; a description of the first wrong tensor, or None."""
    rnd = random.Random(seed)
    ring = rnd.choice([None, False])
    prefetch = rnd.choice([0, 1, 2, 4])
    want = batches(seed)
    manager = ResidencyManager(budgets={"cuda:0": 1 << 24}, backend=backend)
    async with (
        manager as m,
        DeviceLoader(m, batches(seed), "cuda:0", prefetch=prefetch, ring=ring) as ld,
    ):
        n = 0
        async for batch in ld:
            if seed % 2 == 0 and rnd.random() < 0.5:
                await asyncio.sleep(rnd.random() * 0.002)
            for position, (got, exp) in enumerate(zip(leaves(batch), leaves(want[n]), strict=True)):
                if not isinstance(exp, torch.Tensor):
                    if got != exp:
                        return f"seed {seed}: batch {n} leaf {position}: {got!r} != {exp!r}"
                    continue
                if not torch.equal(as_bytes(got), as_bytes(exp)):
                    return (
                        f"seed {seed} (ring={ring}, prefetch={prefetch}): batch {n} leaf "
                        f"{position}: got {got.detach().cpu().flatten()[:8].tolist()}, "
                        f"want {exp.flatten()[:8].tolist()}"
                    )
            n += 1
        if n != len(want):
            return f"seed {seed}: {n} batches of {len(want)}"
    return None


async def run(first: int, passes: int, backend: str) -> int:
    bad = 0
    for seed in range(first, first + passes):
        problem = await one_pass(seed, backend)
        if problem is not None:
            bad += 1
            print(problem, flush=True)
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--passes", type=int, default=1000, help="passes (per process)")
    parser.add_argument("--processes", type=int, default=0, help="fresh interpreters")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--backend", default="sim", choices=("sim", "cuda"))
    args = parser.parse_args()
    start = time.perf_counter()
    if args.processes:
        bad = 0
        for k in range(args.processes):
            seed = args.first_seed + k * args.passes
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--passes",
                    str(args.passes),
                    "--first-seed",
                    str(seed),
                    "--backend",
                    args.backend,
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            sys.stdout.write(done.stdout)
            bad += done.returncode != 0
        total = args.processes * args.passes
    else:
        bad = asyncio.run(run(args.first_seed, args.passes, args.backend))
        total = args.passes
    print(f"{bad} wrong of {total} passes ({args.backend}), {time.perf_counter() - start:.0f} s")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
