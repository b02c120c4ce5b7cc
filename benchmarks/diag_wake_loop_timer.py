"""Waking a task when a CUDA event completes: the loop's own timer against a thread's hop.

A diagnostic for the waiter's design (needs a CUDA GPU). Back-to-back waits for a
``torch.cuda._sleep`` kernel of 2 ms (and 20 ms), then an event; each way below awaits it on
the running loop, in the same process, one after the other:

* ``waiter``: the backend's event waiter as configured (``CudaBackend(waiter=...)``), whose
  thread polls near the predicted end and hands the completion to the loop;
* ``loop timer``: no thread at all. The loop arms a ``timerfd`` (microsecond precision; the
  loop's own timers round to milliseconds) for the predicted end less a lead, and when it fires
  queries the event, re-arming it every ``poll`` microseconds until the event is done. The
  prediction is the shortest of the stream's last eight waits, as the waiter's.
* ``loop timer, then spin``: the same timer, then the loop queries the event once per
  iteration (``call_soon``) until it is done.

Also how late a ``timerfd`` wakes an idle loop (the floor of any timed wake on this host).
``wake us`` = median(launch -> task resumed) - median(launch -> completion seen by a thread
spinning on ``query()``), as in ``bench_copy.py``; CPU = process CPU time / wall time (all
threads) and the loop thread's alone.

    python benchmarks/diag_wake_loop_timer.py [--uvloop] [--waits 200]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_copy import sleep_cycles_for, thread_cpu

from aresidency.backends import CudaBackend
from aresidency.backends.looptimer import Timerfd


class LoopTimer:
    """A timerfd on the running loop: ``arm(at)`` (``time.monotonic`` seconds) runs
    ``on_fire()`` on the loop at ``at``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_fire: Callable[[], None]) -> None:
        timer = Timerfd.create()
        if timer is None:
            raise OSError("no timerfd on this system")
        self.loop = loop
        self.timer = timer
        self.on_fire = on_fire
        loop.add_reader(timer.fd, self._fired)

    def arm(self, at: float) -> None:
        self.timer.arm(at)

    def _fired(self) -> None:
        self.timer.clear()
        self.on_fire()

    def close(self) -> None:
        self.loop.remove_reader(self.timer.fd)
        self.timer.close()


class LoopTimerWaiter:
    """The prototype: predicted-end timer on the loop, then polls (timer or spin)."""

    def __init__(self, poll_s: float, lead_s: float, lead_fraction: float, spin: bool) -> None:
        self.poll_s, self.lead_s, self.lead_fraction, self.spin = (
            poll_s,
            lead_s,
            lead_fraction,
            spin,
        )
        self.history: list[float] = []
        self.timer: LoopTimer | None = None
        self.current: tuple[Any, asyncio.Future[None], float] | None = None
        self.fires = 0

    def _check(self) -> None:
        current = self.current
        if current is None:
            return
        event, future, started = current
        self.fires += 1
        if event.query():
            self.current = None
            self.history = [*self.history[-7:], time.monotonic() - started]
            future.set_result(None)
        elif self.spin:
            asyncio.get_running_loop().call_soon(self._check)
        else:
            assert self.timer is not None
            self.timer.arm(time.monotonic() + self.poll_s)

    async def wait(self, event: Any) -> None:
        if event.query():
            return
        loop = asyncio.get_running_loop()
        if self.timer is None:
            self.timer = LoopTimer(loop, self._check)
        now = time.monotonic()
        future: asyncio.Future[None] = loop.create_future()
        self.current = (event, future, now)
        if self.history:
            shortest = min(self.history)
            at = now + max(shortest - self.lead_fraction * shortest - self.lead_s, 0.0)
        else:
            at = now
        self.timer.arm(at)
        await future

    def close(self) -> None:
        if self.timer is not None:
            self.timer.close()


