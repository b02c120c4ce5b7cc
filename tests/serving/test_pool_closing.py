"""``ModelPool``: closing it (``aclose``, ``async with pool``) and closing its manager while
requests are in flight, and what the pool refuses at construction. Simulated backend (CUDA
simulated in host memory); every test bounds itself with ``fail_after`` and waits on
conditions, never on a sleep."""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from typing import Any

import anyio
import pytest
import torch

from aresidency import ResidencyManager
from aresidency.runtime import ManagerClosedError
from aresidency.serving import DemandTracker, ModelPool

from ._models import TinyLM, assert_nothing_leaked, reference
from .test_pool import TOKENS, TOTAL, eventually, hold_copies

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("how", ["aclose", "async with pool"])
async def test_closing_the_pool_from_inside_its_own_request_is_refused_at_once(how: str) -> None:
    # A /shutdown handler inside a request: the close waits for every request to end, its
    # own included, so it would never return. Refused at once, the pool left as it was.
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        with anyio.fail_after(10):
            async with pool.use("a") as model:
                with pytest.raises(RuntimeError, match=r"cannot close the model pool from inside"):
                    if how == "aclose":
                        await pool.aclose()
                    else:
                        await pool.__aexit__(None, None, None)
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                assert "open" in repr(pool) and pool.models == ["a"]
            async with pool.use("a") as model:  # still serving: nothing changed
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
            assert_nothing_leaked(m, pool)
            await pool.aclose()
        assert pool.models == [] and "closed" in repr(pool)


async def test_a_cancelled_close_leaves_the_pool_closed_and_a_later_one_ends_it() -> None:
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        inside, go_on = anyio.Event(), anyio.Event()

        async def request() -> None:
            async with pool.use("a") as model:
                inside.set()
                await go_on.wait()
                assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(request)
                await inside.wait()
                with anyio.CancelScope() as close:

                    async def cancel_once_it_waits() -> None:
                        await anyio.wait_all_tasks_blocked()
                        close.cancel()

                    tasks.start_soon(cancel_once_it_waits)
                    await pool.aclose()
                assert close.cancelled_caught
                assert "closed" in repr(pool) and pool.models == ["a"]
                with pytest.raises(RuntimeError, match="the pool is closed"):
                    async with pool.use("a"):
                        pass
                go_on.set()
            await pool.aclose()
        assert pool.models == []


async def test_closing_the_manager_while_a_requests_copies_land_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The manager closes while the request's copies are in flight; they land during the
    # close, and the pool's hold in each copy's done callback is refused (the manager is
    # closing). The request gets ManagerClosedError; nothing is logged as an error (a done
    # callback that raised would be, with a traceback, once per group).
    caplog.set_level(logging.ERROR, logger="aresidency")
    gate = threading.Event()
    ready, close_now = anyio.Event(), anyio.Event()
    box: dict[str, Any] = {}
    outcome: list[BaseException] = []

    async def owner() -> None:
        async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
            pool = ModelPool(m)
            pool.add("a", TinyLM(seed=1))
            box.update(manager=m, pool=pool)
            ready.set()
            await close_now.wait()

    async def request() -> None:
        try:
            async with box["pool"].use("a"):
                pass
        except ManagerClosedError as error:
            outcome.append(error)

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(owner)
                await ready.wait()
                m, pool = box["manager"], box["pool"]
                hold_copies(m.backend, gate)
                tasks.start_soon(request)
                await eventually(lambda: m.state.ledger(pool.device).incoming_bytes > 0)
                close_now.set()  # the close waits for the copies held up by the gate
                await eventually(lambda: not m.running)
                gate.set()
    finally:
        gate.set()
    assert len(outcome) == 1, outcome
    notes = getattr(outcome[0], "__notes__", [])
    assert any("when the manager closed" in note for note in notes), notes
    # What it waited for: the copies (it was said to wait for "its admission (deciding, and
    # entering with the manager)", as a timeout then did too).
    assert any(f"copies of 'a' to cuda:0 to land (5 group(s), {TOTAL} B)" in n for n in notes)
    assert not any("while loading" in note for note in notes), notes  # (not a failed load)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    assert pool.admitted == 0 and pool.waiting == 0
    await pool.aclose()


