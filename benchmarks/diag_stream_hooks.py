"""Where the host time of a streamed Llama forward goes: cProfile of the thread that runs the
forward, for aresidency (its worker thread, through the streaming hooks) and for the hand-written
double buffer of bench_stream.py (the main thread), on the same model, in one process.

usage: python3 benchmarks/diag_stream_hooks.py [--workload llama-6MiB] [--calls 5] [--no-ring]

Prints ms per call and the top functions by own time for each; on a machine without a GPU it
runs the simulated backend's tiny workload (a smoke test of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_stream as bs

from aresidency import ResidencyManager
from aresidency.integrations import stream_module
from aresidency.integrations.streaming.runners import ThreadedRunner


def top(profile: cProfile.Profile, n: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


async def main(args: argparse.Namespace) -> None:
    dev = bs.Device(sim=not torch.cuda.is_available())
    workloads = {wl.name: wl for wl in bs.llama_workloads(dev.sim)}
    wl = workloads.get(args.workload) or next(iter(workloads.values()))
    model = bs.build_llama(wl, "cpu" if dev.sim else "cuda:0")
    ids = torch.randint(3, wl.vocab, (1, wl.prompt), device=dev.name)
    print(f"{wl.name}: {wl.layers} layers, {'SIMULATED backend' if dev.sim else 'cuda'}")

    # the hand-written double buffer, profiled in the main thread
    import copy

    hand = bs.HandDoubleBuffer(dev, copy.deepcopy(model))
    prefill, _ = bs.decode_fns(hand.model, ids)
    with torch.no_grad():
        for _ in range(2):
            prefill()
        dev.sync()
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for _ in range(args.calls):
            prefill()
        profile.disable()
        dev.sync()
    print(f"\n== double buffer: {(time.perf_counter() - start) * 1e3 / args.calls:.1f} ms/call")
    print(top(profile))
    del hand

    # aresidency, the worker thread profiled
    ours = cProfile.Profile()
    original = ThreadedRunner._work

    def work(self: ThreadedRunner, *a: Any, **k: Any) -> Any:
        if getattr(self, "profiling", False):
            ours.enable()
        try:
            return original(self, *a, **k)
        finally:
            ours.disable()

    ThreadedRunner._work = work  # type: ignore[method-assign]
    async with ResidencyManager(backend="sim" if dev.sim else "cuda") as manager:
        streamed = stream_module(
            manager,
            copy.deepcopy(model),
            "cuda:0",
            prefetch=2,
            ring=False if args.no_ring else None,
        )
        manager.set_budget("cuda:0", streamed.resident_bytes + 3 * max(streamed.block_bytes))
        with torch.no_grad():
            for _ in range(2):
                await streamed(input_ids=ids, use_cache=False)
            await streamed.drain()
            dev.sync()
            streamed._threaded.profiling = True  # type: ignore[attr-defined]
            start = time.perf_counter()
            for _ in range(args.calls):
                await streamed(input_ids=ids, use_cache=False)
            dev.sync()
            elapsed = time.perf_counter() - start
            streamed._threaded.profiling = False  # type: ignore[attr-defined]
        await streamed.drain()
        await streamed.aclose()
    kind = "values" if args.no_ring else "ring"
    print(f"\n== aresidency ({kind}): {elapsed * 1e3 / args.calls:.1f} ms/call (no drain between)")
    print(top(ours))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="llama-6MiB")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--no-ring", action="store_true")
    asyncio.run(main(parser.parse_args()))
