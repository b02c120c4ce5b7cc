"""Does a worker thread pay more per torch op than the main thread? The host cost of enqueuing
small CUDA ops (a bf16 linear of one token, the shape of a decode step) in: the main thread; a
worker thread while the event loop awaits it; the same with a manager open (its waiter and
reaper threads alive), per event waiter; and a worker thread running while the loop runs a
streamed call's bookkeeping. A streamed model's forward runs in such a worker thread.

usage: python3 benchmarks/diag_thread_ops.py [--ops 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aresidency import ResidencyManager
from aresidency.backends import CudaBackend
from aresidency.backends.waiter import EventWaiter


def ops(n: int, device: str) -> float:
    """us of host time per op for ``n`` small linears (enqueued only: no sync inside)."""
    x = torch.randn(1, 512, device=device, dtype=torch.bfloat16)
    w = torch.randn(512, 512, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(200):
            torch.nn.functional.linear(x, w)
        start = time.perf_counter()
        for _ in range(n):
            torch.nn.functional.linear(x, w)
        elapsed = time.perf_counter() - start
    if device != "cpu":
        torch.cuda.synchronize()
    return elapsed / n * 1e6


async def main(args: argparse.Namespace) -> None:
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    n = args.ops
    pool = concurrent.futures.ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()
    rows: list[tuple[str, float]] = []
    rows.append(("main thread", ops(n, device)))
    rows.append(("worker, loop awaiting", await loop.run_in_executor(pool, ops, n, device)))
    waiters = ["auto", "hybrid", "hostfunc", "poll", "blocking"] if device != "cpu" else []
    for kind in waiters:
        try:
            backend = CudaBackend(waiter=EventWaiter(kind))
        except Exception as error:  # a strategy this machine lacks
            rows.append((f"worker, manager open, waiter {kind}: {error!r}", float("nan")))
            continue
        async with ResidencyManager(backend=backend):
            rows.append(
                (
                    f"worker, manager open, waiter {kind}",
                    await loop.run_in_executor(pool, ops, n, device),
                )
            )
    rows.append(("main thread again", ops(n, device)))
    print(f"{device}, {n} ops each: host us per op")
    for name, us in rows:
        print(f"  {name:45s} {us:7.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000)
    asyncio.run(main(parser.parse_args()))
