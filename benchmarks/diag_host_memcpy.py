"""How fast the host copies memory, the part of a pageable transfer the GPU cannot speed up.

A pageable copy through the staging pool is two copies: the DMA between a pinned buffer and the
device, and a host memcpy between that buffer and the pageable tensor. This script measures the
second alone, on the machine it runs on, in the shapes the staging lanes use: ``--total`` bytes
copied from a pinned buffer (page-locked when CUDA is present; plain memory otherwise) into a
pageable destination, in pieces of ``P`` bytes spread over ``T`` threads (``ctypes.memmove``,
which runs without the GIL, as the device-to-host lane's memcpy threads do), and by torch's own
``copy_`` (as the host-to-device lane fills its buffers). Destinations: already faulted in
(kept, as the pageable cache gives them) or fresh (a new private mapping each round, as a new
destination is). ``--both`` runs two copies at once, one each way (pageable -> pinned and
pinned -> pageable), as a transfer in each direction does.

GB/s = bytes copied / wall time, median of ``--repeat``. Prints the machine's CPUs, NUMA nodes,
transparent huge page setting and glibc version beside the table, since every figure depends
on them. Needs no GPU (but pins its buffers when one is there).

    python3 benchmarks/diag_host_memcpy.py
    GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000 \
        python3 benchmarks/diag_host_memcpy.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import mmap
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

MB = 1 << 20
_MADV_HUGEPAGE = 14


def machine() -> str:
    lines = [f"{os.cpu_count()} CPUs, glibc {platform.libc_ver()[1]}, torch {torch.__version__}"]
    lines.append(f"torch threads {torch.get_num_threads()}")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():
        lines.append(f"THP {thp.read_text().strip()}")
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    lines.append(f"NUMA nodes {len(nodes)}")
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.split(":")[0].strip() in ("Model name", "L3 cache", "Socket(s)"):
                lines.append(" ".join(line.split()))
    except (OSError, subprocess.SubprocessError):
        pass
    tunables = os.environ.get("GLIBC_TUNABLES")
    if tunables:
        lines.append(f"GLIBC_TUNABLES={tunables}")
    return "; ".join(lines)


def pinned(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    if torch.cuda.is_available():
        t = t.pin_memory()
    t.fill_(1)
    return t


def fresh(nbytes: int, huge: bool) -> torch.Tensor:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        m.madvise(_MADV_HUGEPAGE)
    buf = (ctypes.c_uint8 * nbytes).from_buffer(m)
    return torch.frombuffer(buf, dtype=torch.uint8)


def memmove_pieces(
    pool: concurrent.futures.ThreadPoolExecutor, dst: torch.Tensor, src: torch.Tensor, piece: int
) -> None:
    n = src.numel()
    d, s = dst.data_ptr(), src.data_ptr()
    futures = [
        pool.submit(ctypes.memmove, d + off, s + off, min(piece, n - off))
        for off in range(0, n, piece)
    ]
    for f in futures:
        f.result()


def timed(fn: Callable[[], None], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=1024, help="MB copied per round")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--pieces", default="1,4,32", help="MB per memmove")
    parser.add_argument("--both", action="store_true", help="also two copies at once")
    args = parser.parse_args()
    n = args.total * MB
    print(machine(), flush=True)
    src = pinned(n)
    kept = torch.empty(n, dtype=torch.uint8)
    kept.fill_(0)
    rows: list[tuple[str, float]] = []

    def row(name: str, seconds: float) -> None:
        rows.append((name, n / seconds / 1e9))
        print(f"  {name:60s} {n / seconds / 1e9:7.1f} GB/s", flush=True)

    row("torch copy_, pinned -> kept", timed(lambda: kept.copy_(src), args.repeat))
    row("torch copy_, kept -> pinned", timed(lambda: src.copy_(kept), args.repeat))
    row(
        "torch copy_, pinned -> fresh (huge pages)",
        timed(lambda: fresh(n, True).copy_(src), args.repeat),
    )
    row(
        "torch copy_, pinned -> fresh (4 KiB pages)",
        timed(lambda: fresh(n, False).copy_(src), args.repeat),
    )
    for threads in [int(t) for t in args.threads.split(",")]:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for piece_mb in [int(p) for p in args.pieces.split(",")]:
                piece = piece_mb * MB
                row(
                    f"memmove {threads:2d} threads, {piece_mb:2d} MB pieces, -> kept",
                    timed(lambda: memmove_pieces(pool, kept, src, piece), args.repeat),  # noqa: B023
                )
            row(
                f"memmove {threads:2d} threads, 4 MB pieces, -> fresh (huge pages)",
                timed(lambda: memmove_pieces(pool, fresh(n, True), src, 4 * MB), args.repeat),
            )
    if args.both:
        other = pinned(n)
        back = torch.empty(n, dtype=torch.uint8)
        back.fill_(2)
        for threads in (4, 8):
            with (
                concurrent.futures.ThreadPoolExecutor(threads) as up,
                concurrent.futures.ThreadPoolExecutor(threads) as down,
            ):

                def both() -> None:
                    a = threading.Thread(target=memmove_pieces, args=(up, other, back, 4 * MB))
                    a.start()
                    memmove_pieces(down, kept, src, 4 * MB)
                    a.join()

                # Both directions: 2n bytes moved per round.
                seconds = timed(both, args.repeat)
                rows.append((f"both ways, {threads} threads each", 2 * n / seconds / 1e9))
                print(
                    f"  {'both ways (total), ' + str(threads) + ' threads each':60s} "
                    f"{2 * n / seconds / 1e9:7.1f} GB/s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
