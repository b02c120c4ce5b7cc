"""A streamed module rebuilt from a checkpoint reads each group into ``pageable-host`` on its
way to the device. When that room is held by values the controller would evict (a replica of a
value resident elsewhere, a value dropped and rebuilt from its own source), the load evicts
them, as a decision does, instead of waiting for room that nothing would ever give back; what
is protected or cannot go is still waited for. Simulated backend (CUDA simulated in host
memory)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import save_file

from aresidency import (
    CallableSource,
    Location,
    ReplicaMode,
    ResidencyManager,
    ValueHandle,
)
from aresidency.integrations import stream_module

from ._models import linears
from .test_streaming import max_charge, reference

pytestmark = pytest.mark.anyio

PAGEABLE = Location.parse("pageable-host")
GROUP = 4608  # one nn.Linear(32, 32) packed: 4096 B of weight, 128 B of bias at 512 B


def checkpoint(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = linears(n=4)
    path = tmp_path / "linears.safetensors"
    save_file(dict(model.state_dict()), str(path))
    return model, path


def skeleton() -> torch.nn.Module:
    with torch.device("meta"):
        return linears(n=4)


async def filler(m: ResidencyManager, kind: str, name: str) -> ValueHandle:
    """A value of one group's bytes at pageable-host: evictable (``replica``: another replica
    stays in pinned memory; ``source``: dropped, rebuilt from its own source), or not
    (``only``: the last copy of a value without a source)."""
    if kind == "source":
        source = CallableSource(
            lambda: torch.ones(GROUP // 4), shape=(GROUP // 4,), dtype=torch.float32
        )
        handle = m.register_source(source, name=name, replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(handle, "pageable-host")
        return handle
    mode = ReplicaMode.EXCLUSIVE if kind == "only" else ReplicaMode.REPLICABLE
    handle = m.register(torch.ones(GROUP // 4), name=name, replica_mode=mode)
    if kind == "replica":
        await m.materialize(handle, "pinned-host")
    return handle


@pytest.mark.parametrize("kind", ["replica", "source"])
async def test_a_load_evicts_what_fills_pageable_host_and_nothing_else(
    tmp_path: Path, kind: str
) -> None:
    # pageable-host has room for two groups, both held by evictable values: each load took
    # TimeoutError (or waited for ever without a timeout), room nothing would give back.
    model, path = checkpoint(tmp_path)
    x = torch.randn(2, 32)
    budgets = {"cuda:0": 64 * GROUP, "pageable-host": 2 * GROUP}
    async with ResidencyManager(budgets=budgets, backend="sim") as m:
        older = await filler(m, kind, "older")
        newer = await filler(m, kind, "newer")
        streamed = stream_module(m, skeleton(), checkpoint=path, prefetch=0, timeout=10)
        with torch.no_grad():
            assert torch.equal(await streamed(x), reference(model, x))
        await streamed.drain()
        trace = m.trace()
        assert max_charge(trace, "pageable-host") <= 2 * GROUP
        evicted = [
            t.handle for t in trace.transitions if t.kind == "release" and t.location == PAGEABLE
        ]
        assert evicted[:1] == [older]  # the least recently used first
        # Exact accounting: what stays at pageable-host is the fillers not evicted, no more.
        snap = m.snapshot()
        left = [h for h in (older, newer) if PAGEABLE in snap.value(h).locations]
        assert snap.location("pageable-host").used_bytes == GROUP * len(left)
        assert all(snap.value(h).charge_bytes == GROUP for h in (older, newer))
        for handle in (older, newer):
            if handle not in left:
                assert handle in evicted
                expected = ["pinned-host"] if kind == "replica" else []
                assert [str(loc) for loc in snap.value(handle).locations] == expected
        # The next call evicts again only what it lacks.
        with torch.no_grad():
            assert torch.equal(await streamed(x), reference(model, x))
        await streamed.drain()
        assert max_charge(m.trace(), "pageable-host") <= 2 * GROUP
        await streamed.aclose()


async def test_a_load_waits_for_what_cannot_be_evicted_as_before(tmp_path: Path) -> None:
    model, path = checkpoint(tmp_path)
    x = torch.randn(2, 32)
    budgets = {"cuda:0": 64 * GROUP, "pageable-host": GROUP}
    async with ResidencyManager(budgets=budgets, backend="sim") as m:
        # The last copy of a value without a source: never evicted, the load times out.
        only = await filler(m, "only", "only")
        impatient = stream_module(m, skeleton(), checkpoint=path, timeout=0.05, name="impatient")
        with pytest.raises(TimeoutError, match="not admitted") as info, torch.no_grad():
            await impatient(x)
        # It says where the room was short: not at the device, which had plenty.
        assert f"into pageable-host on its way there, which had no room for its {GROUP} B" in (
            str(info.value)
        )
        assert f"used {GROUP} B + reserved 0 B of {GROUP} B, 0 B free" in str(info.value)
        await impatient.drain()
        await impatient.aclose()
        assert [str(loc) for loc in m.snapshot().value(only).locations] == ["pageable-host"]
        await m.discard(only)

        # An evictable value that is held: protection is waited for, never evicted; once the
        # hold ends the value is evicted and the call goes on.
        held = await filler(m, "replica", "held")
        hold = m.hold(held, "pageable-host")
        streamed = stream_module(m, skeleton(), checkpoint=path, name="patient")
        results: list[torch.Tensor] = []

        async def call() -> None:
            with torch.no_grad():
                results.append(await streamed(x))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(call)
                await anyio.wait_all_tasks_blocked()
                assert streamed.current_call is not None and streamed.copies == 0
                assert PAGEABLE in m.snapshot().value(held).locations
                hold.release()
        assert torch.equal(results[0], reference(model, x))
        await streamed.drain()
        assert [str(loc) for loc in m.snapshot().value(held).locations] == ["pinned-host"]
        assert max_charge(m.trace(), "pageable-host") <= GROUP
        await streamed.aclose()
