"""Weight streaming used the way a user may use it without reading every line of the docs, on
the simulated backend (released device memory is poisoned, so a read after release shows):
inputs that require grad deep inside the arguments, weights changed or replaced between calls,
outputs that are views of the weights, blocks that nest, two streamed models sharing a budget,
a manager closed before the streamed module."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import threading
import warnings
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import pytest
import torch
from torch import nn

from aresidency import (
    DeviceLoader,
    MemoryReservation,
    ResidencyManager,
    ResidencyPlan,
)
from aresidency.integrations import StreamedModule, stream_module
from aresidency.integrations.streaming import HostKind
from aresidency.runtime import ManagerClosedError

from ._models import Block, Net, linears

pytestmark = pytest.mark.anyio

RINGS = [pytest.param(None, id="ring"), pytest.param(False, id="no-ring")]


def expected(model: nn.Module, *args: object) -> torch.Tensor:
    with torch.no_grad():
        out = copy.deepcopy(model)(*args)
    assert isinstance(out, torch.Tensor)
    return out


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor


class DictNet(Net):
    def forward(self, batch: object) -> torch.Tensor:  # type: ignore[override]
        x = (
            batch["x"]
            if isinstance(batch, dict)
            else batch[0]
            if isinstance(batch, list)
            else batch.x
        )  # type: ignore[attr-defined,index]
        return super().forward(x)


@pytest.mark.parametrize(
    "wrap, where",
    [
        (lambda x: {"x": x}, "args[0]['x']"),
        (lambda x: [x], "args[0][0]"),
        (lambda x: Inputs(x), "args[0].x"),
    ],
    ids=["dict", "list", "dataclass"],
)
async def test_an_input_requiring_grad_deep_in_the_arguments_is_refused(
    wrap: object, where: str
) -> None:
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, DictNet(n=2))
        x = torch.randn(2, 16, requires_grad=True)
        with pytest.raises(ValueError, match="inference") as caught:
            await streamed(wrap(x))  # type: ignore[operator]
        assert where in str(caught.value)
        with torch.no_grad():
            y = await streamed(wrap(x))  # type: ignore[operator]
        assert torch.equal(y, expected(DictNet(n=2), wrap(x.detach())))  # type: ignore[operator]
        await streamed.aclose()


def _budget_keeping_half(streamed: object) -> int:
    s = streamed
    return int(s.resident_bytes + 3 * max(s.block_bytes) + sum(s.block_bytes) // 2)  # type: ignore[attr-defined]


@pytest.mark.parametrize("ring", RINGS)
async def test_weights_loaded_in_place_between_calls_are_the_ones_the_next_call_runs(
    ring: bool | None,
) -> None:
    """``load_state_dict`` (in place) after a call that left groups on the device: the next
    call runs the new weights, not the kept replicas of the old ones."""
    model, other = Net(seed=0), Net(seed=7)
    x = torch.randn(4, 16)
    old, new = expected(model, x), expected(other, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=1, ring=ring)
        m.set_budget("cuda:0", _budget_keeping_half(streamed))
        with torch.no_grad():
            assert torch.equal(await streamed(x), old)
        await streamed.drain()
        assert streamed.kept, "the budget keeps groups between calls"
        model.load_state_dict(other.state_dict())
        with torch.no_grad():
            assert torch.equal(await streamed(x), new)
            assert torch.equal(await streamed(x), new)
            with torch.no_grad():
                model.layers[2].mix.mul_(2.0)  # one tensor of one block, in place
                other.layers[2].mix.mul_(2.0)
            assert torch.equal(await streamed(x), expected(other, x))
        await streamed.aclose()
    assert torch.equal(expected(model, x), expected(other, x))


@pytest.mark.parametrize(
    "replace",
    [
        lambda model: model.load_state_dict(Net(seed=3).state_dict(), assign=True),
        lambda model: model.half(),
        lambda model: setattr(model.layers[1], "gate", nn.Parameter(torch.zeros(32))),
    ],
    ids=["assign", "half", "new-parameter"],
)
async def test_weights_replaced_between_calls_are_refused_by_name(replace: object) -> None:
    model = Net()
    x = torch.randn(4, 16)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        with torch.no_grad():
            await streamed(x)
        replace(model)  # type: ignore[operator]
        with (
            pytest.raises(ValueError, match="was replaced since stream_module") as caught,
            torch.no_grad(),
        ):
            await streamed(x)
        assert "layers." in str(caught.value) or "embed." in str(caught.value)
        await streamed.aclose()


@pytest.mark.parametrize(
    "replace, where",
    [
        (lambda model: setattr(model, "head", nn.Linear(32, 8)), "head"),
        (lambda model: setattr(model.layers[1], "up", nn.Linear(32, 64)), "layers.1.up"),
        (lambda model: model.layers.__setitem__(2, Block(32, 9)), "layers.2"),
        (lambda model: setattr(model.layers[3], "norm", None), "layers.3.norm"),
        (lambda model: model.layers.append(Block(32, 9)), "layers.4"),
    ],
    ids=["head", "in-a-block", "block", "removed", "added"],
)
async def test_a_submodule_replaced_between_calls_is_refused_by_name(
    replace: Callable[[nn.Module], object], where: str
) -> None:
    """A new module put in place of one with tensors (a new head, a block's layer, a block,
    an adapter injected), or added (a block appended), ran with weights never packed: its
    host tensors, which on a GPU meet the activations on the device, and a new block has no
    streaming hooks. The next call is refused naming it, as for a replaced tensor. A module
    without tensors swapped for another (an activation) changes nothing streamed and is run
    as it is."""
    model = Net(n=4)
    x = torch.randn(4, 16)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        with torch.no_grad():
            await streamed(x)
        model.small[0] = nn.ReLU()  # no tensors: fine
        with torch.no_grad():
            assert torch.equal(await streamed(x), expected(model, x))
        replace(model)
        refused = f"{where} .*(was replaced|was removed|was added) .*since stream_module"
        with pytest.raises(ValueError, match=refused), torch.no_grad():
            await streamed(x)
        await streamed.aclose()


class Aliasing(nn.Module):
    """Returns views of its weights and buffers besides its output, as a module may."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.layers = nn.ModuleList(AliasBlock() for _ in range(3))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.embed(ids)
        pos = None
        for layer in self.layers:
            h, pos = layer(h)
        return h, self.embed.weight, self.embed.weight[:4].t(), pos


class AliasBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("pos", torch.arange(16.0))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.linear(h)), self.pos[:5]


@pytest.mark.parametrize("ring", RINGS)
async def test_outputs_that_are_views_of_the_weights_stay_valid(ring: bool | None) -> None:
    model = Aliasing()
    ids = torch.randint(0, 20, (2, 3))
    with torch.no_grad():
        want = [t.clone() for t in model(ids)]
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=1, ring=ring, keep_resident=False)
        with torch.no_grad():
            got = await streamed(ids)
            await streamed(ids)  # the ring's buffers and the replicas are reused
        await streamed.drain()  # every device replica released (and poisoned)
        for have, wanted in zip(got, want):
            assert torch.equal(have, wanted)
        await streamed.aclose()


@pytest.mark.parametrize(
    "name, error", [(5, TypeError), (("a",), TypeError), ("  ", ValueError), ("", ValueError)]
)
async def test_a_name_that_is_not_a_non_blank_string_is_refused(
    name: object, error: type[Exception]
) -> None:
    """``name=`` names the values, ring reservations and errors: a number or a tuple was
    taken as it came (``5.block0``), a blank one named nothing."""
    model = Net(n=2)
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(error, match="name must"):
            stream_module(m, model, name=name)  # type: ignore[arg-type]
        assert len(m.snapshot().values) == 0, "nothing was registered"
        streamed = stream_module(m, model, name="net")  # the module is untouched
        await streamed.aclose()


@pytest.mark.parametrize(
    "argument, error, match",
    [
        ({"keep_resident": None}, TypeError, "keep_resident must be True or False, got None"),
        ({"keep_resident": "no"}, TypeError, "keep_resident must be True or False, got 'no'"),
        ({"checkpoint": 3}, TypeError, "checkpoint must be a path .* got int"),
        ({"checkpoint": ""}, ValueError, "checkpoint must name a file or directory, got ''"),
        ({"checkpoint": "x", "host": "cpu"}, ValueError, "host must be .* got 'cpu'"),
    ],
)
async def test_a_keep_resident_or_checkpoint_of_the_wrong_kind_is_refused_naming_it(
    argument: dict[str, object], error: type[Exception], match: str
) -> None:
    """``keep_resident=None`` (or ``"no"``) was taken for its truth value; ``checkpoint=3``
    failed inside ``pathlib`` without saying which argument; ``checkpoint=""`` was read as
    the current directory; a wrong ``host=`` beside a checkpoint passed unseen."""
    model = Net(n=2)
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(error, match=match):
            stream_module(m, model, **argument)  # type: ignore[arg-type]
        assert len(m.snapshot().values) == 0, "nothing was registered"
        streamed = stream_module(m, model, name="net")  # the module is untouched
        await streamed.aclose()


