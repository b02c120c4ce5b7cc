"""How late the event loop wakes while other threads read files: the interpreter-lock side of
the loader's loop lag over shards, without the loader, the GPU or torch.

Each of N threads reads a page-cached file in a loop with ``os.preadv`` (which releases the
interpreter lock, as the loader's reading threads do) and then makes ``--calls`` more cheap
system calls (each one another turn of the lock, as the open / fstat / close around each of
the loader's reads are). Meanwhile the loop sleeps 1 ms at a time and measures how late it
wakes. If the lag grows with N although every thread spends nearly all its time outside the
lock, the loop thread is losing the lock to the readers' turns, not waiting for CPU.

    python3 benchmarks/diag_loop_convoy.py [--threads 0,1,2,4,8,16] [--read-mib 4]
        [--calls 0,4] [--switch-interval-ms 5] [--uvloop]

Prints one markdown row per (threads, calls): loop lag p50 / p99 / max in ms, the reads' total
rate, and the lock turns per second the readers took.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def reader(path: Path, nbytes: int, calls: int, stop: threading.Event, done: list[int]) -> None:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    offset = reads = 0
    try:
        while not stop.is_set():
            os.preadv(fd, [view], offset)
            offset = (offset + nbytes) % max(1, size - nbytes)
            for _ in range(calls):
                os.getppid()
            reads += 1
    finally:
        os.close(fd)
        done.append(reads)


async def lag(path: Path, threads: int, nbytes: int, calls: int, seconds: float) -> str:
    stop = threading.Event()
    done: list[int] = []
    workers = [
        threading.Thread(target=reader, args=(path, nbytes, calls, stop, done), daemon=True)
        for _ in range(threads)
    ]
    for worker in workers:
        worker.start()
    lags: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        before = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - before - 0.001)
    elapsed = time.perf_counter() - start
    stop.set()
    for worker in workers:
        worker.join()
    reads = sum(done)
    q = statistics.quantiles(lags, n=100)
    rate = reads * nbytes / elapsed / 1e9
    turns = reads * (1 + calls) / elapsed
    return (
        f"| {threads} | {calls} | {q[49] * 1e3:.2f} | {q[98] * 1e3:.2f} | "
        f"{max(lags) * 1e3:.1f} | {rate:.1f} | {turns:.0f} |"
    )


def write(path: Path, mib: int) -> None:
    with open(path, "wb") as file:
        chunk = os.urandom(1 << 20)
        for _ in range(mib):
            file.write(chunk)
    path.read_bytes()  # into the page cache


async def main(args: argparse.Namespace, path: Path) -> None:
    nbytes = int(args.read_mib * (1 << 20))
    print(
        f"loop lag while threads read a cached file ({args.read_mib} MiB reads), "
        f"{os.cpu_count()} CPUs, switch interval {sys.getswitchinterval() * 1e3:.1f} ms, "
        f"{type(asyncio.get_running_loop()).__module__}"
    )
    print(
        "| threads | extra calls per read | lag p50 ms | lag p99 ms | max ms | GB/s read "
        "| lock turns/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for calls in (int(c) for c in args.calls.split(",")):
        for threads in (int(t) for t in args.threads.split(",")):
            print(await lag(path, threads, nbytes, calls, args.seconds), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="0,1,2,4,8,16")
    parser.add_argument("--read-mib", type=float, default=4.0)
    parser.add_argument("--calls", default="0,4")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--switch-interval-ms", type=float, default=None)
    parser.add_argument("--uvloop", action="store_true")
    arguments = parser.parse_args()
    if arguments.switch_interval_ms is not None:
        sys.setswitchinterval(arguments.switch_interval_ms / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.bin"
        write(data, int(max(4 * arguments.read_mib, 64)))
        if arguments.uvloop:
            import uvloop

            uvloop.run(main(arguments, data))
        else:
            asyncio.run(main(arguments, data))
