"""Helpers shared by the loader tests: sources that can be held at a point, and the checks that
nothing is left behind and that a budget was respected (replaying the trace)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import torch

from aresidency import ResidencyManager, ResidencyTrace
from aresidency.core.values import MaterializationState
from aresidency.loader import DeviceLoader

KiB = 1 << 10
MiB = 1 << 20

_BATCH = re.compile(r"/b(\d+)")


async def until(condition: Any, seconds: float = 5.0) -> None:
    """Wait (polling the loop, with a deadline) until ``condition()`` holds: for changes nobody
    tells the loop about (the ring's thread while nobody waits, threads ending, statistics)."""
    with anyio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110 - nothing announces these changes
            await anyio.sleep(0.001)


def batches(count: int, numel: int = 256, *, seed: int = 0) -> list[torch.Tensor]:
    """``count`` distinct float32 tensors (bit patterns of random numbers)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator) for _ in range(count)]


BACKEND_OWN = {"aresidency.staging"}  # the CUDA backend's pinned staging, for the manager's life


def assert_nothing_left(manager: ResidencyManager) -> None:
    """Nothing registered (so nothing leased or held), nothing charged or reserved anywhere
    (but the backend's own staging reservation, which lives as long as the manager)."""
    assert [v.handle.name for v in manager.state.values()] == []
    snap = manager.snapshot()
    for location in ("pageable-host", "pinned-host", "cuda:0"):
        record = snap.location(location)
        assert record.used_bytes == 0, (location, record)
        own = sum(n for name, n in record.reservations if name in BACKEND_OWN)
        assert record.reserved_bytes == own, (location, record)


def max_charge(trace: ResidencyTrace, location: str = "cuda:0") -> int:
    """Replay the trace: the largest charge (used + reserved) the location ever had."""
    assert trace.overwritten == 0
    current = peak = 0
    for transition in trace.transitions:
        if transition.location is not None and str(transition.location) == location:
            current += transition.nbytes
        peak = max(peak, current)
    assert current >= 0
    return peak


class AheadProbe:
    """Watches how many batches of ``loader`` have a device copy (begun or done) beyond the ones
    it has handed out: a change listener samples the live state after every batch of
    transitions. ``most``: the largest count seen.

    (The loader protects a copy with a lease once it is issued, before the hand-out, so the trace
    alone cannot tell when the consumer got a batch; the loader's own count of batches handed out
    can.)"""

    def __init__(self, manager: ResidencyManager, loader: DeviceLoader) -> None:
        self.manager = manager
        self.loader = loader
        self.device = str(loader.device)
        self.most = 0
        self._remove = manager.add_change_listener(self.sample)

    def ahead(self, *, complete: bool = False) -> int:
        """Batches with a device copy (``complete``: a finished one) that the consumer has not
        been handed yet."""
        handed = self.loader.counters.batches
        indices = set()
        for value in self.manager.state.values():
            if not any(
                str(loc) == self.device
                and (not complete or m.state is MaterializationState.RESIDENT)
                for loc, m in value.materializations.items()
            ):
                continue
            match = _BATCH.search(value.handle.name)
            if match is not None and int(match.group(1)) >= handed:
                indices.add(int(match.group(1)))
        return len(indices)

    def sample(self) -> None:
        self.most = max(self.most, self.ahead())

    def close(self) -> None:
        self._remove()


class Gate:
    """A point a source thread stops at until the test opens it: ``reached`` is set when the
    source gets there."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.open = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        if not self.open.wait(30):
            raise TimeoutError("the test never opened the gate")


def gated(items: list[Any], gate: Gate, at: int) -> Iterator[Any]:
    """Yield ``items``, stopping at the gate before item ``at``."""
    for index, item in enumerate(items):
        if index == at:
            gate.hold()
        yield item