async def test_aclose_or_drain_from_another_thread_is_refused_and_closes_nothing() -> None:
    """``aclose()`` run on another thread's loop got as far as removing the hooks and giving
    the module its tensors back, then failed at the manager's thread check with every value
    still registered: a closed module whose weights the manager kept for ever. ``drain()``
    there read the loop's state. Both now refuse at once, and the module streams on."""
    model = Net(n=3)
    x = torch.randn(4, 16)
    want = expected(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, name="net")
        errors: list[BaseException] = []

        def other() -> None:
            for call in (streamed.aclose, streamed.drain):
                try:
                    asyncio.run(call())
                except BaseException as e:
                    errors.append(e)

        thread = threading.Thread(target=other)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        assert [type(e) for e in errors] == [RuntimeError, RuntimeError]
        assert all("event loop" in str(e) for e in errors)
        with anyio.fail_after(10), torch.no_grad():
            assert torch.equal(await streamed(x), want)
        await streamed.aclose()
        assert len(m.snapshot().values) == 0, "aclose on the loop discards every value"


async def test_blocks_that_nest_or_are_not_the_modules_are_refused() -> None:
    model = Net(n=3)
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(ValueError, match=r"'layers\.0\.up' inside 'layers\.0'"):
            stream_module(m, model, blocks=[model.layers[0], model.layers[0].up, model.layers[1]])
        with pytest.raises(ValueError, match="not a submodule"):
            stream_module(m, model, blocks=[*model.layers, nn.Linear(2, 2)])
        with pytest.raises(ValueError, match="blocks= is empty"):
            stream_module(m, model, blocks=[])
        with pytest.raises(TypeError, match=r"blocks\[1\] is a str"):
            stream_module(m, model, blocks=[model.layers[0], "layers.1"])  # type: ignore[list-item]
        assert len(m.snapshot().values) == 0, "nothing was registered"
        # The same block twice (run twice per call) is fine.
        streamed = stream_module(m, model, blocks=[model.layers[0], model.layers[0]])
        await streamed.aclose()


@pytest.mark.parametrize("ring", RINGS)
async def test_a_second_streamed_model_takes_the_room_the_first_keeps(ring: bool | None) -> None:
    """Model A keeps its groups on the device between calls; model B, called next, needs
    the room: A's kept groups leave for B (they are a cache), and A runs again after."""
    a, b = await anyio.to_thread.run_sync(lambda: (Net(seed=0), Net(d=48, seed=1)))
    x = torch.randn(4, 16)
    want_a, want_b = await anyio.to_thread.run_sync(lambda: (expected(a, x), expected(b, x)))
    async with ResidencyManager(backend="sim") as m:
        sa = stream_module(m, a, prefetch=1, ring=ring)
        await anyio.lowlevel.checkpoint()
        sb = stream_module(m, b, prefetch=1, ring=ring)
        m.set_budget("cuda:0", sa.resident_bytes + sum(sa.block_bytes))  # all of A
        with torch.no_grad():
            assert torch.equal(await sa(x), want_a)
        await sa.drain()
        assert sa.kept, "A keeps its groups"
        with anyio.fail_after(10), torch.no_grad():
            assert torch.equal(await sb(x), want_b)
            assert torch.equal(await sa(x), want_a)
        await sa.aclose()
        await sb.aclose()


