"""Peer copies cuda:0 -> cuda:1 split across streams: does a copy split into chunks on several
streams beat one ``copy_``? Plain torch only, no aresidency: the measurement that decides how
the backend should issue peer copies (torch runs a peer ``copy_`` on the source device's
current stream and makes the destination's current stream wait for it).

    python3 benchmarks/diag_peer_chunks.py            # needs two GPUs (nvidia-h200-x2)

Prints GB/s (median of ``--iters``) per size: one ``copy_`` on one stream (what torch does),
then ``k`` chunks, each on its own pair of streams."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], None], iters: int) -> float:
    times = []
    for _ in range(iters + 2):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def measure(mib: int, streams: dict[int, list[torch.cuda.Stream]], iters: int) -> str:
    n = mib << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")

    def single() -> None:
        dst.copy_(src, non_blocking=True)

    def split(k: int) -> Callable[[], None]:
        step = -(-n // k)

        def run() -> None:
            for c in range(k):
                with torch.cuda.stream(streams[0][c]), torch.cuda.stream(streams[1][c]):
                    dst[c * step : (c + 1) * step].copy_(
                        src[c * step : (c + 1) * step], non_blocking=True
                    )

        return run

    row = [f"{mib:>5} MiB  single {n / timed(single, iters) / 1e9:7.1f}"]
    for k in (2, 4):
        row.append(f"x{k} {n / timed(split(k), iters) / 1e9:7.1f}")
    assert torch.equal(dst.cpu(), src.cpu())
    return "  ".join(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4,64,256,1024", help="MiB, comma-separated")
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1), flush=True)
    streams = {d: [torch.cuda.Stream(device=d) for _ in range(4)] for d in (0, 1)}
    for mib in (int(s) for s in args.sizes.split(",")):
        print(measure(mib, streams, args.iters), flush=True)


if __name__ == "__main__":
    main()
