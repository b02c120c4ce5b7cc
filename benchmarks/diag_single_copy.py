"""Where a single large pinned -> cuda copy loses time against plain torch (needs a GPU).

For each size, three ways, alternating, ``--iters`` rounds each (median):

* ``torch``: ``src.to("cuda:0", non_blocking=True)`` on a side stream, then
  ``stream.synchronize()`` (as ``bench_copy.py``'s plain-torch cell);
* ``backend``: ``CudaBackend.copy`` then ``await transfer.wait()`` (as its backend cell);
* ``manager``: ``await manager.materialize(handle, "cuda:0")`` (its manager cell; released after).

Each round also records timing events on the stream that runs the copy, right before and right
after it is enqueued, so the row splits the wall time into: ``issue`` (host time to enqueue),
``device`` (the copy itself, by the events), and ``seen`` (from the copy's end on the device
until the awaiting code resumed: wall - device - the device's start delay). If ``device``
differs between the rows the copy itself is slower; if ``seen`` does, the wake-up is.

    python3 benchmarks/diag_single_copy.py [--sizes 64,1024] [--iters 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aresidency import ReplicaMode, ResidencyManager
from aresidency.backends import CudaBackend
from aresidency.backends.cuda import copy_streams
from aresidency.core.locations import Location

MB = 1 << 20
PINNED, CUDA0 = Location.parse("pinned-host"), Location.parse("cuda:0")


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


async def main(args: argparse.Namespace) -> None:
    backend = CudaBackend()
    backend.start()
    h2d = copy_streams(0).h2d
    side = torch.cuda.Stream()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    async with ResidencyManager(backend="cuda") as m:
        m_h2d = copy_streams(0).h2d
        for mb in [int(s) for s in args.sizes.split(",")]:
            n = mb * MB
            src = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory()
            handle = m.register(src, location="pinned-host", replica_mode=ReplicaMode.REPLICABLE)
            rows: dict[str, list[tuple[float, float, float]]] = {
                "torch": [],
                "backend": [],
                "manager": [],
            }

            async def one(
                kind: str, src: torch.Tensor = src, handle: object = handle
            ) -> tuple[float, float, float]:
                stream = {"torch": side, "backend": h2d, "manager": m_h2d}[kind]
                start, end = timing_event(), timing_event()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if kind == "torch":
                    with torch.cuda.stream(side):
                        start.record(side)
                        out = src.to("cuda:0", non_blocking=True)
                        end.record(side)
                    t1 = time.perf_counter()
                    side.synchronize()
                    t2 = time.perf_counter()
                    del out
                elif kind == "backend":
                    start.record(stream)
                    transfer = backend.copy(src, PINNED, CUDA0)
                    end.record(stream)
                    t1 = time.perf_counter()
                    await transfer.wait()
                    t2 = time.perf_counter()
                    backend.free(transfer.tensor, CUDA0)
                else:
                    start.record(stream)
                    op = m.materialize_nowait(handle, "cuda:0")  # type: ignore[arg-type]
                    end.record(stream)
                    t1 = time.perf_counter()
                    await op
                    t2 = time.perf_counter()
                    await m.release(handle, "cuda:0")
                torch.cuda.synchronize()
                device = start.elapsed_time(end) / 1e3
                return t1 - t0, device, t2 - t0

            for kind in rows:  # warm-up
                await one(kind)
            for _ in range(args.iters):
                for kind in rows:
                    rows[kind].append(await one(kind))
            print(f"\n{mb} MB (median of {args.iters}):")
            print(f"  {'':8s} {'wall ms':>9s} {'GB/s':>7s} {'issue us':>9s} {'device ms':>10s}")
            for kind, samples in rows.items():
                wall = statistics.median(s[2] for s in samples)
                issue = statistics.median(s[0] for s in samples)
                device = statistics.median(s[1] for s in samples)
                print(
                    f"  {kind:8s} {wall * 1e3:9.3f} {n / wall / 1e9:7.1f} {issue * 1e6:9.1f} "
                    f"{device * 1e3:10.3f}  (device GB/s {n / device / 1e9:.1f}, "
                    f"wall - device {(wall - device) * 1e6:.0f} us)"
                )
            await m.discard(handle)
    await backend.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,1024", help="MB")
    parser.add_argument("--iters", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
