"""Work done in loop callbacks, on the simulated backend (CUDA simulated in host memory): who
entered a lease (the task's name, or ``NO_TASK`` when a loop callback entered it, as a copy's
completion does in a streamed call), and what a callback that raises costs (an error where it
belongs, never an operation that waits forever).

Earlier anyio 4.x releases raise ``TypeError`` from ``anyio.get_current_task()`` inside an
asyncio callback (they build the task's info from ``None``); recent ones raise
``RuntimeError``. The runtime must not depend on which: ``older_anyio`` gives the earlier
behaviour, and a streamed call from pageable memory, whose completions enter leases in
callbacks, must still end under it (it waited forever before)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterator

import anyio
import pytest
import torch

from aresidency import ReplicaMode, ResidencyManager
from aresidency.integrations import stream_module
from aresidency.runtime.leases import NO_TASK, current_owner

pytestmark = pytest.mark.anyio


@pytest.fixture
def older_anyio(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``anyio.get_current_task`` as earlier 4.x releases have it on asyncio: a ``TypeError``
    where there is no current task."""
    real = anyio.get_current_task

    def get_current_task() -> anyio.TaskInfo:
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return real()  # not on asyncio: as it is
        if task is None:
            raise TypeError("cannot create weak reference to 'NoneType' object")
        return real()

    monkeypatch.setattr(anyio, "get_current_task", get_current_task)
    yield


async def test_a_lease_names_its_task_or_no_task_in_a_loop_callback(older_anyio: None) -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(torch.arange(64.0), name="w")
        await m.materialize(h, "cuda:0")
        lease = m.acquire(h, "cuda:0")
        async with lease:
            assert lease.owner == anyio.get_current_task().name != NO_TASK
        entered = anyio.Event()
        owners: list[str | None] = []

        def in_a_callback() -> None:
            second = m.acquire(h, "cuda:0")
            second.enter_nowait()
            owners.append(second.owner)
            second.exit_nowait()
            entered.set()

        # A loop callback: on asyncio no task runs it; trio runs it in a system task of its
        # own, which then owns the lease.
        m._rt.bridge.call_soon(in_a_callback)
        with anyio.fail_after(10):  # a callback that raised never sets it
            await entered.wait()
        trio_task = "TrioToken.run_sync_soon task"
        assert owners == [NO_TASK] if m._rt.bridge.library != "trio" else [trio_task]
        assert current_owner() == anyio.get_current_task().name


@pytest.mark.parametrize("host", ["pageable-host", "pinned-host"])
async def test_a_streamed_call_ends_whatever_anyio_raises_outside_a_task(
    older_anyio: None, host: str
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
    block = (64 * 64 + 64) * 4 + 512
    async with ResidencyManager(budgets={"cuda:0": 3 * block}, backend="sim") as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=2, host=host)  # type: ignore[arg-type]
        for _ in range(3):
            with anyio.fail_after(30), torch.no_grad():
                y = await streamed(x)
            assert torch.allclose(y, expected)
        await streamed.drain()
        assert m.snapshot().location("cuda:0").used_bytes == 0
        await streamed.aclose()


async def test_a_listener_that_raises_leaves_the_operation_and_the_others_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The change signal's listeners run inside a commit: one that raises is logged, and the
    commit, the operation awaiting it and the other listeners go on."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(torch.arange(64.0), name="w")
        calls: list[str] = []

        def broken() -> None:
            calls.append("broken")
            raise ValueError("a listener's own bug")

        remove_broken = m.add_change_listener(broken)
        remove_other = m.add_change_listener(lambda: calls.append("other"))
        with caplog.at_level(logging.ERROR, logger="aresidency"), anyio.fail_after(10):
            await m.materialize(h, "cuda:0")
        remove_broken()
        remove_other()
        assert "broken" in calls and "other" in calls
        assert [r for r in caplog.records if "change signal raised" in r.getMessage()]
        assert {str(r.location) for r in m.snapshot().values[h].materializations} >= {"cuda:0"}


