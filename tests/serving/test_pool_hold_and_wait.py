"""Tasks that each hold room and wait for room the others hold (hold and wait): two request
handlers, each inside its own ``pool.use`` block, iterating a ``DeviceLoader`` whose batches
fit only once the other handler's request ended, or one of them making a nested request
instead. Every such wait is registered with the manager (``manager.room_wait``): the one that
would close the cycle is refused at once, naming the others, and the other handler goes on in
the room the refused one gives back as it unwinds. Simulated backend (CUDA simulated in host
memory); each test bounds itself with ``fail_after`` and waits on conditions."""

from __future__ import annotations

import anyio
import pytest
import torch

from aresidency import ResidencyBudgetError, ResidencyManager, ResidencyPlanError
from aresidency.loader import DeviceLoader

from ._models import TinyLM, assert_nothing_leaked, reference
from .test_pool import TOKENS, TOTAL, eventually
from .test_pool_nested import pool_of

pytestmark = pytest.mark.anyio

# Both models held resident leave a quarter of a model free; a batch needs half of one.
BUDGET = 2 * TOTAL + TOTAL // 4
BATCH = TOTAL // 8  # float32 elements: half a model's bytes


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "managed"])
async def test_two_handlers_whose_loaders_wait_for_each_others_model(ring: bool) -> None:
    async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
        pool = pool_of(m, "ab")
        held = [anyio.Event(), anyio.Event()]
        first_waits = anyio.Event()
        outcome: dict[int, object] = {}
        data = [torch.randn(BATCH) for _ in range(3)]

        async def handler(index: int, name: str) -> None:
            async with pool.use(name) as model:
                assert model.mode == "resident"
                held[index].set()
                for event in held:
                    await event.wait()
                if index == 1:
                    await first_waits.wait()  # handler 0's loader waits first
                try:
                    async with DeviceLoader(
                        m, [t.clone() for t in data], "cuda:0", prefetch=1, ring=ring
                    ) as loader:
                        got = []
                        async for batch in loader:
                            got.append(batch.clone())
                            assert torch.equal(await model(TOKENS), reference(model.module, TOKENS))
                    assert all(torch.equal(g, d) for g, d in zip(got, data, strict=True))
                    outcome[index] = "done"
                except ResidencyBudgetError as error:
                    outcome[index] = error

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(handler, 0, "a")
                tasks.start_soon(handler, 1, "b")
                for event in held:
                    await event.wait()
                # handler 0's consumer waits for room only 'b' (handler 1's) keeps
                await eventually(lambda: len(m.room_waits()) == 1)
                task, where, need, what = m.room_waits()[0]
                assert "handler" in task and str(where) == "cuda:0" and "batch 0" in what
                assert need >= 4 * BATCH  # (float32: half a model)
                assert not outcome
                first_waits.set()
        assert outcome[0] == "done", outcome
        error = outcome[1]
        assert isinstance(error, ResidencyBudgetError), outcome
        message = str(error)
        assert "hold and wait" in message and "2 waiting tasks" in message
        assert "for 'a'" in message and "for 'b'" in message  # both tasks' requests named
        assert "loader" in message  # the wait it would have waited with
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_nested_request_and_a_loader_that_wait_for_each_others_model() -> None:
    # Handler 0 holds 'a' and iterates a loader that needs 'b''s room; handler 1 holds 'b'
    # and asks for 'c' (nested) in 'a''s room. The request closes the cycle: refused.
    async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
        pool = pool_of(m, "abc")
        held = [anyio.Event(), anyio.Event()]
        loader_waits = anyio.Event()
        outcome: dict[int, object] = {}

        async def with_loader() -> None:
            async with pool.use("a"):
                held[0].set()
                await held[1].wait()
                async with DeviceLoader(m, [torch.randn(BATCH)], "cuda:0", prefetch=1) as loader:
                    async for _ in loader:
                        pass
                outcome[0] = "done"

        async def nested() -> None:
            async with pool.use("b"):
                held[1].set()
                await loader_waits.wait()
                try:
                    async with pool.use("c") as c:
                        outcome[1] = c.mode
                except ResidencyPlanError as error:
                    outcome[1] = error

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(with_loader)
                tasks.start_soon(nested)
                for event in held:
                    await event.wait()
                # the loader waits for 'b''s room (its wait registered)
                await eventually(lambda: any("loader" in w[3] for w in m.room_waits()))
                assert not outcome
                loader_waits.set()
        assert outcome[0] == "done", outcome
        error = outcome[1]
        assert isinstance(error, ResidencyPlanError), outcome
        assert "would wait for ever" in str(error) and "hold and wait" in str(error)
        assert isinstance(error.__cause__, ResidencyBudgetError)
        assert_nothing_leaked(m, pool)
        await pool.aclose()


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "pipeline"])
async def test_a_streamed_call_and_a_loader_that_wait_for_each_others_model(ring: bool) -> None:
    # Handler 0 holds 'a' and calls a streamed model whose blocks fit only once 'b' left;
    # handler 1 holds 'b' and iterates a loader whose batch fits only once 'a' left. The
    # streamed call's wait for its block is registered (on the pipeline, from the loop's
    # callbacks, on behalf of the calling task, whose lease on the module's tensors outside
    # the blocks counts as that task's); the loader's closes the cycle and is refused.
    from aresidency.integrations import stream_module

    async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
        pool = pool_of(m, "ab")
        other = TinyLM(seed=5)
        expected = reference(other, TOKENS)
        streamed = stream_module(m, other, ring=ring, prefetch=1, name="s")
        held = [anyio.Event(), anyio.Event()]
        outcome: dict[int, object] = {}

        async def caller() -> None:
            async with pool.use("a"):
                held[0].set()
                await held[1].wait()
                outcome[0] = torch.equal(await streamed(TOKENS), expected)

        async def with_loader() -> None:
            async with pool.use("b"):
                held[1].set()
                await held[0].wait()
                await eventually(lambda: any(w[3].startswith("s: ") for w in m.room_waits()))
                try:
                    async with DeviceLoader(m, [torch.randn(BATCH)], "cuda:0") as loader:
                        async for _ in loader:
                            pass
                    outcome[1] = "done"
                except ResidencyBudgetError as error:
                    outcome[1] = error

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(caller)
                tasks.start_soon(with_loader)
        assert outcome[0] is True, outcome
        error = outcome[1]
        assert isinstance(error, ResidencyBudgetError), outcome
        assert "hold and wait" in str(error) and "s: s.block0" in str(error), str(error)
        assert m.room_waits() == []
        await streamed.aclose()
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_streamed_call_whose_resident_tensors_are_on_their_way_still_closes_the_cycle() -> (
    None
):
    # As above (pipeline), with the copy of the streamed module's tensors outside the blocks
    # (embedding, head) still in flight when the loader's wait registers: the call leases
    # them for its whole length once they land, so they are the calling task's, not room the
    # module gives back. Counted as given back, the streamed call's wait seemed able to end,
    # the loader's wait was registered beside it and both waited for ever (seen under load).
    import threading

    from aresidency.integrations import stream_module

    async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
        pool = pool_of(m, "ab")
        other = TinyLM(seed=5)
        expected = reference(other, TOKENS)
        streamed = stream_module(m, other, ring=False, prefetch=1, name="s")
        held = [anyio.Event(), anyio.Event()]
        outcome: dict[int, object] = {}
        gate = threading.Event()

        async def caller() -> None:
            async with pool.use("a"):
                held[0].set()
                await held[1].wait()
                h2d = m.backend.device_streams(0).h2d  # type: ignore[attr-defined]
                h2d.submit(lambda: gate.wait(10))  # holds up the copy of s's resident tensors
                outcome[0] = torch.equal(await streamed(TOKENS), expected)

        async def with_loader() -> None:
            async with pool.use("b"):
                held[1].set()
                await held[0].wait()
                await eventually(lambda: any(w[3].startswith("s: ") for w in m.room_waits()))
                try:
                    async with DeviceLoader(m, [torch.randn(BATCH)], "cuda:0") as loader:
                        async for _ in loader:
                            pass
                    outcome[1] = "done"
                except ResidencyBudgetError as error:
                    outcome[1] = error

        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(caller)
                    tasks.start_soon(with_loader)
                    await eventually(
                        lambda: 1 in outcome or any("batch" in w[3] for w in m.room_waits())
                    )
                    # refused at once, the resident tensors' copy still held up
                    assert 1 in outcome, m.room_waits()
                    gate.set()
        finally:
            gate.set()
        assert outcome[0] is True, outcome
        error = outcome[1]
        assert isinstance(error, ResidencyBudgetError), outcome
        assert "hold and wait" in str(error) and "s: s.block0" in str(error), str(error)
        assert m.room_waits() == []
        await streamed.aclose()
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_two_loaders_kept_out_by_a_value_another_tenant_moves_are_not_refused() -> None:
    # Each handler holds its model and its loader's batch (three models' bytes) would not fit
    # even once both requests ended: a value nobody protects (2.5 models' bytes) takes the
    # room, and only whoever owns it can move it. The two waits do not wait for each other:
    # neither is refused, and both go on once that value leaves.
    from aresidency import ReplicaMode

    budget = 5 * TOTAL
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        pool = pool_of(m, "ab")
        other = m.register(
            torch.zeros(5 * TOTAL // 8), name="other", replica_mode=ReplicaMode.REPLICABLE
        )
        await m.materialize(other, "cuda:0")
        held = [anyio.Event(), anyio.Event()]
        done: list[int] = []

        async def handler(index: int, name: str) -> None:
            async with pool.use(name):
                held[index].set()
                for event in held:
                    await event.wait()
                data = [torch.randn(3 * TOTAL // 4)]
                async with DeviceLoader(m, data, "cuda:0", prefetch=0) as loader:
                    async for batch in loader:
                        assert torch.equal(batch, data[0])
                done.append(index)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(handler, 0, "a")
                tasks.start_soon(handler, 1, "b")
                await eventually(lambda: len(m.room_waits()) == 2)  # both wait, neither refused
                assert not done
                await m.release(other, "cuda:0")
        assert sorted(done) == [0, 1]
        assert_nothing_leaked(m, pool)
        await pool.aclose()


async def test_a_dump_taken_while_tenants_wait_for_room_names_who_waits_for_what(
    tmp_path: object,
) -> None:
    # While a handler's loader waits for room another handler's model keeps, the dump (and
    # diagnose, from it) lists the registered wait: which task, what for, how many bytes.
    from pathlib import Path

    from aresidency.diagnosis import diagnose_dump
    from aresidency.diagnosis.evidence import read_dump

    async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
        pool = pool_of(m, "ab")
        held = [anyio.Event(), anyio.Event()]
        release = anyio.Event()

        async def holder() -> None:
            async with pool.use("b"):
                held[1].set()
                await release.wait()

        async def with_loader() -> None:
            async with pool.use("a"):
                held[0].set()
                await held[1].wait()
                data = [torch.randn(BATCH)]
                async with DeviceLoader(m, data, "cuda:0", name="inputs") as loader:
                    async for _ in loader:
                        pass

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(holder)
                tasks.start_soon(with_loader)
                await eventually(lambda: len(m.room_waits()) == 1)
                path = m.dump(Path(str(tmp_path)) / "dump.json")
                release.set()
        (wait,) = read_dump(path)[1].room_waits
        assert wait.what.startswith("batch 0 of inputs") and wait.nbytes >= 4 * BATCH
        assert str(wait.location) == "cuda:0" and "with_loader" in wait.task
        report = str(diagnose_dump(path))
        assert "1 wait(s) for room registered: task" in report and "batch 0 of inputs" in report
        assert m.room_waits() == []
        await pool.aclose()


@pytest.mark.parametrize("kind", ["nested request", "loader", "scope", "streamed call"])
async def test_a_wait_for_room_cancelled_leaves_no_registration(kind: str) -> None:
    # Each kind of tenant waits for room another handler's model keeps, inside its own
    # request; cancelled there, it unregisters its wait (a later wait is not judged against
    # it) and leaves nothing behind; the model it waited beside is still served.
    from aresidency import Move, ResidencyPlan
    from aresidency.integrations import stream_module

    async with ResidencyManager(budgets={"cuda:0": BUDGET}, backend="sim") as m:
        pool = pool_of(m, "abc")
        streamed = stream_module(m, TinyLM(seed=7), name="s") if kind == "streamed call" else None
        value = m.register(torch.zeros(BATCH), name="x")
        held, release = anyio.Event(), anyio.Event()

        async def holder() -> None:
            async with pool.use("b"):
                held.set()
                await release.wait()

        async def waiter(cancel: anyio.CancelScope) -> None:
            await held.wait()
            async with pool.use("a") as a:
                with cancel:
                    if kind == "nested request":
                        async with pool.use("c"):
                            pass
                    elif kind == "loader":
                        async with DeviceLoader(m, [torch.randn(BATCH)], "cuda:0") as loader:
                            async for _ in loader:
                                pass
                    elif kind == "scope":
                        async with m.scope(ResidencyPlan(enter=[Move(value, "cuda:0")])):
                            pass
                    else:
                        assert streamed is not None
                        await streamed(TOKENS)
                assert cancel.cancelled_caught
                assert torch.equal(await a(TOKENS), reference(a.module, TOKENS))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(holder)
                cancel = anyio.CancelScope()
                tasks.start_soon(waiter, cancel)
                await eventually(lambda: len(m.room_waits()) == 1)
                cancel.cancel()
                await eventually(lambda: not m.room_waits())
                release.set()
        assert m.room_waits() == []
        if streamed is not None:
            await streamed.aclose()
        assert_nothing_leaked(m, pool)
        await pool.aclose()
