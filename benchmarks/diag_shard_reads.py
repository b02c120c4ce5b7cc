"""How fast this host reads shard files into (pinned) buffers, without the GPU's compute: the
ceiling of ``ShardSource`` behind a ``DeviceLoader``.

Writes ``--gib`` GiB of ``.npy`` shards (in the page cache afterwards), then reads every batch
of ``--batch-mib`` MiB with ``ShardSource.read_into`` from ``N`` threads at once, each into a
buffer of its own, for N in ``--threads``; once with ``preadv`` (the default path) and once
copying from the files' mapping (``--mapping``). With ``--with-dma`` the same again while a
side thread keeps the link busy copying a pinned buffer to ``cuda:0`` (the DMA reads host
memory too), which is what the loader's reads compete with. GB/s of batches read.

    python3 benchmarks/diag_shard_reads.py
    python3 benchmarks/diag_shard_reads.py --threads 1,4,8,16 --gib 2 --with-dma
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aresidency.loader import ShardSource
from aresidency.loader import shards as shards_module

MiB = 1 << 20
ROW = 1024  # float32 per row


def write(directory: Path, gib: float) -> list[Path]:
    rows = int(gib * (1 << 30)) // (ROW * 4)
    paths = []
    per = -(-rows // 8)
    for number in range(8):
        path = directory / f"x-{number:03d}.npy"
        np.save(path, np.full((min(per, rows - number * per), ROW), float(number), np.float32))
        paths.append(path)
    return paths


def buffers(count: int, nbytes: int, pin: bool) -> list[torch.Tensor]:
    out = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]
    if pin:
        out = [b.pin_memory() for b in out]
    for b in out:
        b.fill_(0)  # faulted in before timing
    return out


def read_rate(source: ShardSource, threads: int, space: list[torch.Tensor]) -> float:
    plans = source.plan_epoch()
    nbytes = sum(source.batch_nbytes(p.rows) for p in plans)
    local = threading.local()
    free = list(space)
    lock = threading.Lock()

    def read(plan: object) -> None:
        if not hasattr(local, "buffer"):
            with lock:
                local.buffer = free.pop()
        source.read_into(plan, local.buffer)  # type: ignore[arg-type]

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(read, plans))
        elapsed = time.perf_counter() - start
    return nbytes / elapsed / 1e9


def dma_load(stop: threading.Event, moved: list[tuple[float, float, int]]) -> None:
    """Keep the host-to-device link busy (64 MiB pinned -> cuda:0, back to back); notes each
    batch of copies as (start, end, bytes)."""
    src = torch.empty(64 * MiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        while not stop.is_set():
            start = time.perf_counter()
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
            moved.append((start, time.perf_counter(), 4 * 64 * MiB))


def dma_rate(moved: list[tuple[float, float, int]], start: float, end: float) -> float:
    """GB/s of the copy batches that ran entirely within [start, end]."""
    inside = [(a, b, n) for a, b, n in moved if a >= start and b <= end]
    if not inside:
        return 0.0
    return sum(n for _, _, n in inside) / (inside[-1][1] - inside[0][0]) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--batch-mib", type=int, default=16)
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--with-dma", action="store_true")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    counts = [int(t) for t in args.threads.split(",")]
    batch_rows = args.batch_mib * MiB // (ROW * 4)
    print(
        f"host reads of {args.gib} GiB of .npy shards, {args.batch_mib} MiB batches, "
        f"{'pinned' if gpu else 'pageable'} buffers, torch {torch.__version__}"
    )
    loads = [False, True] if args.with_dma and gpu else [False]
    with tempfile.TemporaryDirectory() as tmp:
        paths = write(Path(tmp), args.gib)
        with ShardSource(paths, batch_size=batch_rows, drop_last=True) as source:
            read_rate(source, 4, buffers(4, source.max_batch_nbytes, False))  # page cache warm
            space = buffers(max(counts), source.max_batch_nbytes, gpu)
            print("| threads | path | DMA at once | GB/s read | DMA GB/s |")
            print("|---|---|---|---|---|")
            for dma in loads:
                for path in ("preadv", "mapping"):
                    shards_module.PREAD = path == "preadv"
                    with ShardSource(paths, batch_size=batch_rows, drop_last=True) as run:
                        for threads in counts:
                            stop = threading.Event()
                            moved: list[tuple[float, float, int]] = []
                            side = threading.Thread(target=dma_load, args=(stop, moved))
                            if dma:
                                side.start()
                                time.sleep(0.2)
                            start = time.perf_counter()
                            rate = read_rate(run, threads, space)
                            end = time.perf_counter()
                            stop.set()
                            if dma:
                                side.join()
                            link = dma_rate(moved, start, end) if dma else 0.0
                            print(
                                f"| {threads} | {path} | {'yes' if dma else 'no'} | "
                                f"{rate:.1f} | {link:.1f} |",
                                flush=True,
                            )


if __name__ == "__main__":
    main()