async def test_a_streamed_call_whose_lease_entry_fails_raises_that_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault of ours while a block's lease is entered (in a copy's completion callback)
    fails the call with that error instead of leaving the consumer waiting."""
    from aresidency.runtime import leases

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(4, 64)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=2, host="pageable-host")

        def broken_owner() -> str:
            raise KeyError("no owner today")

        monkeypatch.setattr(leases, "current_owner", broken_owner)
        with (
            anyio.fail_after(30),
            pytest.raises(KeyError, match="no owner today"),
            torch.no_grad(),
        ):
            await streamed(x)
        monkeypatch.undo()
        await streamed.drain()
        assert m.snapshot().location("cuda:0").used_bytes == 0  # the failed block's too
        with anyio.fail_after(30), torch.no_grad():
            assert torch.allclose(await streamed(x), model(x))  # the next call is whole
        await streamed.drain()
        assert m.snapshot().location("cuda:0").used_bytes == 0
        await streamed.aclose()


async def test_a_done_callback_that_raises_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operation's done callbacks are the user's as well as the runtime's (a streamed
    call's pipeline waits on one): one that raises must not keep the others from running."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(torch.arange(64.0), name="w")
        operation = m.materialize_nowait(h, "cuda:0")
        seen: list[str] = []

        def broken(_op: object) -> None:
            seen.append("broken")
            raise ValueError("a user's callback")

        operation.add_done_callback(broken)
        operation.add_done_callback(lambda _op: seen.append("after"))
        with caplog.at_level(logging.ERROR, logger="aresidency"), anyio.fail_after(10):
            await operation
        assert seen == ["broken", "after"]
        # Added once done: called at once, and its error logged, not raised.
        operation.add_done_callback(broken)
        assert seen == ["broken", "after", "broken"]
        raised = [r for r in caplog.records if "done callback" in r.getMessage()]
        assert len(raised) == 2
        with anyio.fail_after(10):
            await m.move(h, "pinned-host")  # the manager goes on as before
        assert {str(r.location) for r in m.snapshot().values[h].materializations} == {"pinned-host"}


async def _async_callback(*args: object) -> None:
    """A coroutine function: called as a callback, it would only make a coroutine."""


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (5, "not callable"),
        (None, "not callable"),
        (_async_callback, "coroutine function"),
        (functools.partial(_async_callback, 1), "coroutine function"),
    ],
    ids=["int", "None", "async-def", "partial-of-async-def"],
)
async def test_a_callback_that_cannot_be_called_as_one_is_refused_when_it_is_added(
    bad: object, words: str, caplog: pytest.LogCaptureFixture
) -> None:
    """add_change_listener(5) and add_reclaimer(5) were accepted: the listener then logged
    ``TypeError: 'int' object is not callable`` at every change of the state for the
    manager's life, and the reclaimer at every reclaim. An ``async def`` callback made a
    coroutine nobody awaited at each call (the work it meant never ran). Each is refused
    when it is added now, naming what it got, and nothing is added."""
    async with ResidencyManager(backend="sim") as m:
        h = m.register(torch.arange(64.0), name="w", replica_mode=ReplicaMode.REPLICABLE)
        pending = m.materialize_nowait(h, "cuda:0")
        adders = {
            "add_change_listener": m.add_change_listener,
            "add_reclaimer": m.add_reclaimer,
            "add_done_callback": pending.add_done_callback,
        }
        for name, add in adders.items():
            with pytest.raises(TypeError, match=words) as info:
                add(bad)  # type: ignore[arg-type]
            assert name in str(info.value)
        with caplog.at_level(logging.ERROR, logger="aresidency"), anyio.fail_after(10):
            await pending
            await m.materialize(h, "cuda:1")
        assert m.reclaim("cuda:0", 512) == 0  # no reclaimer was added
        assert not caplog.records


@pytest.mark.parametrize(
    ("nbytes", "error"), [(-1, ValueError), (True, TypeError), ("1KiB", TypeError)]
)
async def test_reclaim_refuses_a_byte_count_that_is_not_one(nbytes: object, error: type) -> None:
    """``reclaim(loc, -100)`` asked the reclaimers for -100 bytes (and answered 0): a
    caller's sign error passed for "nothing to give back"."""
    async with ResidencyManager(backend="sim") as m:
        asked: list[int] = []
        m.add_reclaimer(lambda location, n: asked.append(n) or 0)
        with pytest.raises(error, match="nbytes"):
            m.reclaim("cuda:0", nbytes)  # type: ignore[arg-type]
        assert asked == [] and m.reclaim("cuda:0", 0) == 0
