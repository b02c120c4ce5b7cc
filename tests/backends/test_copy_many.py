"""``Backend.copy_many``: several copies started at once, on the SIMULATED backend (CUDA
devices simulated in host memory); the CUDA backend's version has its own tests marked cuda."""

from __future__ import annotations

import pytest
import torch

from aresidency.backends import Backend, CopyRequest, FaultInjector, SimBackend, Transfer
from aresidency.core.locations import Location

pytestmark = pytest.mark.anyio

HOST, DEV0, DEV1 = (Location.parse(x) for x in ("pageable-host", "cuda:0", "cuda:1"))


def sources(n: int) -> list[torch.Tensor]:
    return [torch.arange(64, dtype=torch.float32) + 100 * i for i in range(n)]


async def test_copies_to_one_stream_share_one_event_and_arrive_exactly() -> None:
    sim = SimBackend(num_devices=2)
    sim.start()
    try:
        srcs = sources(5)
        # Three to cuda:0 (one stream), then two to cuda:1 (another): two groups.
        wheres = [DEV0, DEV0, DEV0, DEV1, DEV1]
        out = sim.copy_many([CopyRequest(s, HOST, d) for s, d in zip(srcs, wheres, strict=True)])
        assert all(isinstance(t, Transfer) for t in out)
        transfers = [t for t in out if isinstance(t, Transfer)]
        events = [t.event for t in transfers]
        assert events[0] is events[1] is events[2], "one event for the copies of one stream"
        assert events[3] is events[4] and events[3] is not events[0]
        for t, s, d in zip(transfers, srcs, wheres, strict=True):
            await t.wait()
            assert t.dst_location == d and torch.equal(t.tensor, s)
    finally:
        await sim.aclose()


async def test_a_failed_allocation_fails_its_own_request_only() -> None:
    faults = FaultInjector()
    sim = SimBackend(faults=faults)
    sim.start()
    try:
        srcs = sources(4)
        faults.oom_at_allocation = 2  # the second copy's destination
        out = sim.copy_many([CopyRequest(s, HOST, DEV0) for s in srcs])
        assert isinstance(out[1], torch.OutOfMemoryError)
        for i in (0, 2, 3):
            transfer = out[i]
            assert isinstance(transfer, Transfer)
            await transfer.wait()
            assert torch.equal(transfer.tensor, srcs[i])
    finally:
        await sim.aclose()


async def test_an_injected_transfer_failure_is_that_transfers_outcome_only() -> None:
    faults = FaultInjector()
    sim = SimBackend(faults=faults)
    sim.start()
    try:
        faults.fail_transfer_at = 3
        out = sim.copy_many([CopyRequest(s, HOST, DEV0) for s in sources(4)])
        transfers = [t for t in out if isinstance(t, Transfer)]
        assert len(transfers) == 4 and transfers[0].event is transfers[3].event
        for i, transfer in enumerate(transfers):
            if i == 2:
                with pytest.raises(RuntimeError, match="injected transfer failure"):
                    await transfer.wait()
            else:
                await transfer.wait()
    finally:
        await sim.aclose()


async def test_the_default_is_one_copy_each() -> None:
    """A backend that does not override ``copy_many`` gets ``copy`` per request, errors
    included (each as its own entry)."""
    sim = SimBackend()
    sim.start()
    try:
        bad = torch.ones(4)
        out = Backend.copy_many(
            sim,
            [
                CopyRequest(sources(1)[0], HOST, DEV0),
                CopyRequest(bad, HOST, Location.parse("cuda:7")),  # no such device
            ],
        )
        first = out[0]
        assert isinstance(first, Transfer)
        await first.wait()
        assert isinstance(out[1], ValueError) and "cuda:7" in str(out[1])
    finally:
        await sim.aclose()
