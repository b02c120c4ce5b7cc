"""docs/troubleshooting.md quotes real reports: these re-run its failures on the
simulated backend (a simulation of CUDA devices in host memory) and check that the page still
prints what ``diagnose`` says today, so the page cannot drift from the code."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import torch

from aresidency import (
    CallableSource,
    Materialize,
    MemoryReservation,
    Move,
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyController,
    ResidencyInUseError,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanExecutionError,
    ResidencyRequest,
    ResidencyRequirement,
    ResidencySearchLimitError,
    ResidencyUnavailableError,
    diagnose,
)

pytestmark = pytest.mark.anyio

KiB = 1 << 10
PAGE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"


def tensor(seed: int = 0) -> torch.Tensor:
    return torch.full((1024,), float(seed))  # float32: 4 KiB


def quoted(text: str) -> None:
    assert text in PAGE.read_text(encoding="utf-8"), f"the page no longer shows:\n{text}"


async def test_the_page_shows_todays_endpoint_report() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="kv_cache", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "pinned-host")
        with pytest.raises(ResidencyUnavailableError) as caught:
            m.acquire(h, "cuda:0")
        quoted(diagnose(caught.value, m).step(2).text())


async def test_the_page_shows_todays_protection_report() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="weights", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "pinned-host")
        entered, done = anyio.Event(), anyio.Event()

        async def decode_worker() -> None:
            async with m.acquire(h, "pinned-host"):
                entered.set()
                await done.wait()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(decode_worker, name="decode-worker")
                await entered.wait()
                with pytest.raises(ResidencyInUseError) as caught:
                    await m.release(h, "pinned-host")
                quoted(diagnose(caught.value, m).step(4).text())
                done.set()


async def test_the_page_shows_todays_partial_execution_report() -> None:
    async with ResidencyManager(backend="sim") as m:
        a = m.register(tensor(1), name="a")
        b = m.register(tensor(2), name="b")
        c = m.register(tensor(3), name="c", location="cuda:0")
        plan = ResidencyPlan(
            reclaim=[Move(c, "pinned-host")],
            reserve=[MemoryReservation("workspace", "cuda:0", 4 * KiB)],
            enter=[Move(a, "cuda:0"), Materialize(b, "cuda:0")],
        )
        m.backend.faults.fail_transfer_at = 3
        with pytest.raises(ResidencyPlanExecutionError) as caught:
            async with m.scope(plan):
                pytest.fail("the entry failed")
        report = diagnose(caught.value, m)
        quoted(str(caught.value))
        quoted(report.step(7).text())
        quoted(report.step(8).text())


async def test_the_page_shows_todays_budget_report_and_error_record() -> None:
    """Step 1's example: its report (the steps that name no manager id), the same error
    diagnosed without the manager, and every key ``error.to_dict()`` writes (the page had
    fallen behind: no ``waiting_scopes``)."""
    async with ResidencyManager(budgets={"cuda:0": 8 * KiB}, backend="sim") as m:
        embed = m.register(tensor(1), name="embed")
        block0 = m.register(tensor(2), name="block0")
        block1 = m.register(tensor(3), name="block1")
        await m.move(embed, "cuda:0")
        await m.move(block0, "cuda:0")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.move(block1, "cuda:0")
        report = diagnose(caught.value, m)
        for number in (2, 3, 8):
            quoted(report.step(number).text())
        quoted(diagnose(caught.value).step(1).text())
        record = caught.value.to_dict()
        for key, value in record.items():
            if key != "handle":
                quoted(f'  "{key}": {json.dumps(value)}')


async def test_the_page_shows_todays_reconstruction_and_search_limit_reports() -> None:
    async with ResidencyManager(budgets={"pinned-host": 6 * KiB}, backend="sim") as m:
        source = CallableSource(
            lambda: tensor(1), shape=(1024,), dtype=torch.float32, source_location="pinned-host"
        )
        lora = m.register_source(source, name="lora")
        m.register(tensor(2), name="cache", location="pinned-host")
        with pytest.raises(ResidencyBudgetError) as caught:
            await m.materialize(lora, "cuda:0")
        report = diagnose(caught.value, m)
        quoted(report.step(2).text())
        quoted(report.step(3).text())
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        for i in range(4):
            await m.move(m.register(tensor(i), name=f"v{i}"), "cuda:0")
        big = m.register(torch.zeros(4096), name="big")  # 16 KiB: every other value must go
        request = ResidencyRequest("huge", requirements=[ResidencyRequirement(big, "cuda:0")])
        with pytest.raises(ResidencySearchLimitError) as limited:
            ResidencyController(m, search_state_limit=3).decide_nowait(request)
        quoted(diagnose(limited.value, m).step(5).text())
