"""A randomized concurrency workload for the runtime, shared by the simulated-backend tests and
the GPU test: many tasks moving, replicating, releasing, leasing (reads and writes), entering
scopes and materializing without waiting, with random cancellations, timeouts and body
exceptions, optionally transfer failures and allocation failures, and (``start``) the manager
closing while they run.

What it checks:

* after every operation: the model's invariants (``check_invariants``), and no location over
  its budget;
* every lease that ended without an error read the value's data: each read is a checksum
  computed where the data is read (on the lease's stream, after the copy, as a kernel would;
  on the host for host locations) and compared, once the streams ran, with the value's
  expected checksum at the time the lease was entered (write leases, which exclude every other
  use and copy, change the data by a known amount);
* every task ends (within a timeout), and at the end nothing is leased, held, reserved (but the
  backend's own staging) or in flight, and every value still holds its expected data.
"""

from __future__ import annotations

import random
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import torch

from aresidency import (
    Materialize,
    MemoryReservation,
    Move,
    Release,
    ReplicaMode,
    ResidencyError,
    ResidencyManager,
    ResidencyPlan,
    ValueHandle,
)
from aresidency.backends import TransferCancelledError
from aresidency.runtime import ManagerClosedError

LOCATIONS = ("pageable-host", "pinned-host", "cuda:0", "cuda:1")


class BodyError(Exception):
    """Raised on purpose inside a lease or scope body."""