async def test_stats_after_the_pool_closed_are_its_last_reading() -> None:
    async with ResidencyManager(budgets={"cuda:0": 2 * TOTAL}, backend="sim") as m:
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        with anyio.fail_after(10):
            for _ in range(2):
                async with pool.use("a") as model:
                    await model(TOKENS)
        await pool.aclose()
        stats = pool.stats()
        assert list(stats) == ["a"]
        assert stats["a"]["requests"] == 2 and stats["a"]["hits"] == 1
        assert stats["a"]["resident_bytes"] == 0 and stats["a"]["active"] == 0
        await pool.aclose()  # a second close keeps it
        assert pool.stats() == stats


@pytest.mark.parametrize("decision_log", ["x", 2.5, True, None])
async def test_a_decision_log_that_is_not_a_count_is_refused_by_name(decision_log: Any) -> None:
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(TypeError, match="decision_log must be an int"):
            ModelPool(m, decision_log=decision_log)
        with pytest.raises(ValueError, match="decision_log must be >= 0"):
            ModelPool(m, decision_log=-1)


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("fallback_graph", {"cuda:0": ["pinned-host"]}),
        ("fallback_graph", "pinned-host"),
        ("cost_model", {"bandwidths": ()}),
        ("cost_model", 3),
    ],
)
async def test_a_cost_model_or_fallback_graph_of_the_wrong_type_is_refused_by_name(
    keyword: str, value: Any
) -> None:
    # Accepted, a dict for the fallback graph failed every request that needed an eviction
    # with an AttributeError deep in the search (and a bad cost model an AttributeError at
    # construction that named neither). Refused at once now, naming the keyword; the pool
    # made after it serves and evicts as usual.
    async with ResidencyManager(budgets={"cuda:0": TOTAL + TOTAL // 2}, backend="sim") as m:
        with pytest.raises(TypeError, match=f"{keyword} must be an aresidency"):
            ModelPool(m, **{keyword: value})
        pool = ModelPool(m)
        pool.add("a", TinyLM(seed=1))
        pool.add("b", TinyLM(seed=2))
        for name in ["a", "b", "a"]:
            async with pool.use(name) as model:
                await model(TOKENS)
        assert pool.stats()["a"]["evictions"] >= 1
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("clock", [datetime.now, lambda: float("nan"), lambda: None])
async def test_a_clock_that_does_not_return_seconds_is_refused_by_name(clock: Any) -> None:
    # clock=datetime.now was accepted: the first request failed with a TypeError about
    # datetimes from deep in the demand arithmetic, and so did every later one, stats() and
    # aclose() (the pool could not be closed, its models never got their tensors back).
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(TypeError, match=r"clock must return seconds .* got "):
            ModelPool(m, clock=clock)
        with pytest.raises(TypeError, match=r"clock must return seconds"):
            DemandTracker(clock=clock)


@pytest.mark.parametrize(
    "keyword",
    ["defer_hot_evictions", "express_joins", "shared_calls", "one_thread", "direct_calls"],
)
@pytest.mark.parametrize("value", ["no", None, 1])
async def test_a_switch_that_is_not_true_or_false_is_refused_by_name(
    keyword: str, value: Any
) -> None:
    # shared_calls="no" was taken for its truth value (on), silently.
    async with ResidencyManager(backend="sim") as m:
        before = m.snapshot()
        with pytest.raises(TypeError, match=f"{keyword} must be True or False, got {value!r}"):
            ModelPool(m, **{keyword: value})
        assert m.snapshot() == before
        pool = ModelPool(m, **{keyword: False})
        assert getattr(pool, keyword) is False
        await pool.aclose()


@pytest.mark.parametrize("half_life", [0, -1.0, float("inf"), "30", True])
async def test_a_bad_demand_half_life_is_refused_under_its_own_name(half_life: Any) -> None:
    # The error said "half_life", a keyword the pool does not have.
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises((TypeError, ValueError), match=r"^demand_half_life must be a"):
            ModelPool(m, demand_half_life=half_life)
        with pytest.raises((TypeError, ValueError), match=r"^half_life must be a"):
            DemandTracker(half_life)


async def test_adding_a_model_that_is_not_a_module_names_pool_add() -> None:
    # It said "stream_module takes an nn.Module", a call the user never made.
    async with ResidencyManager(backend="sim") as m:
        pool = ModelPool(m)
        before = m.snapshot()
        with pytest.raises(
            TypeError, match=r"^pool.add takes an nn.Module as the model named 'x', got str"
        ):
            pool.add("x", "notamodule")  # type: ignore[arg-type]
        assert pool.models == [] and m.snapshot() == before
        pool.add("x", TinyLM(seed=1))  # the name is still free
        await pool.aclose()