@pytest.mark.parametrize("ring", RINGS)
async def test_a_loader_or_a_scope_takes_the_room_an_idle_module_keeps(ring: bool | None) -> None:
    """What an idle streamed module keeps between calls is a cache, but only another
    streamed module's call got it back: a ``DeviceLoader`` batch or a scope that fit only
    without it waited for ever (or timed out) behind a model nobody was calling. The module
    now offers it (``manager.add_reclaimer``), as a model pool offers its idle models."""
    model = Net(n=4)
    x = torch.randn(4, 16)
    want = expected(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=1, ring=ring)
        budget = streamed.resident_bytes + sum(streamed.block_bytes)
        m.set_budget("cuda:0", budget)
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(await streamed(x), want)  # it plans (again), and keeps
            await streamed.drain()
            kept = m.snapshot().location("cuda:0").used_bytes
            assert kept > 1024 and streamed.kept
            short = budget - kept + 1  # fits only without what the module keeps
            if _ == 0:
                batches = [torch.zeros(short // 4 + 1)]
                async with DeviceLoader(m, batches, "cuda:0", prefetch=0, timeout=10) as loader:
                    got = [batch async for batch in loader]
                assert len(got) == 1
            else:
                plan = ResidencyPlan(reserve=[MemoryReservation("kv", "cuda:0", short)])
                with anyio.fail_after(10):
                    async with m.scope(plan, timeout=10):
                        assert not streamed.kept
        await streamed.aclose()


async def test_closing_the_manager_first_leaves_the_module_its_own_weights() -> None:
    model = Net()
    x = torch.randn(4, 16)
    want = expected(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        with torch.no_grad():
            await streamed(x)
    assert "closed" in repr(streamed)
    await streamed.aclose()  # nothing left to release: no error
    with torch.no_grad():
        assert torch.equal(model(x), want)
    with pytest.raises(RuntimeError, match="closed"):
        await streamed(x)


async def test_a_budget_too_small_names_the_largest_block() -> None:
    model = Net(n=3)
    model.layers[1].up = nn.Linear(32, 512)  # the largest block by far
    model.layers[1].down = nn.Linear(512, 32)
    async with ResidencyManager(backend="sim", budgets={"cuda:0": 48 << 10}) as m:
        with pytest.raises(ValueError, match=r"the largest block \(layers\.1, "):
            stream_module(m, model)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])  # the call makes 6 allocations
async def test_out_of_memory_on_a_prefetch_is_raised_by_the_call(
    k: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The device's out-of-memory error on the k-th allocation of a call (a prefetch begun
    from a loop callback, not by the awaiting task): the call raises it, nothing is left
    charged or in use, nothing escapes into the event loop, and the next call runs."""
    model = Net()
    x = torch.randn(4, 16)
    want = expected(model, x)
    async with ResidencyManager(backend="sim", budgets={"cuda:0": 1 << 20}) as m:
        streamed = stream_module(m, model, prefetch=2, ring=False, keep_resident=False)
        with torch.no_grad():
            assert torch.equal(await streamed(x), want)
        m.backend.faults.oom_at_allocation = k
        with (
            caplog.at_level("ERROR"),
            torch.no_grad(),
            pytest.raises(torch.OutOfMemoryError, match="injected allocation failure"),
        ):
            await streamed(x)
        assert "Exception in callback" not in caplog.text
        await streamed.drain()
        assert m.snapshot().location("cuda:0").used_bytes == 0
        with torch.no_grad():
            assert torch.equal(await streamed(x), want)
        await streamed.aclose()


REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="unset")


class ContextNet(Net):
    """Records, in its forward, the context variable a server sets per request."""

    seen: list[str]

    def forward(self, x: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
        self.seen.append(REQUEST.get())
        return super().forward(x, shift=shift)


@pytest.mark.parametrize("ring", RINGS)
async def test_the_forward_sees_the_callers_context_variables(ring: bool | None) -> None:
    """The worker thread ran the forward in its own empty context: a request id (or tracing
    span) the calling task had set read as its default there. It runs in a copy of the
    caller's context now, as ``asyncio.to_thread`` runs a function; each call in its own
    task's, and what the forward sets stays there."""
    model = ContextNet(n=3)
    model.seen = []
    x = torch.randn(4, 16)
    want = expected(model, x)
    model.seen.clear()
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, ring=ring)

        async def call(request: str) -> None:
            # (no torch.no_grad() here: grad mode is the thread's, and two tasks that each
            # enter and leave it around an await restore each other's mode out of order)
            REQUEST.set(request)
            assert torch.equal(await streamed(x), want)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call, "a")
            tasks.start_soon(call, "b")
        assert sorted(model.seen) == ["a", "b"]
        assert REQUEST.get() == "unset"
        await streamed.aclose()


