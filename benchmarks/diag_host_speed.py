"""How fast this host runs what the runtime's host path is made of, to compare two machines:
pure Python calls, a system call, the event loop's own turn, a wake-up across threads and a
small torch call. A figure that is much slower on one machine than on another, relative to the
pure-Python row, names the cost that machine adds (a slower core moves every row alike; a
sandbox that intercepts system calls moves the system-call rows alone).

    python3 benchmarks/diag_host_speed.py            # a table, ns per operation (median of 7)
"""

from __future__ import annotations

import asyncio
import os
import platform
import select
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch


def _per_op_ns(fn: Callable[[int], None], n: int, repeats: int = 7) -> float:
    fn(max(1, n // 10))  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn(n)
        samples.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(samples)


def python_calls(n: int) -> None:
    def f(x: int) -> int:
        return x + 1

    d: dict[int, int] = {}
    for i in range(n):
        d[i & 63] = f(i)


def getppid(n: int) -> None:
    for _ in range(n):
        os.getppid()


def epoll_zero(n: int) -> None:
    ep = select.epoll()
    try:
        for _ in range(n):
            ep.poll(0)
    finally:
        ep.close()


def perf_counter(n: int) -> None:
    for _ in range(n):
        time.perf_counter()


def loop_turns(n: int) -> None:
    async def main() -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    asyncio.run(main())


def call_soon_threadsafe(n: int) -> None:
    """A callback handed to the loop through call_soon_threadsafe (from the loop's own thread:
    the self-pipe's write and read, and the loop's turn), one at a time."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(n):
            done = loop.create_future()
            loop.call_soon_threadsafe(done.set_result, None)
            await done

    asyncio.run(main())


def thread_ping_pong(n: int) -> None:
    """Two threads handing a turn back and forth through two threading.Event (futex waits)."""
    ping, pong = threading.Event(), threading.Event()

    def other() -> None:
        for _ in range(n):
            ping.wait()
            ping.clear()
            pong.set()

    t = threading.Thread(target=other)
    t.start()
    for _ in range(n):
        ping.set()
        pong.wait()
        pong.clear()
    t.join()


def torch_empty(n: int) -> None:
    for _ in range(n):
        torch.empty(1024)


def torch_copy(n: int) -> None:
    a, b = torch.empty(1024), torch.empty(1024)
    for _ in range(n):
        b.copy_(a)


def cuda_event_record_query(n: int) -> None:
    stream = torch.cuda.Stream()
    for _ in range(n):
        e = torch.cuda.Event()
        e.record(stream)
        e.query()


ROWS: list[tuple[str, Callable[[int], None], int]] = [
    ("a Python call and a dict store", python_calls, 200_000),
    ("time.perf_counter()", perf_counter, 200_000),
    ("os.getppid() (a system call)", getppid, 100_000),
    ("epoll.poll(0) (the loop's system call)", epoll_zero, 100_000),
    ("an asyncio loop turn (await sleep(0))", loop_turns, 50_000),
    ("call_soon_threadsafe + await", call_soon_threadsafe, 20_000),
    ("threading.Event ping-pong (one round trip)", thread_ping_pong, 5_000),
    ("torch.empty(1024) on the CPU", torch_empty, 50_000),
    ("copy_ of 4 KiB on the CPU", torch_copy, 50_000),
]


def main() -> None:
    rows = list(ROWS)
    if torch.cuda.is_available():
        rows.append(("torch.cuda.Event record + query", cuda_event_record_query, 20_000))
    print(
        f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print("| operation | ns per operation |")
    print("|---|---|")
    for label, fn, n in rows:
        print(f"| {label} | {_per_op_ns(fn, n):.0f} |", flush=True)


if __name__ == "__main__":
    main()
