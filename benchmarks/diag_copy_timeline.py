"""Where a burst of small copies through the manager loses time: a timeline of one round.

``--count`` values of ``--size`` bytes (pinned sources) are materialized on ``cuda:0`` at
once, three ways: the backend alone, one plan (``execute``), and a task each (``materialize``).
For each call that issues copies (``CudaBackend.copy``, or ``copy_many`` with a batch) the
host's times are recorded (the call begins and ends; the reaper delivers the completion on
the loop) and, on the device, when its copies ran (timing events recorded around the call on
the copy stream, which add a few microseconds of host time per call). Printed per way, in
milliseconds from the round's start (median of ``--rounds`` rounds):

* ``issue``: the first and last call's issue; ``host in copy()``: the backend's share of it;
* ``device``: when the first call's copies began and the last ended on the device, and how
  long the copy stream sat idle between calls (``gaps``: the device waited for the host);
* ``seen``: the median delay from a call's copies ending on the device to the delivery of
  their completion on the loop;
* ``last seen``: that delay for the last call's copies; ``finished``: when the last phase run
  finished (its commits done, its waiter woken);
* ``end``: when the round's awaits returned; ``tail``: that, less the last copy's end.

    python3 benchmarks/diag_copy_timeline.py                 # needs CUDA
    python3 benchmarks/diag_copy_timeline.py --size 4MiB --count 64 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aresidency import Materialize, ReplicaMode, ResidencyManager, ResidencyPlan
from aresidency.backends import CudaBackend, EventWaiter
from aresidency.backends import cuda as cuda_module
from aresidency.core.locations import Location
from aresidency.core.sizes import parse_nbytes
from aresidency.runtime import driver


class Recorder:
    """Wraps the backend's ``copy`` and the reaper's ``watch`` of one manager to time them."""

    def __init__(self, manager: Any) -> None:
        self.rt = manager._running()
        self.backend: CudaBackend = self.rt.backend
        self.rows: list[dict[str, Any]] = []
        self.by_transfer: dict[int, dict[str, Any]] = {}
        self.t0 = 0.0
        backend_copy = self.backend.copy
        backend_copy_many = getattr(self.backend, "copy_many", None)
        reaper_watch = self.rt.reaper.watch

        def timed_issue(issue: Callable[[], Any], transfers: Callable[[Any], list[Any]]) -> Any:
            """One call that issues copies (``copy`` or ``copy_many``): a row of its own."""
            stream = cuda_module.copy_streams(0).h2d
            row: dict[str, Any] = {"begin": time.perf_counter()}
            row["ev0"] = torch.cuda.Event(enable_timing=True)
            row["ev0"].record(stream)
            result = issue()
            row["ev1"] = torch.cuda.Event(enable_timing=True)
            row["ev1"].record(stream)
            row["end"] = time.perf_counter()
            self.rows.append(row)
            for transfer in transfers(result):
                self.by_transfer[id(transfer)] = row
            return result

        def copy(src: torch.Tensor, a: Location, b: Location, **kw: Any) -> Any:
            return timed_issue(lambda: backend_copy(src, a, b, **kw), lambda t: [t])

        def copy_many(requests: Any) -> Any:
            assert backend_copy_many is not None
            return timed_issue(lambda: backend_copy_many(requests), list)

        def watch(waitable: Any, callback: Callable[[BaseException | None], None]) -> None:
            row = self.by_transfer.get(id(waitable))

            def timed(error: BaseException | None) -> None:
                if row is not None:
                    row["seen"] = time.perf_counter()
                callback(error)

            reaper_watch(waitable, timed)

        if backend_copy_many is not None:
            self.backend.copy_many = copy_many  # type: ignore[method-assign]
        self.finished = 0.0
        finish = driver.PhaseRun._finish

        def timed_finish(run: Any, error: BaseException | None) -> None:
            self.finished = time.perf_counter()  # the last run's end: when its commits are done
            finish(run, error)

        driver.PhaseRun._finish = timed_finish  # type: ignore[method-assign]
        self.backend.copy = copy  # type: ignore[method-assign]
        self.rt.reaper.watch = watch  # type: ignore[method-assign]

    def start(self) -> None:
        torch.cuda.synchronize()
        self.rows = []
        self.by_transfer = {}
        self.finished = 0.0
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record(cuda_module.copy_streams(0).h2d)
        torch.cuda.synchronize()
        self.t0 = time.perf_counter()  # the anchor completed before this: device t = 0 here

    def summary(self, end: float) -> dict[str, float]:
        torch.cuda.synchronize()
        rows = self.rows
        ms = 1e3
        dev = [
            (self.anchor.elapsed_time(r["ev0"]), self.anchor.elapsed_time(r["ev1"])) for r in rows
        ]
        gaps = sum(max(0.0, dev[i][0] - dev[i - 1][1]) for i in range(1, len(dev)))
        # The device clock starts at the anchor, which completed just before t0 (within
        # microseconds): close enough to compare with host times at this scale.
        seen = [
            (r["seen"] - self.t0) * ms - d[1] for r, d in zip(rows, dev, strict=True) if "seen" in r
        ]
        return {
            "issue first": (rows[0]["begin"] - self.t0) * ms,
            "issue last": (rows[-1]["end"] - self.t0) * ms,
            "host in copy()": sum(r["end"] - r["begin"] for r in rows) * ms,
            "device first": dev[0][0],
            "device last": dev[-1][1],
            "gaps": gaps,
            "seen": statistics.median(seen) if seen else float("nan"),
            "last seen": seen[-1] if seen and "seen" in rows[-1] else float("nan"),
            "finished": (self.finished - self.t0) * ms if self.finished else float("nan"),
            "end": (end - self.t0) * ms,
            "tail": (end - self.t0) * ms - dev[-1][1],
        }


async def main(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("diag_copy_timeline needs CUDA")
    nbytes = parse_nbytes(args.size)
    dev = Location.parse("cuda:0")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    waiter: Any = args.waiter
    if waiter == "hybrid-timer":  # the hybrid strategy with the loop's timed polls
        waiter = EventWaiter("hybrid", loop_timer=True)
    async with ResidencyManager(backend=CudaBackend(waiter=waiter)) as m:
        rec = Recorder(m)
        host = Location.parse("pinned-host")
        srcs = [torch.empty(nbytes // 4).pin_memory() for _ in range(args.count)]
        handles = [
            m.register(s, name=f"v{i}", replica_mode=ReplicaMode.REPLICABLE, location=host)
            for i, s in enumerate(srcs)
        ]

        async def backend_way() -> None:
            transfers = [rec.backend.copy(s, host, dev) for s in srcs]
            for t in transfers:
                await t.wait()
            for t in transfers:
                rec.backend.free(t.tensor, dev)

        async def plan_way() -> None:
            await m.execute(ResidencyPlan(enter=[Materialize(h, dev) for h in handles]))

        async def tasks_way() -> None:
            async with anyio.create_task_group() as tasks:
                for h in handles:
                    tasks.start_soon(m.materialize, h, dev)

        ways: dict[str, Callable[[], Awaitable[None]]] = {
            "backend": backend_way,
            "one plan": plan_way,
            "a task each": tasks_way,
        }
        print(
            f"{args.count} copies of {args.size}, pinned -> cuda:0, median of {args.rounds} "
            f"rounds, ms from the round's start, waiter {args.waiter}, switch interval "
            f"{sys.getswitchinterval() * 1e3:.2f} ms (torch {torch.__version__})"
        )
        keys = ["issue first", "issue last", "host in copy()", "device first", "device last"]
        keys += ["gaps", "seen", "last seen", "finished", "end", "tail"]
        print("| way | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for name, way in ways.items():
            samples: dict[str, list[float]] = {}
            for i in range(args.rounds + 1):
                rec.start()
                await way()
                end = time.perf_counter()
                summary = rec.summary(end)
                if name != "backend":
                    async with anyio.create_task_group() as tasks:
                        for h in handles:
                            tasks.start_soon(m.release, h, dev)
                if i:  # the first round warms up
                    for k, v in summary.items():
                        samples.setdefault(k, []).append(v)
            row = [f"{statistics.median(samples[k]):.2f}" for k in keys]
            print(f"| {name} | " + " | ".join(row) + " |", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size", default="4MiB")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--waiter", default="auto", help="the CUDA backend's waiting strategy (or hybrid-timer)"
    )
    parser.add_argument("--switch-interval", type=float, help="sys.setswitchinterval, seconds")
    return parser.parse_args(argv)


if __name__ == "__main__":
    anyio.run(main, parse())
