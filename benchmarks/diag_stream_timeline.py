"""Where the time goes in one streamed call: the GPU timeline of aresidency and of hand-written
double buffering, side by side (a diagnostic for benchmarks/bench_stream.py; needs a GPU).

    python3 benchmarks/diag_stream_timeline.py [--workload copy-bound|anchor|compute-bound]

For one warmed-up call of each method, torch.profiler records the device work; the script
prints every copy and kernel (stream, start, duration, idle gap before it on its stream) and a
summary: wall time of the call, when the first copy started, the copy stream's busy time and
idle gaps, and how long the compute stream waited after each copy finished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_stream import Device, MatMul, double_buffer

from aresidency import ResidencyManager, stream_module

SHAPES = {
    "anchor": (16, 8192, 8192),
    "copy-bound": (16, 8192, 1024),
    "compute-bound": (16, 4096, 32768),
}


def device_ops(trace_path: Path) -> list[dict[str, Any]]:
    data = json.loads(trace_path.read_text())
    ops = []
    for ev in data.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ops.append(
            {
                "name": ev["name"][:48],
                "stream": ev.get("args", {}).get("stream"),
                "ts": float(ev["ts"]),
                "dur": float(ev["dur"]),
            }
        )
    ops.sort(key=lambda o: o["ts"])
    return ops


def host_marks(trace_path: Path) -> list[dict[str, Any]]:
    data = json.loads(trace_path.read_text())
    marks = []
    for ev in data.get("traceEvents", []):
        wanted = ("Memcpy", "LaunchKernel", "WaitEvent", "HostFunc")
        runtime = ev.get("ph") == "X" and ev.get("cat") in ("cuda_runtime", "cuda_driver")
        if runtime and any(k in ev["name"] for k in wanted):
            marks.append({"name": ev["name"], "ts": float(ev["ts"]), "dur": float(ev["dur"])})
        if ev.get("ph") == "X" and ev.get("name") == "call":
            marks.append({"name": "== call", "ts": float(ev["ts"]), "dur": float(ev["dur"])})
    marks.sort(key=lambda m: m["ts"])
    return marks


def report(label: str, trace_path: Path, verbose: bool, n_bytes: int) -> None:
    ops = device_ops(trace_path)
    marks = host_marks(trace_path)
    if not ops:
        print(f"{label}: no device ops recorded")
        return
    call = next((m for m in marks if m["name"] == "== call"), None)
    t0 = call["ts"] if call else ops[0]["ts"]
    print(
        f"\n=== {label}: {len(ops)} device ops; call {call['dur'] / 1e3 if call else 0:.2f} ms host"
    )
    last_end: dict[Any, float] = {}
    copies = [o for o in ops if "Memcpy" in o["name"] or "memcpy" in o["name"]]
    kernels = [o for o in ops if o not in copies]
    for o in ops:
        gap = o["ts"] - last_end.get(o["stream"], o["ts"])
        last_end[o["stream"]] = o["ts"] + o["dur"]
        if verbose:
            print(
                f"  s{o['stream']!s:>3} {o['ts'] - t0:9.1f} us +{o['dur']:8.1f}  gap {gap:7.1f}  "
                f"{o['name']}"
            )
    if copies:
        span = copies[-1]["ts"] + copies[-1]["dur"] - copies[0]["ts"]
        busy = sum(c["dur"] for c in copies)
        gaps = [
            copies[i + 1]["ts"] - (copies[i]["ts"] + copies[i]["dur"])
            for i in range(len(copies) - 1)
        ]
        print(
            f"  copies: {len(copies)}, first starts {copies[0]['ts'] - t0:.1f} us after the call "
            f"began, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
            f"idle {sum(max(g, 0) for g in gaps) / 1e3:.2f} ms "
            f"(largest gaps us: {sorted((round(g, 1) for g in gaps), reverse=True)[:6]})"
        )
        mean = busy / len(copies)
        print(f"  mean copy {mean:.1f} us ({n_bytes / (mean * 1e-6) / 1e9:.1f} GB/s)")
    if kernels:
        end = max(k["ts"] + k["dur"] for k in kernels)
        kbusy = sum(k["dur"] for k in kernels)
        kgaps = [
            kernels[i + 1]["ts"] - (kernels[i]["ts"] + kernels[i]["dur"])
            for i in range(len(kernels) - 1)
        ]
        print(
            f"  kernels: {len(kernels)}, first starts {(kernels[0]['ts'] - t0) / 1e3:.2f} ms, "
            f"busy {kbusy / 1e3:.2f} ms, last ends {(end - t0) / 1e3:.2f} ms after the call "
            f"began; idle between kernels {sum(max(g, 0) for g in kgaps) / 1e3:.2f} ms "
            f"(largest gaps us: {sorted((round(g, 1) for g in kgaps), reverse=True)[:6]})"
        )
    if verbose:
        print("  host-side calls:")
        for m in marks:
            print(f"    {m['ts'] - t0:9.1f} us +{m['dur']:7.1f}  {m['name']}")


async def host_trace(manager: Any, call: Any, drain: Any) -> None:
    """One unprofiled call with the host side logged: copies issued, event waits begun (with
    the waiter's predicted start of polling), waiter sweeps that found completions, reaps."""
    backend = manager.backend
    waiter = backend.waiter
    log: list[tuple[float, str]] = []
    orig_copy, orig_sweep, orig_watch = backend.copy, waiter._sweep, waiter.watch
    orig_reap_events = manager.state.reap_events

    def copy(*a: Any, **k: Any) -> Any:
        log.append((time.perf_counter(), "copy issued"))
        return orig_copy(*a, **k)

    def sweep() -> int:
        found = orig_sweep()
        if found:
            log.append((time.perf_counter(), f"waiter sweep found {found}"))
        return int(found)

    def watch(event: Any, bridge: Any, callback: Any) -> None:
        log.append((time.perf_counter(), "watch begins"))

        def delivered(error: Any) -> None:
            log.append((time.perf_counter(), "completion delivered on the loop"))
            callback(error)

        orig_watch(event, bridge, delivered)

    def reap_events(*a: Any, **k: Any) -> Any:
        log.append((time.perf_counter(), "reaped"))
        return orig_reap_events(*a, **k)

    backend.copy, waiter._sweep, waiter.watch = copy, sweep, watch
    manager.state.reap_events = reap_events
    try:
        torch.cuda.synchronize()
        hits = waiter.poll_hits
        t0 = time.perf_counter()
        with torch.no_grad():
            await call()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        synced = time.perf_counter()
        await drain()
    finally:
        backend.copy, waiter._sweep, waiter.watch = orig_copy, orig_sweep, orig_watch
        manager.state.reap_events = orig_reap_events
    print(
        f"\n=== host trace (call returned {(returned - t0) * 1e3:.2f} ms, GPU done "
        f"{(synced - t0) * 1e3:.2f} ms, poll hits {waiter.poll_hits - hits})"
    )
    for t, what in log:
        print(f"  {(t - t0) * 1e3:8.3f} ms  {what}")


async def main(args: argparse.Namespace) -> None:
    layers, n, batch = SHAPES[args.workload]
    dev = Device(sim=False)
    torch.manual_seed(0)
    weights = [torch.randn(n, n, dtype=torch.bfloat16) * n**-0.5 for _ in range(layers)]
    x = torch.randn(batch, n, device="cuda:0", dtype=torch.bfloat16)
    budget = 3 * n * n * 2
    from torch.profiler import ProfilerActivity, profile, record_function

    tmp = Path(tempfile.mkdtemp())
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="cuda") as manager:
        model = nn.Sequential(*(MatMul(w) for w in weights))
        sm = stream_module(manager, model, "cuda:0", prefetch=args.prefetch, host="pinned-host")
        pinned = [m.weight.detach() for m in model if isinstance(m, MatMul)]
        with torch.no_grad():
            for _ in range(3):
                await sm(x)
                dev.sync()
                await sm.drain()
            walls = []
            for _ in range(5):
                dev.sync()
                t = time.perf_counter()
                await sm(x)
                dev.sync()
                walls.append((time.perf_counter() - t) * 1e3)
                await sm.drain()
            print(f"aresidency wall ms (5 calls): {[round(w, 2) for w in walls]}")
            if args.host_trace:
                await host_trace(manager, lambda: sm(x), sm.drain)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("call"):
                    await sm(x)
                dev.sync()
            prof.export_chrome_trace(str(tmp / "ares.json"))
            await sm.drain()
            report("aresidency", tmp / "ares.json", args.verbose, n * n * 2)

            bufs = [torch.empty(n, n, device="cuda:0", dtype=torch.bfloat16) for _ in range(2)]
            s = torch.cuda.Stream()
            for _ in range(3):
                double_buffer(dev, x, pinned, bufs, s)
            dev.sync()
            walls = []
            for _ in range(5):
                dev.sync()
                t = time.perf_counter()
                double_buffer(dev, x, pinned, bufs, s)
                dev.sync()
                walls.append((time.perf_counter() - t) * 1e3)
            print(f"double buffer wall ms (5 calls): {[round(w, 2) for w in walls]}")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("call"):
                    double_buffer(dev, x, pinned, bufs, s)
                dev.sync()
            prof.export_chrome_trace(str(tmp / "db.json"))
            report("double buffer", tmp / "db.json", args.verbose, n * n * 2)
        await sm.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(SHAPES), default="copy-bound")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--host-trace", action="store_true", help="log one call's host side")
    asyncio.run(main(parser.parse_args()))