@dataclass
class Chaos:
    manager: ResidencyManager
    seed: int
    values: int = 10
    numel: int = 2048
    tasks: int = 12
    ops_per_task: int = 25
    faults: bool = False
    checksum: Callable[[torch.Tensor], Any] | None = None  # run where the data is read
    locations: tuple[str, ...] = LOCATIONS  # where tasks place and read values
    handles: list[ValueHandle] = field(default_factory=list)
    expected: dict[ValueHandle, float] = field(default_factory=dict)
    # (what, expected, got, state version at entry, lease)
    reads: list[tuple[str, float, Any, int, Any]] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    unexpected: list[BaseException] = field(default_factory=list)

    def setup(self) -> None:
        m = self.manager
        rng = random.Random(self.seed)
        for i in range(self.values):
            data = torch.full((self.numel,), float(i + 1))
            mode = ReplicaMode.REPLICABLE if i % 2 else ReplicaMode.EXCLUSIVE
            where = rng.choice(("pageable-host", "pinned-host"))
            h = m.register(data, name=f"v{i}", replica_mode=mode, location=where)
            self.handles.append(h)
            self.expected[h] = float(i + 1) * self.numel

    def _note(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def _check(self) -> None:
        m = self.manager
        if not m.running:
            return
        m.state.check_invariants()
        for record in m.snapshot().locations.values():
            if record.budget_bytes is not None:
                assert record.charged_bytes <= record.budget_bytes, record

    def _read(self, lease: Any, location: str, handle: ValueHandle) -> None:
        """Checksum the leased tensor where it is read; remember what it must equal."""
        expected = self.expected[handle]
        version = self.manager.state_version
        view = lease.tensor
        backend = self.manager.backend
        if self.checksum is not None and location.startswith("cuda"):
            got = self.checksum(view)  # enqueued on the lease's stream (current here)
            self.reads.append((f"{handle.name}@{location}", expected, got, version, lease))
        elif location.startswith("cuda"):
            box: list[float] = []
            backend.run_in_stream_order(lease.stream, lambda: box.append(float(view.sum())))
            self.reads.append((f"{handle.name}@{location}", expected, box, version, lease))
        else:
            got_now = [float(view.sum())]
            self.reads.append((f"{handle.name}@{location}", expected, got_now, version, lease))

    async def _op(self, rng: random.Random) -> None:
        m = self.manager
        h = rng.choice(self.handles)
        where = rng.choice(self.locations)
        kind = rng.choice(
            [
                "move",
                "move",
                "materialize",
                "release",
                "read",
                "read",
                "write",
                "scope",
                "nowait",
                "bulk",
            ]
        )
        if kind == "move":
            await m.move(h, where)
        elif kind == "materialize":
            await m.materialize(h, where)
        elif kind == "release":
            await m.release(h, where)
        elif kind == "read":
            stream = m.backend.current_stream(where) if where.startswith("cuda") else None
            lease = m.acquire(h, where, stream=stream)
            failed_body = rng.random() < 0.1
            reads = len(self.reads)
            vouched = False
            try:
                async with lease:
                    with m.backend.stream_context(stream):
                        self._read(lease, where, h)
                    if failed_body:
                        raise BodyError("a failing lease body")
                vouched = True
            except BodyError:
                vouched = True
                raise
            finally:
                if lease.failure() is not None or not vouched:
                    # The lease reported (at its exit) that its copy failed, or the task was
                    # cancelled before the lease could know: its read is not vouched for.
                    del self.reads[reads:]
        elif kind == "write":
            stream = m.backend.current_stream(where) if where.startswith("cuda") else None
            async with m.acquire(h, where, stream=stream, mode="write") as lease:
                view = lease.tensor
                # Exclusive: no other use or copy of the value while this runs.
                if stream is not None:
                    m.backend.run_in_stream_order(stream, lambda: view.add_(1.0))
                else:
                    view.add_(1.0)
                self.expected[h] += self.numel
        elif kind == "scope":
            other = rng.choice(self.handles)
            plan = ResidencyPlan(
                reserve=[MemoryReservation(f"ws-{rng.randrange(10**9)}", "cuda:0", 4096)],
                enter=[Materialize(h, where)],
                exit=[Move(h, rng.choice(self.locations))] if rng.random() < 0.5 else [],
            )
            if other is not h and rng.random() < 0.3:
                plan = ResidencyPlan(
                    reclaim=[Release(other, rng.choice(self.locations))],
                    reserve=plan.reserve,
                    enter=plan.enter,
                )
            async with m.scope(plan, timeout=rng.choice([0, 0.01, 0.2, None])):
                if rng.random() < 0.1:
                    raise BodyError("a failing scope body")
                await anyio.lowlevel.checkpoint()
        elif kind == "bulk":
            # A phase of several values (its copies batched, the first ones issued before the
            # last action began, each committed as it lands): cancelled, timed out or failed
            # like any other operation.
            chosen = rng.sample(self.handles, rng.randint(5, min(8, len(self.handles))))
            actions: list[Materialize | Move] = [
                (Move if rng.random() < 0.5 else Materialize)(other, rng.choice(self.locations))
                for other in chosen
            ]
            await m.execute(ResidencyPlan(enter=actions))
        elif kind == "nowait":
            pending = m.materialize_nowait(h, where)
            if rng.random() < 0.5:
                pending.cancel()
            await pending

    async def _task(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        m = self.manager
        for _ in range(self.ops_per_task):
            if self.faults and rng.random() < 0.1:
                if rng.random() < 0.5:
                    m.backend.faults.fail_transfer_at = rng.randint(1, 3)
                else:
                    m.backend.faults.oom_at_allocation = rng.randint(1, 3)
            try:
                with anyio.CancelScope() as scope:
                    if rng.random() < 0.2:
                        scope.deadline = anyio.current_time() + rng.choice([0, 1e-4, 1e-3])
                    await self._op(rng)
                self._note("cancelled" if scope.cancelled_caught else "done")
            except ManagerClosedError:
                self._note("closed")
                return
            except (ResidencyError, TimeoutError, BodyError, TransferCancelledError) as error:
                self._note(type(error).__name__)
            except (RuntimeError, torch.OutOfMemoryError) as error:
                if self.faults and "injected" in str(error):
                    self._note("injected")
                elif not m.running:
                    self._note("closed")
                    return
                else:
                    self.unexpected.append(error)
            except BaseException as error:  # anything else is a bug the test reports
                if isinstance(error, anyio.get_cancelled_exc_class()):
                    raise
                self.unexpected.append(error)
            self._check()

    async def run(self, deadline_s: float = 60.0) -> None:
        self.setup()
        with anyio.fail_after(deadline_s):  # every task ends
            async with anyio.create_task_group() as tg:
                for index in range(self.tasks):
                    tg.start_soon(self._task, index)

    def start(self, tg: Any) -> None:
        """Register the values and start the tasks in ``tg`` (the caller closes the manager
        while they run)."""
        self.setup()
        for index in range(self.tasks):
            tg.start_soon(self._task, index)

    async def settle(self) -> None:
        """Wait (on state changes) until nothing is in flight or pending."""
        m = self.manager
        while any(
            r.state.value != "resident" or r.pending_event_count
            for v in m.snapshot().values.values()
            for r in v.materializations
        ):
            await m.wait_for_change(5)

    def describe_unexpected(self) -> str:
        """The unexpected errors (up to three) with their tracebacks, and the last transitions
        of the values each one names: what a failure report needs to be read off the GPU."""
        parts = [f"{len(self.unexpected)} unexpected error(s)"]
        transitions = self.manager.trace().transitions
        for error in self.unexpected[:3]:
            parts.append("".join(traceback.format_exception(error)))
            names = set(re.findall(r"\bvalue (v\d+)", str(error)))
            for name in sorted(names):
                mine = [
                    str(t) for t in transitions if t.handle is not None and t.handle.name == name
                ]
                parts.append(f"the last transitions of {name}:\n" + "\n".join(mine[-40:]))
        return "\n".join(parts)

    def verify_reads(self, resolve: Callable[[Any], float]) -> int:
        """Every recorded read equals its expected checksum; returns how many were checked."""
        wrong = [
            (what, exp, resolve(got), version, lease)
            for what, exp, got, version, lease in self.reads
            if resolve(got) != exp
        ]
        if wrong:
            what, exp, got, version, lease = wrong[0]
            name = what.split("@")[0]
            around = [
                str(t)
                for t in self.manager.trace().transitions
                if t.handle is not None
                and t.handle.name == name
                and version - 30 <= t.state_version <= version + 30
            ]
            raise AssertionError(
                f"{len(wrong)} lease(s) read data that was not the value's; the first: {what} "
                f"read {got}, expected {exp}, entered at v{version} ({lease!r}); its "
                f"transitions around then:\n" + "\n".join(around)
            )
        return len(self.reads)

    async def verify_final(self) -> None:
        """Nothing leased, held, reserved or in flight; every value holds its data."""
        m = self.manager
        snap = m.snapshot()
        for value in snap.values.values():
            for record in value.materializations:
                assert record.use_count == record.hold_count == record.pending_event_count == 0
                assert record.state.value == "resident"
        for record in snap.locations.values():
            names = {name for name, _ in record.reservations}
            assert names <= {"aresidency.staging"}, record
        assert m.waiting == 0
        m.state.check_invariants()
        for h in self.handles:
            where = str(snap.value(h).locations[0])
            stream = m.backend.current_stream(where) if where.startswith("cuda") else None
            async with m.acquire(h, where, stream=stream) as lease:
                view = lease.tensor
                box: list[float] = []
                if stream is not None:
                    m.backend.run_in_stream_order(
                        stream, lambda v=view, b=box: b.append(float(v.sum()))
                    )
                    await m.backend.wait(m.backend.record_event(stream))
                else:
                    box.append(float(view.sum()))
            assert box == [self.expected[h]], (h.name, where, box, self.expected[h])