async def timer_lateness(samples: int) -> tuple[float, float]:
    """Median and p90 microseconds between a timerfd's target and its callback on the loop."""
    loop = asyncio.get_running_loop()
    late: list[float] = []
    box: dict[str, Any] = {}

    def fired() -> None:
        late.append(time.monotonic() - box["at"])
        box["future"].set_result(None)

    timer = LoopTimer(loop, fired)
    for _ in range(samples):
        box["at"] = time.monotonic() + 2e-3
        box["future"] = loop.create_future()
        timer.arm(box["at"])
        await box["future"]
    timer.close()
    late.sort()
    return statistics.median(late) * 1e6, late[int(0.9 * len(late))] * 1e6


async def main(args: argparse.Namespace) -> None:
    short, long = sleep_cycles_for(2.0), sleep_cycles_for(20.0)
    stream = torch.cuda.Stream()

    def launch(record: Callable[[], Any], cycles: int) -> tuple[Any, float]:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        return record(), time.perf_counter()

    ref = []
    for _ in range(30):
        event, t0 = launch(lambda: torch_event(stream), short)
        while not event.query():
            pass
        ref.append(time.perf_counter() - t0)
    reference = statistics.median(ref)
    median, p90 = await timer_lateness(200)
    print(f"timerfd lateness on the idle loop: median {median:.1f} us, p90 {p90:.1f} us")

    backend = CudaBackend(waiter=args.waiter)
    backend.start()
    ways: list[tuple[str, Callable[[Any], Awaitable[None]], Callable[[], Any], Any]] = [
        (f"waiter {args.waiter}", backend.wait_event, lambda: backend.record_event(stream), None)
    ]
    for poll in (20e-6, 40e-6):
        proto = LoopTimerWaiter(poll, 40e-6, 0.02, spin=False)
        ways.append(
            (
                f"loop timer, polls every {poll * 1e6:.0f} us from 2% + 40 us before",
                proto.wait,
                lambda: torch_event(stream),
                proto,
            )
        )
    spin = LoopTimerWaiter(20e-6, 40e-6, 0.02, spin=True)
    ways.append(
        (
            "loop timer, then spin, from 2% + 40 us before",
            spin.wait,
            lambda: torch_event(stream),
            spin,
        )
    )
    for _name, wait, record, _proto in ways:  # warm-up
        for _ in range(20):
            event, _t0 = launch(record, short)
            await wait(event)
    ways += [(f"{w[0]} [again, last]", *w[1:]) for w in ways[:1]]
    loop_tid = {"loop": threading.get_native_id()}
    for name, wait, record, proto in ways:
        lat = []
        cpu0, wall0, per0 = time.process_time(), time.perf_counter(), thread_cpu(loop_tid)
        fires0 = proto.fires if proto is not None else 0
        for _ in range(args.waits):
            event, t0 = launch(record, short)
            await wait(event)
            lat.append(time.perf_counter() - t0)
        wall = time.perf_counter() - wall0
        cpu = (time.process_time() - cpu0) / wall * 100
        loop_cpu = (thread_cpu(loop_tid)["loop"] - per0["loop"]) / wall * 100
        fires = (proto.fires - fires0) / args.waits if proto is not None else float("nan")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(10):
            event, _t0 = launch(record, long)
            await wait(event)
        cpu_long = (time.process_time() - cpu0) / (time.perf_counter() - wall0) * 100
        wake = sorted(x - reference for x in lat)
        print(
            f"  {name:58s} wake {statistics.median(wake) * 1e6:7.1f} us "
            f"(p90 {wake[int(0.9 * len(wake))] * 1e6:7.1f})  CPU {cpu:5.1f} % (loop "
            f"{loop_cpu:5.1f})  20 ms waits {cpu_long:5.1f} %  polls/wait {fires:.1f}",
            flush=True,
        )
    for _name, _wait, _record, proto in ways:
        if proto is not None:
            proto.close()
    await backend.aclose()


def torch_event(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--waits", type=int, default=200)
    parser.add_argument("--waiter", default="auto")
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(29, ctypes.c_ulong(1000), 0, 0, 0)  # the loop thread's slack: 1 us
    print(f"loop={'uvloop' if args.uvloop else 'asyncio'} torch={torch.__version__}")
    if args.uvloop:
        import uvloop

        uvloop.run(main(args))
    else:
        asyncio.run(main(args))
