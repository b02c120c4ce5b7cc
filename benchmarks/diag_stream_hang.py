"""Diagnose a streamed call that never ends: the workload of the CUDA streaming test
(``test_sequential_is_bit_identical_and_within_budget_on_the_gpu``: 12 bf16 layers of 2048 x
2048, a budget of three blocks, ``prefetch=2``), streamed from ``--host`` memory. If a call
has not ended after ``--stall`` seconds, the loop prints what every part still waits on (the
unfinished phase runs and their tickets, every incomplete transfer, the staging lanes, the
event waiter, the pipelines, the tasks) and the process exits with status 3.

    python3 benchmarks/diag_stream_hang.py --host pageable-host --calls 20
    python3 benchmarks/diag_stream_hang.py --first-hand-out 16   # the checkpoint as before

``--first-hand-out N`` sets how many actions a long phase begins before its first copies
start (``aresidency.core.plans.FIRST_HAND_OUT``), ``--checkpoint-every N`` how many it begins
between two checkpoints, to tell those paths from the others. ``benchmarks/device_hang.sh``
runs the variants in one device call.
Needs a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import threading
import time

import anyio
import torch
from torch import nn

from aresidency import ResidencyManager
from aresidency.backends import CudaBackend, EventWaiter
from aresidency.backends.base import Transfer
from aresidency.backends.staging import StagingLane
from aresidency.core import plans
from aresidency.integrations import stream_module
from aresidency.integrations.streaming.pipeline import CallPipeline
from aresidency.runtime.driver import PhaseRun


def linear_stack(d: int, n: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(d, d, dtype=torch.bfloat16) for _ in range(n)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.mul_(d**-0.5 * 3)
    return nn.Sequential(*layers)


def dump(waiter: EventWaiter, m: ResidencyManager) -> None:
    out = [f"== stalled at {time.monotonic():.3f}", repr(waiter)]
    with waiter._cond:
        pending = list(waiter._pending)
        wake_at = waiter._wake_at
    out.append(f"waiter thread: {len(pending)} pending, wake_at={wake_at}")
    for p in pending:
        out.append(f"  key={p.key} seq={p.seq} armed={p.armed} done={p.event.query()}")
    for poller in waiter._loop_pollers.values():
        out.append(f"loop poller: {len(poller.entries)} entries, scheduled={poller.scheduled}")
    for timed in waiter._loop_timers.values():
        if timed is not None:
            out.append(f"loop timer: {timed!r} entries={len(timed.entries)}")
    for obj in gc.get_objects():
        try:
            if isinstance(obj, PhaseRun) and not obj.finished:
                request = obj._request
                out.append(
                    f"{obj!r} request={type(request).__name__} "
                    f"tickets={[t.ticket_id for t in getattr(request, 'tickets', ())]} "
                    f"issue={[t.ticket_id for t in getattr(request, 'issue', ())]} "
                    f"open={sorted(obj._open)} known={sorted(obj._known)} "
                    f"ready={[t.ticket_id for t in obj._ready]} blocking={sorted(obj._blocking)} "
                    f"errors={ {k: type(v).__name__ for k, v in obj._errors.items()} } "
                    f"listening={obj._unlisten is not None} cancel={obj.cancel_requested}"
                )
                for tid, tr in obj._transfers.items():
                    out.append(
                        f"  ticket {tid}: {tr.route} issued={tr.issued()} query={tr.query()} "
                        f"event={tr.event!r} cancelled={tr.cancelled()}"
                    )
            elif isinstance(obj, Transfer) and not obj.query():
                out.append(f"incomplete: {obj!r} issued={obj.issued()} event={obj.event!r}")
            elif isinstance(obj, StagingLane):
                out.append(
                    f"lane {obj.direction}: queued={obj._queue.qsize()} jobs_run={obj.jobs_run}"
                )
            elif isinstance(obj, CallPipeline):
                slots = {k: repr(s) for k, s in obj.slots.items()}
                out.append(f"{obj!r} {slots}")
        except Exception as exc:  # a half-built object: say so, go on
            out.append(f"({type(obj).__name__}: {exc!r})")
    rt = m._rt
    out.append(f"reaper watched={rt.reaper.watched}")
    out.append(f"snapshot: {m.snapshot().location('cuda:0')}")
    for task in asyncio.all_tasks():
        out.append(f"task {task.get_name()}:")
        for frame in task.get_stack(limit=12):
            out.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
    print("\n".join(out), flush=True)
    os._exit(3)


async def main(args: argparse.Namespace) -> None:
    d, n = 2048, 12
    model = linear_stack(d, n)
    x = torch.randn(512, d, dtype=torch.bfloat16, device="cuda:0")
    block = d * d * 2 + 512 * ((d * 2 + 511) // 512)
    waiter = EventWaiter("hybrid", loop_timer=not args.thread_polls)
    loop = asyncio.get_running_loop()
    async with ResidencyManager(
        budgets={"cuda:0": 3 * block}, backend=CudaBackend(waiter=waiter)
    ) as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=2, host=args.host)
        for call in range(args.calls):
            timer = threading.Timer(args.stall, lambda: loop.call_soon_threadsafe(dump, waiter, m))
            timer.daemon = True
            timer.start()
            start = time.perf_counter()
            with torch.no_grad():
                await streamed(x)
            if call % 2:
                await streamed.drain()
            timer.cancel()
            print(f"call {call}: {1e3 * (time.perf_counter() - start):.1f} ms", flush=True)
        await streamed.drain()
        await streamed.aclose()
    print("all calls ended", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="pageable-host")
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--stall", type=float, default=10.0)
    parser.add_argument("--thread-polls", action="store_true", help="EventWaiter(loop_timer=False)")
    parser.add_argument("--first-hand-out", type=int, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    args = parser.parse_args()
    if args.first_hand_out is not None:
        plans.FIRST_HAND_OUT = args.first_hand_out
    if args.checkpoint_every is not None:
        plans.CHECKPOINT_EVERY = args.checkpoint_every
    print(
        f"FIRST_HAND_OUT={plans.FIRST_HAND_OUT} CHECKPOINT_EVERY={plans.CHECKPOINT_EVERY} "
        f"host={args.host} loop_timer={not args.thread_polls}",
        flush=True,
    )
    anyio.run(main, args)
    sys.exit(0)