async def test_a_module_made_under_inference_mode_streams() -> None:
    """Its tensors keep no version counter: streaming works, in-place writes are not seen."""
    with torch.inference_mode():
        model = Net()
        x = torch.randn(4, 16)
        want = model(x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        with torch.inference_mode():
            assert torch.equal(await streamed(x), want)
            assert torch.equal(await streamed(x), want)
        await streamed.aclose()


async def test_a_streamed_model_can_be_copied_and_saved() -> None:
    """``copy.deepcopy`` and ``torch.save`` of a module while it is streamed: the copies are
    plain modules (their hooks do nothing) that compute what the original does. (A block
    that mixes dtypes cannot be saved whole: torch refuses to save views of one buffer as
    different types; see docs/streaming.md.)"""
    import io

    model, single = Net(), Plain()
    x = torch.randn(4, 16)
    want, want_single = expected(model, x), expected(single, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        streamed_single = stream_module(m, single)
        with torch.no_grad():
            await streamed(x)
            await streamed_single(x)
        twin = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(single, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        with torch.no_grad():
            assert torch.equal(twin(x), want)
            assert torch.equal(loaded(x), want_single)
            assert torch.equal(await streamed(x), want)
            assert torch.equal(await streamed_single(x), want_single)
        await streamed.aclose()
        await streamed_single.aclose()


class Plain(nn.Module):
    """Blocks of one dtype, run by the model's own forward (so it has streaming hooks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Gate(nn.Module):
    """A block that says when it runs (``entered``) and then waits until the test lets it go
    on (``go``): the test acts while the call is inside it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.entered = threading.Event()
        self.go = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.go.wait(30)  # (bounded: a test that went wrong fails, it does not hang)
        return torch.tanh(self.linear(x))


class GatedNet(nn.Module):
    """Four blocks run by the model's own forward (in the streaming worker thread), the
    second one a :class:`Gate`."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.gate = Gate(d)
        self.layers = nn.ModuleList([nn.Linear(d, d), self.gate, nn.Linear(d, d), nn.Linear(d, d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


WAYS = [
    pytest.param(None, "pinned-host", id="ring"),
    pytest.param(False, "pinned-host", id="values"),
    pytest.param(None, "pageable-host", id="pageable"),
]


async def close_during(
    prepare: Callable[[ResidencyManager], Awaitable[StreamedModule]],
    x: torch.Tensor,
    ready: Callable[[ResidencyManager], Awaitable[object]],
    after_close: Callable[[], object] = lambda: None,
) -> tuple[StreamedModule, list[BaseException]]:
    """Open a manager, ``prepare`` a streamed module in it, start a call on ``x``, wait for
    ``ready(manager)``, close the manager, call ``after_close()``. Returns the module and
    what the call raised (its ``fail_after`` turns a hang into a ``TimeoutError``)."""
    raised: list[BaseException] = []

    async def call(streamed: StreamedModule) -> None:
        try:
            with anyio.fail_after(20), torch.no_grad():
                await streamed(x)
        except Exception as error:
            raised.append(error)

    async with anyio.create_task_group() as tasks:
        m = ResidencyManager(backend="sim")
        await m.__aenter__()
        try:
            streamed = await prepare(m)
            tasks.start_soon(call, streamed)
            with anyio.fail_after(20):
                await ready(m)
        finally:
            await m.__aexit__(None, None, None)
            after_close()
    return streamed, raised


@pytest.mark.parametrize("ring, host", WAYS)
async def test_closing_the_manager_while_a_block_runs_raises_manager_closed(
    ring: bool | None, host: HostKind
) -> None:
    """The manager closes while a block of the call runs (its next blocks in flight or
    waiting for room): the call ends with ``ManagerClosedError`` once the block is done (not
    a hang, not an error in a loop callback, not a closed stream's ``RuntimeError``), and
    the module computes as a plain module again after ``aclose()``."""
    model = GatedNet()
    x = torch.randn(2, 16)
    gate = model.gate
    gate.go.set()
    with torch.no_grad():
        want = model(x)
    gate.go.clear()
    gate.entered.clear()

    async def prepare(m: ResidencyManager) -> StreamedModule:
        streamed = stream_module(m, model, prefetch=1, ring=ring, host=host)
        m.set_budget("cuda:0", 2 * max(streamed.block_bytes))
        return streamed

    async def entered(m: ResidencyManager) -> None:
        await anyio.to_thread.run_sync(gate.entered.wait, 20)

    try:
        streamed, raised = await close_during(prepare, x, entered, gate.go.set)
    finally:
        gate.go.set()
    assert len(raised) == 1 and isinstance(raised[0], ManagerClosedError), raised
    assert "the manager closed during the call" in str(raised[0])
    assert streamed.current_call is None
    await streamed.aclose()
    with torch.no_grad():
        assert torch.equal(model(x), want)


@pytest.mark.parametrize("ring, host", WAYS)
@pytest.mark.parametrize("kind", ["sequential", "forward"])
async def test_closing_the_manager_while_a_block_waits_for_room_raises_manager_closed(
    ring: bool | None, host: HostKind, kind: str
) -> None:
    """The call waits for room another tenant holds (nothing of the call's own is in
    flight, so no callback of its own comes) when the manager closes: it raises
    ``ManagerClosedError`` at once, on the loop's runner and in the forward's thread."""
    model = linears(d=16, n=3) if kind == "sequential" else Plain()

    streamed: StreamedModule | None = None

    async def prepare(m: ResidencyManager) -> StreamedModule:
        nonlocal streamed
        streamed = stream_module(m, model, prefetch=1, ring=ring, host=host)
        need = streamed.resident_bytes + max(streamed.block_bytes)
        m.set_budget("cuda:0", need)
        other = m.register(torch.zeros(need // 4), name="other")
        await m.materialize(other, "cuda:0")  # the whole budget
        return streamed

    def waiting(m: ResidencyManager) -> bool:
        # (and the consumer's request for the first block was taken: the window opened)
        assert streamed is not None
        call = streamed.current_call
        return m.waiting_for_room("cuda:0") and getattr(call, "window_open", True)

    async def blocked(m: ResidencyManager) -> None:
        while not waiting(m):
            await m.wait_for_change(0.01)  # (the consumer thread's request changes nothing)

    streamed, raised = await close_during(prepare, torch.randn(2, 16), blocked)
    assert len(raised) == 1 and isinstance(raised[0], ManagerClosedError), raised
    assert streamed.current_call is None
    await streamed.aclose()


@pytest.mark.parametrize("ring, host", WAYS)
async def test_a_call_that_starts_as_the_manager_closes_names_the_module(
    ring: bool | None, host: HostKind
) -> None:
    """A call queued behind another when the manager closes, and a call made after it closed,
    raised the manager's own ``ManagerClosedError`` ("the manager is closed: it carries out
    nothing more", or, without a ring, "... it has no loop to call"), which named no module:
    both name it and say the manager closed, so the call could not start."""
    model = GatedNet()
    gate = model.gate
    gate.go.clear()
    gate.entered.clear()
    raised: dict[str, BaseException] = {}

    async def call(name: str, streamed: StreamedModule) -> None:
        # (no torch.no_grad() around the await: grad mode is the thread's, and two tasks
        # exiting theirs out of order would leave it off; a streamed call needs none)
        try:
            with anyio.fail_after(20):
                await streamed(torch.randn(2, 16))
        except Exception as error:
            raised[name] = error

    try:
        async with anyio.create_task_group() as tasks:
            m = ResidencyManager(backend="sim")
            await m.__aenter__()
            try:
                streamed = stream_module(m, model, prefetch=1, ring=ring, host=host, name="gated")
                tasks.start_soon(call, "running", streamed)
                await anyio.to_thread.run_sync(gate.entered.wait, 20)
                tasks.start_soon(call, "queued", streamed)
                await anyio.wait_all_tasks_blocked()  # it waits for the running call's turn
            finally:
                await m.__aexit__(None, None, None)
                gate.go.set()
        await call("after", streamed)
    finally:
        gate.go.set()
    assert sorted(raised) == ["after", "queued", "running"], raised
    assert all(isinstance(error, ManagerClosedError) for error in raised.values()), raised
    assert str(raised["running"]).startswith("gated: the manager closed during the call")
    for name in ("queued", "after"):
        # (the queued one as the manager closes: its wait ends then, "the manager is closing")
        assert str(raised[name]).startswith(
            "gated: the manager closed, so this call cannot start (the manager is clos"
        ), raised[name]
    # from another thread too (it had "the manager is closed: it has no loop to call")
    with pytest.raises(ManagerClosedError, match=r"^gated: the manager closed, so this call"):
        await anyio.to_thread.run_sync(streamed.call_threadsafe, torch.randn(2, 16))
    await streamed.aclose()


@pytest.mark.parametrize("ring", [None, False], ids=["ring", "values"])
async def test_calls_waiting_behind_a_call_that_never_ends_end_when_the_manager_closes(
    ring: bool | None,
) -> None:
    """A call's forward blocks for good (here until the test lets it go) when the manager
    closes. The calls waiting behind it, one of the same module (for its turn) and, without a
    ring, one of another module at the device (for the admission turn the first call holds
    until it ends), waited until it ended, for ever if it never did: they raise
    ``ManagerClosedError`` at once, naming their module."""
    model = GatedNet()
    gate = model.gate
    gate.go.clear()
    gate.entered.clear()
    raised: dict[str, BaseException] = {}
    ended = {name: anyio.Event() for name in ("stuck", "queued", "other")}

    async def call(name: str, streamed: StreamedModule) -> None:
        try:
            with anyio.fail_after(20):
                await streamed(torch.randn(2, 16))
        except Exception as error:
            raised[name] = error
        finally:
            ended[name].set()

    try:
        async with anyio.create_task_group() as tasks:
            m = ResidencyManager(backend="sim")
            await m.__aenter__()
            try:
                stuck = stream_module(m, model, prefetch=1, ring=ring, name="stuck")
                other = stream_module(m, linears(d=16, n=2), name="other")
                tasks.start_soon(call, "stuck", stuck)
                await anyio.to_thread.run_sync(gate.entered.wait, 20)
                tasks.start_soon(call, "queued", stuck)
                tasks.start_soon(call, "other", other)
                await anyio.wait_all_tasks_blocked()
            finally:
                await m.__aexit__(None, None, None)
            with anyio.fail_after(10):  # (the stuck call's block waits 30 s at most)
                await ended["queued"].wait()
                await ended["other"].wait()
            assert not ended["stuck"].is_set()
            gate.go.set()
    finally:
        gate.go.set()
    assert str(raised["queued"]).startswith("stuck: the manager closed, so this call cannot")
    if ring is False:
        assert str(raised["other"]).startswith("other: the manager closed, so this call")
    else:  # (the ring call's turn ended once its ring was reserved: it ran, or was running)
        assert "other" not in raised or isinstance(raised["other"], ManagerClosedError), raised
    assert isinstance(raised["stuck"], ManagerClosedError), raised
    await stuck.aclose()
    await other.aclose()


async def test_a_module_streamed_by_another_manager_is_refused_until_aclose() -> None:
    """The same module streamed by a second manager would point its tensors at the second
    manager's host copy, and break the first streamed module for good: refused, naming the
    other streamed module, and nothing changed; after the first one's ``aclose()`` it is
    fine."""
    model = Net(n=3)
    x = torch.randn(4, 16)
    want = expected(model, x)
    async with ResidencyManager(backend="sim") as m1, ResidencyManager(backend="sim") as m2:
        first = stream_module(m1, model, name="first")
        with pytest.raises(ValueError, match=r"another manager .* streams already \(first"):
            stream_module(m2, model, "cuda:1")
        with pytest.raises(ValueError, match=r"another manager .* \(first"):
            stream_module(m2, model.layers)  # a submodule of it, too
        assert len(m2.snapshot().values) == 0, "nothing was registered"
        with torch.no_grad():
            assert torch.equal(await first(x), want)
        await first.aclose()
        second = stream_module(m2, model, "cuda:1")
        with torch.no_grad():
            assert torch.equal(await second(x), want)
        await second.aclose()


class Counting(nn.Module):
    """A block whose forward replaces one of its buffers (``self.calls = self.calls + 1``, a
    new tensor each call, as a dynamic RoPE's ``register_buffer`` is), and whose output
    depends on it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.linear(x) * self.calls


def counting(kind: str) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Linear(8, 8), Counting(8), nn.Linear(8, 8), Counting(8)]
    if kind == "sequential":
        return nn.Sequential(*blocks)
    net = Net(d=8, n=2)
    net.layers = nn.ModuleList(blocks)
    net.embed = nn.Linear(16, 8)
    net.head = nn.Linear(8, 8)
    net.pos = torch.zeros(8)
    return net


@pytest.mark.parametrize("kind", ["sequential", "forward"])
@pytest.mark.parametrize("ring", RINGS)
async def test_a_buffer_the_forward_replaces_is_what_the_next_call_reads(
    ring: bool | None, kind: str
) -> None:
    """A block's forward that puts a new tensor in a buffer's place changes the module, as it
    would unstreamed: the next call reads the new value, kept groups included, and after
    ``aclose()`` the module holds it."""
    model = counting(kind)
    reference = copy.deepcopy(model)
    x = torch.randn(3, 8 if kind == "sequential" else 16)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=1, ring=ring)
        m.set_budget("cuda:0", _budget_keeping_half(streamed))
        for _ in range(3):
            with torch.no_grad():
                want = reference(x)
                assert torch.equal(await streamed(x), want)
        await streamed.aclose()
    assert float(model.layers[1].calls if kind == "forward" else model[1].calls) == 3.0
    assert torch.equal(expected(model, x), expected(reference, x))


async def test_a_buffer_replaced_by_another_shape_is_dropped_with_a_warning_naming_it() -> None:
    """A forward that puts a tensor of another shape (or ``None``) in a buffer's place: the
    packed module cannot hold it. Each call starts from the packed value again (as a
    positional table the forward grows when it needs to is, harmlessly), with one warning
    naming the tensor, and the calls go on."""

    class Growing(Counting):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert self.calls.shape == (), "each call starts from the packed buffer"
            self.calls = torch.zeros(2)
            return self.linear(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Growing(8), nn.Linear(8, 8))
    x = torch.randn(3, 8)
    want = expected(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        with torch.no_grad():
            assert torch.equal(await streamed(x), want)
            with pytest.warns(RuntimeWarning, match=r"replaced 1\.calls .* shape \[2\]"):
                assert torch.equal(await streamed(x), want)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # once per tensor
                assert torch.equal(await streamed(x), want)
        await streamed.aclose()
    assert model[1].calls.shape == ()


async def test_a_module_whose_managers_closed_without_aclose_streams_again() -> None:
    """A manager closed (a server restarted its runtime) while its streamed module was never
    ``aclose()``d, the streamed module dropped: the module, kept alive by its hooks, was
    refused for good by every later manager ("another manager streams already", naming a
    closed manager and a streamed module no one holds). It can never run again, so the next
    ``stream_module`` closes it first."""
    model = Net(n=3)
    x = torch.randn(4, 16)
    want = expected(model, x)
    async with ResidencyManager(backend="sim") as m1:
        first = stream_module(m1, model, name="first")
        with torch.no_grad():
            assert torch.equal(await first(x), want)
    async with ResidencyManager(backend="sim") as m2:
        second = stream_module(m2, model, name="second")
        with torch.no_grad():
            assert torch.equal(await second(x), want)
        hooks = [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.layers]
        assert hooks == [2, 2, 2], "the first module's hooks are gone"
        await first.aclose()  # nothing left to do: the second one is untouched
        with torch.no_grad():
            assert torch.equal(await second(x), want)
        await second.aclose()
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in model.layers)
    assert torch.equal(expected(model, x), want)


class Nesting(nn.Module):
    """Three blocks; after the second, the forward calls ``inner`` (set after streaming)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.inner: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1 and self.inner is not None:
                x = self.inner(x)
        return x


@pytest.mark.parametrize("which", ["itself", "another module"])
async def test_a_streamed_call_from_inside_a_forward_that_would_wait_for_it_is_refused(
    which: str,
) -> None:
    # The forward of a call over managed values called a streamed module of the same
    # manager and device (or the same module) with call_threadsafe: the inner call waited
    # for the admission turn (or the module's lock) the outer call holds, the outer call for
    # its forward, for ever; cancelling the outer call could not end it (it waits for its
    # thread, blocked in the inner call).
    async with ResidencyManager(budgets={"cuda:0": 64 * 4608}, backend="sim") as m:
        model = Nesting()
        x = torch.randn(2, 32)
        plain = expected(model, x)
        outer = stream_module(m, model, ring=False, name="outer")
        inner = outer if which == "itself" else stream_module(m, linears(n=2), name="inner")
        model.inner = inner.call_threadsafe
        with anyio.fail_after(10), torch.no_grad():
            with pytest.raises(RuntimeError, match="would wait for ever for the call that makes"):
                await outer(x)
            model.inner = None
            assert torch.equal(await outer(x), plain)  # nothing was left behind
            if inner is not outer:
                await inner(x)
        for streamed in {id(outer): outer, id(inner): inner}.values():
            await streamed.drain()
            await streamed.aclose()
