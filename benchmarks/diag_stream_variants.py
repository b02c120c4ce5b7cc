"""Which setting closes the last percent between aresidency and hand-written double buffering?
(a diagnostic for benchmarks/bench_stream.py; needs a GPU)

    python3 benchmarks/diag_stream_variants.py [--workload anchor|copy-bound|compute-bound]

For each variant, aresidency and double buffering are timed in alternating rounds (the same
``paired`` measurement as bench_stream.py) and the median per-round ratio is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_stream import Device, MatMul, double_buffer, paired
from diag_stream_timeline import SHAPES

from aresidency import ResidencyManager, stream_module
from aresidency.backends import CudaBackend


async def variant(
    label: str,
    dev: Device,
    weights: list[torch.Tensor],
    x: torch.Tensor,
    *,
    waiter: str = "auto",
    prefetch: int = 2,
    no_gc: bool = False,
    rounds: int = 12,
) -> None:
    n = weights[0].shape[0]
    budget = (prefetch + 1) * n * n * 2
    backend = CudaBackend(waiter=waiter)
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as manager:
        model = nn.Sequential(*(MatMul(w) for w in weights))
        sm = stream_module(manager, model, "cuda:0", prefetch=prefetch, host="pinned-host")
        pinned = [m.weight.detach() for m in model if isinstance(m, MatMul)]
        bufs = [torch.empty(n, n, device="cuda:0", dtype=torch.bfloat16) for _ in range(2)]
        s = torch.cuda.Stream()
        with torch.no_grad():
            for _ in range(3):
                await sm(x)
                dev.sync()
                await sm.drain()
                double_buffer(dev, x, pinned, bufs, s)
        if no_gc:
            gc.collect()
            gc.disable()
        try:
            result: dict[str, Any] = await paired(
                dev,
                lambda: sm(x),
                sm.drain,
                lambda: double_buffer(dev, x, pinned, bufs, s),
                rounds,
            )
        finally:
            gc.enable()
        print(
            f"  {label:44s} aresidency {result['aresidency_ms']:7.2f} ms  double buffer "
            f"{result['double_buffer_ms']:7.2f} ms  ratio {result['ratio_median']:.4f}",
            flush=True,
        )
        await sm.aclose()


async def main(args: argparse.Namespace) -> None:
    layers, n, batch = SHAPES[args.workload]
    dev = Device(sim=False)
    torch.manual_seed(0)
    weights = [torch.randn(n, n, dtype=torch.bfloat16) * n**-0.5 for _ in range(layers)]
    x = torch.randn(batch, n, device="cuda:0", dtype=torch.bfloat16)
    print(f"== {args.workload}: {layers} x {n}x{n} bf16, batch {batch}")
    await variant("default (hybrid waiter, prefetch 2)", dev, weights, x)
    await variant("gc disabled during the rounds", dev, weights, x, no_gc=True)
    await variant("poll waiter (no host functions)", dev, weights, x, waiter="poll")
    await variant("prefetch 3, budget 4 layers", dev, weights, x, prefetch=3)
    await variant("prefetch 1, budget 2 layers", dev, weights, x, prefetch=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(SHAPES), default="anchor")
    asyncio.run(main(parser.parse_args()))
