"""Spare host memory: a backend's pinned arena, bounded by the pinned-host budget's headroom, and
the freed pageable destinations it keeps, bounded by the pageable-host budget's; both shown in
the ledger, never charged. On the simulated backend (a simulation of CUDA devices in host
memory) with stand-ins for the backend's two questions; the real arena and pageable cache are
covered by the CUDA tests."""

from __future__ import annotations

import anyio
import pytest
import torch

from aresidency import ReplicaMode, ResidencyManager, ResidencySnapshot
from aresidency.backends import SimBackend

pytestmark = pytest.mark.anyio

MiB = 1 << 20


class SpareSim(SimBackend):
    """A simulation whose spare host memory at one kind of location (``"pinned"``: its "arena";
    ``"pageable"``: its "pageable cache") is whatever the runtime lets it keep: the limit
    given. The other kind keeps nothing, as in the base class."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.limits: list[int | None] = []
        self.spare = 0

    def _limit(self, kind: str, headroom: int | None) -> None:
        if kind == self.kind:
            self.limits.append(headroom)
            self.spare = min(self.spare, headroom) if headroom is not None else self.spare

    def pinned_overhead_bytes(self) -> int:
        return self.spare if self.kind == "pinned" else 0

    def limit_pinned_overhead(self, headroom: int | None) -> None:
        self._limit("pinned", headroom)

    def pageable_overhead_bytes(self) -> int:
        return self.spare if self.kind == "pageable" else 0

    def limit_pageable_overhead(self, headroom: int | None) -> None:
        self._limit("pageable", headroom)


async def test_the_arena_is_bounded_by_the_budget_headroom_and_shown_uncharged() -> None:
    backend = SpareSim("pinned")
    async with ResidencyManager(budgets={"pinned-host": 10 * MiB}, backend=backend) as m:
        backend.spare = 6 * MiB  # grown ahead while nothing was charged
        h = m.register(
            torch.zeros(MiB, dtype=torch.uint8), None, ReplicaMode.REPLICABLE, location="cuda:0"
        )
        await m.materialize(h, "pinned-host")
        ledger = m.state.ledger("pinned-host")
        assert ledger.charged_bytes == MiB, "the spare bytes are not charged"
        assert backend.limits[-1] == 9 * MiB, "budget less what is charged"
        record = m.snapshot().location("pinned-host")
        assert record.spare_bytes == 6 * MiB and "spare=6144 KiB" in repr(record)
        again = ResidencySnapshot.from_dict(m.snapshot().to_dict())
        assert again.location("pinned-host").spare_bytes == 6 * MiB
        big = m.register(
            torch.zeros(7 * MiB, dtype=torch.uint8), None, ReplicaMode.REPLICABLE, location="cuda:0"
        )
        await m.materialize(big, "pinned-host")  # admitted against the budget, not the spare
        assert backend.limits[-1] == 2 * MiB
        assert m.snapshot().location("pinned-host").spare_bytes == 2 * MiB, "the arena shrank"
        version = m.state_version
        backend.spare = MiB
        await m.release(big, "pinned-host")
        assert backend.limits[-1] == 9 * MiB
        assert m.state_version == version + 1, "the spare is noted, not a transition"


async def test_without_a_pinned_budget_only_the_backend_bounds_its_arena() -> None:
    backend = SpareSim("pinned")
    async with ResidencyManager(backend=backend) as m:
        h = m.register(torch.zeros(1000), None, ReplicaMode.REPLICABLE, location="cuda:0")
        await m.materialize(h, "pinned-host")
        assert backend.limits and set(backend.limits) == {None}
        with anyio.fail_after(5):
            await m.release(h, "pinned-host")


async def test_kept_pageable_memory_is_bounded_by_the_budget_headroom_and_shown_uncharged() -> None:
    backend = SpareSim("pageable")
    async with ResidencyManager(budgets={"pageable-host": 10 * MiB}, backend=backend) as m:
        backend.spare = 6 * MiB  # destinations freed while nothing was charged
        h = m.register(
            torch.zeros(MiB, dtype=torch.uint8), None, ReplicaMode.REPLICABLE, location="cuda:0"
        )
        await m.materialize(h, "pageable-host")
        ledger = m.state.ledger("pageable-host")
        assert ledger.charged_bytes == MiB, "the kept bytes are not charged"
        assert backend.limits[-1] == 9 * MiB, "budget less what is charged"
        record = m.snapshot().location("pageable-host")
        assert record.spare_bytes == 6 * MiB and "spare=6144 KiB" in repr(record)
        big = m.register(
            torch.zeros(7 * MiB, dtype=torch.uint8), None, ReplicaMode.REPLICABLE, location="cuda:0"
        )
        await m.materialize(big, "pageable-host")  # admitted against the budget, not the spare
        assert backend.limits[-1] == 2 * MiB
        assert m.snapshot().location("pageable-host").spare_bytes == 2 * MiB, "it shrank"
        await m.release(big, "pageable-host")
        assert backend.limits[-1] == 9 * MiB


async def test_without_a_pageable_budget_only_the_backend_bounds_what_it_keeps() -> None:
    backend = SpareSim("pageable")
    async with ResidencyManager(backend=backend) as m:
        h = m.register(torch.zeros(1000), None, ReplicaMode.REPLICABLE, location="cuda:0")
        await m.materialize(h, "pageable-host")
        assert backend.limits and set(backend.limits) == {None}
