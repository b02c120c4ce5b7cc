"""Where the time of a device-to-pageable copy goes, and what the host can do about it.

A diagnostic, not a benchmark of aresidency: it times the host-side pieces a staged
device-to-host copy is made of, on the GPU machine, so that the staging design rests on
measurements of that machine (transparent huge pages, memcpy threads, page faults, small copies
in flight, on-loop polling of an event).

    python3 benchmarks/diag_copy_paths.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import mmap
import os
import statistics
import time
from pathlib import Path

import torch

MB = 1 << 20
N = 1024 * MB


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"({exc})"


def fresh_malloc(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def fresh_mmap(n: int, huge: bool, private: bool = True) -> torch.Tensor:
    flags = (mmap.MAP_PRIVATE if private else mmap.MAP_SHARED) | mmap.MAP_ANONYMOUS
    m = mmap.mmap(-1, n, flags=flags)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    exporter = (ctypes.c_uint8 * n).from_buffer(m)
    return torch.frombuffer(exporter, dtype=torch.uint8)


def gbps(n: int, seconds: list[float]) -> str:
    return f"{n / statistics.median(seconds) / 1e9:6.1f} GB/s"


def timed(fn, iters: int = 4) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    print("cpus", os.cpu_count(), "torch threads", torch.get_num_threads())
    print("THP enabled:", read("/sys/kernel/mm/transparent_hugepage/enabled"))
    print("THP defrag:", read("/sys/kernel/mm/transparent_hugepage/defrag"))
    print("model:", [ln for ln in read("/proc/cpuinfo").splitlines() if "model name" in ln][:1])
    print("numa nodes:", read("/sys/devices/system/node/online"))
    src = torch.empty(N, dtype=torch.uint8, pin_memory=True)
    src.fill_(7)
    pool = concurrent.futures.ThreadPoolExecutor(16)

    def parallel_copy(dst: torch.Tensor, threads: int) -> None:
        step = -(-N // threads)
        futs = [pool.submit(dst[i : i + step].copy_, src[i : i + step]) for i in range(0, N, step)]
        for f in futs:
            f.result()

    # 1. pinned -> pageable memcpy, fresh vs pre-faulted destination, torch copy_ vs threads
    for label, make in (
        ("malloc", lambda: fresh_malloc(N)),
        ("shared mmap", lambda: fresh_mmap(N, False, private=False)),
        ("private mmap", lambda: fresh_mmap(N, False)),
        ("private mmap+MADV_HUGEPAGE", lambda: fresh_mmap(N, True)),
    ):
        for threads in (1, 8):
            fresh = []
            warm = []
            for _ in range(3):
                dst = make()
                t0 = time.perf_counter()
                if threads == 1:
                    dst.copy_(src)
                else:
                    parallel_copy(dst, threads)
                fresh.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                if threads == 1:
                    dst.copy_(src)
                else:
                    parallel_copy(dst, threads)
                warm.append(time.perf_counter() - t0)
                del dst
            print(
                f"pinned->pageable 1 GB {label:20s} threads {threads:2d}: fresh {gbps(N, fresh)}"
                f"  faulted {gbps(N, warm)}"
            )
    # 1b. the host side of both staging lanes at once: pageable -> pinned (host-to-device) and
    # pinned -> pageable (device-to-host), into memory already faulted in, N threads each; the
    # ceiling of "both directions, pageable" whatever the link does
    up_src = fresh_malloc(N)
    up_src.fill_(3)
    up_dst = torch.empty(N, dtype=torch.uint8, pin_memory=True)
    down_dst = fresh_malloc(N)
    down_dst.fill_(0)
    both = concurrent.futures.ThreadPoolExecutor(2)

    def copy_with(dst: torch.Tensor, source: torch.Tensor, threads: int) -> None:
        step = -(-N // threads)
        futs = [
            pool.submit(dst[i : i + step].copy_, source[i : i + step]) for i in range(0, N, step)
        ]
        for f in futs:
            f.result()

    for threads in (4, 8):
        t = timed(lambda threads=threads: copy_with(up_dst, up_src, threads), 3)
        print(f"pageable->pinned 1 GB faulted, threads {threads:2d}: {gbps(N, t)}")

        def at_once(threads: int = threads) -> None:
            a = both.submit(copy_with, up_dst, up_src, threads)
            b = both.submit(copy_with, down_dst, src, threads)
            a.result()
            b.result()

        t = timed(at_once, 3)
        print(
            f"both at once, 1 GB each way, faulted, threads {threads:2d} each: "
            f"{gbps(2 * N, t)} total"
        )

    # 2. allocation cost alone
    for label, make in (
        ("malloc", fresh_malloc),
        ("private mmap+huge", lambda n: fresh_mmap(n, True)),
    ):
        t = timed(lambda make=make: make(N).fill_(0), 3)
        print(f"fresh {label} + fill_(0) 1 GB: {gbps(N, t)}")

    torch.cuda.synchronize()
    dev = torch.empty(N, dtype=torch.uint8, device="cuda")
    t = timed(lambda: dev.cpu(), 3)
    print(f"torch dev.cpu() 1 GB: {gbps(N, t)}")
    stream = torch.cuda.Stream()

    # 5. small copy latency, seen by on-loop polling vs a thread hop
    small_host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    small_dev = torch.empty(4096, dtype=torch.uint8, device="cuda")

    async def loop_poll() -> list[float]:
        loop = asyncio.get_running_loop()
        out = []
        for _ in range(200):
            fut = loop.create_future()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                small_dev.copy_(small_host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)

            def poll(ev=ev, fut=fut) -> None:
                if ev.query():
                    fut.set_result(None)
                else:
                    loop.call_soon(poll)

            loop.call_soon(poll)
            await fut
            out.append(time.perf_counter() - t0)
        return out

    lat = asyncio.run(loop_poll())
    print(
        f"4 KiB h2d, issue -> task resumed, on-loop polling (asyncio): median "
        f"{statistics.median(lat) * 1e6:.1f} us p90 {sorted(lat)[180] * 1e6:.1f} us"
    )
    spins = []
    for _ in range(200):
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            small_dev.copy_(small_host, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        while not ev.query():
            pass
        spins.append(time.perf_counter() - t0)
    print(
        "4 KiB h2d, issue -> seen by a spinning query: median "
        f"{statistics.median(spins) * 1e6:.1f} us"
    )
    t0 = time.perf_counter()
    for _ in range(10000):
        ev.query()
    print(f"event.query() cost: {(time.perf_counter() - t0) / 10000 * 1e6:.2f} us")


if __name__ == "__main__":
    main()
