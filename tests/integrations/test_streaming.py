"""Layer-by-layer weight streaming on the simulated backend (a simulation of CUDA devices in
host memory: its streams run work in order on worker threads, released memory is poisoned).

Outputs are compared bit for bit with the plain module run on the CPU: the simulation computes
with the same CPU kernels, so any difference is a streaming bug (a read of poisoned memory, a
wrong view, a block run with the wrong weights)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from aresidency import (
    ReplicaMode,
    ResidencyBudgetError,
    ResidencyManager,
    ResidencyTrace,
)
from aresidency.backends import CopyRequest, HostEvent, Transfer
from aresidency.backends.sim import SimBackend
from aresidency.integrations import StreamedModule, find_blocks, stream_module
from aresidency.runtime.checkpoints import Checkpoint

from ._models import Block, Boom, Net, Sleepy, SleepyNet, linears, sequential

pytestmark = pytest.mark.anyio

KiB = 1 << 10


def reference(module: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:
    """The plain module's output on the CPU (slow blocks made quick: this runs on the loop)."""
    sleepy = [(sub, sub.seconds) for sub in module.modules() if isinstance(sub, Sleepy)]
    for sub, _ in sleepy:
        sub.seconds = 0.0
    try:
        with torch.no_grad():
            out = module(*args, **kwargs)
    finally:
        for sub, seconds in sleepy:
            sub.seconds = seconds
    assert isinstance(out, torch.Tensor)
    return out


def max_charge(trace: ResidencyTrace, location: str = "cuda:0") -> int:
    """Replay the trace: the largest charge the location ever had."""
    assert trace.overwritten == 0
    current = peak = 0
    for transition in trace.transitions:
        if transition.location is not None and str(transition.location) == location:
            current += transition.nbytes
            peak = max(peak, current)
    assert current >= 0
    return peak


def assert_all_released(
    manager: ResidencyManager, streamed: StreamedModule, host: str = "pinned-host"
) -> None:
    """Nothing is in use; every group's device replica is released, except those the module
    keeps resident between calls (what fits the budget beside its prefetch window)."""
    snap = manager.snapshot()
    kept = set(streamed.residency()["kept"])
    kept_bytes = 0
    for handle in streamed.handles:
        value = snap.value(handle)
        expected = [] if host == "none" else [host]
        if handle.name in kept:
            expected.append("cuda:0")
            kept_bytes += value.charge_bytes
        assert [str(loc) for loc in value.locations] == expected
        for record in value.materializations:
            assert record.use_count == 0 and record.pending_event_count == 0
    assert snap.location("cuda:0").used_bytes == kept_bytes


def released(manager: ResidencyManager) -> int:
    """How many device replicas were released so far."""
    return sum(1 for t in manager.trace().transitions if t.kind == "release")


def kinds_for(trace: ResidencyTrace, name: str) -> list[str]:
    return [t.kind for t in trace.transitions if t.handle is not None and t.handle.name == name]


def own_tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


# ---------------------------------------------------------------- nn.Sequential


async def test_sequential_output_is_bit_identical_to_the_cpu_module() -> None:
    model = sequential()
    x = torch.randn(8, 32)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=2)
        with torch.no_grad():
            y = await streamed(x)
        assert torch.equal(y, expected)
        await streamed.drain()
        assert_all_released(m, streamed)


async def test_sequential_stays_within_budget_and_releases_every_replica() -> None:
    model = sequential(n=8)
    x = torch.randn(4, 32)
    expected = reference(model, x)
    async with ResidencyManager(budgets={"cuda:0": 40 * KiB}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=4)
        block = streamed.block_bytes[0]
        assert block == 4 * KiB + 512  # weight, then the bias on the next 512-byte boundary
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert_all_released(m, streamed)
        budget = 40 * KiB
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        assert max_charge(m.trace()) <= budget
        # prefetch=4 asked for five blocks at once; the budget admits only nine KiB-blocks
        assert max_charge(m.trace()) > block


async def test_a_budget_of_two_blocks_streams_all_of_them() -> None:
    model = sequential(n=10)
    x = torch.randn(4, 32)
    expected = reference(model, x)
    async with ResidencyManager(budgets={"cuda:0": 2 * 4608}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=3)
        with torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert max_charge(m.trace()) <= 2 * 4608
        assert_all_released(m, streamed)


async def test_prefetch_starts_copies_ahead_of_the_running_block() -> None:
    model = linears(n=6)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=2, name="net", ring=False)
        with torch.no_grad():
            await streamed(torch.randn(2, 32))
        await streamed.drain()
        trace = [(t.kind, t.handle.name if t.handle else "") for t in m.trace().transitions]
        # The first block's kernels are enqueued right behind its copy (it is handed back,
        # with its reader event unless the device already passed it, once they are); the
        # prefetches are issued once it is on its way, so the next block finds two more
        # already copying.
        first_done = trace.index(("unlease", "net.block0"))
        begun = {name for kind, name in trace[:first_done] if kind == "copy_begin"}
        assert begun == {"net.block0"}
        second_done = trace.index(("unlease", "net.block1"))
        begun = {name for kind, name in trace[:second_done] if kind == "copy_begin"}
        assert begun == {"net.block0", "net.block1", "net.block2", "net.block3"}
        for i in range(2, 5):
            assert trace.index(("copy_begin", f"net.block{i + 1}")) < trace.index(
                ("unlease", f"net.block{i}")
            )


class SlowIssueBackend(SimBackend):
    """SIMULATED backend whose first copy takes 50 ms to be issued, as a pageable copy staged
    chunk by chunk through pinned buffers does on a GPU (its issuing thread finishes later)."""

    def __init__(self) -> None:
        super().__init__()
        self.slow_left = 1

    def copy_many(self, requests: Sequence[CopyRequest]) -> list[Transfer | BaseException]:
        out = super().copy_many(requests)
        for transfer in out:
            if self.slow_left and isinstance(transfer, Transfer):
                self.slow_left -= 1
                event = transfer.event
                assert event is not None
                transfer._issued = HostEvent(label="issued later")
                threading.Timer(0.05, transfer._finish_issue, args=(event,)).start()
        return out


async def test_prefetches_start_while_the_first_copy_is_still_being_issued() -> None:
    """The first block's lease waits until its copy is issued: the prefetches use that time
    instead of waiting for the first block to run."""
    model = linears(n=5)
    async with ResidencyManager(backend=SlowIssueBackend()) as m:
        streamed = stream_module(m, model, prefetch=2, name="net", ring=False)
        x = torch.randn(2, 32)
        with torch.no_grad():
            y = await streamed(x)
        await streamed.drain()
        trace = [(t.kind, t.handle.name if t.handle else "") for t in m.trace().transitions]
        first_lease = trace.index(("lease", "net.block0"))
        begun = {name for kind, name in trace[:first_lease] if kind == "copy_begin"}
        assert begun == {"net.block0", "net.block1", "net.block2"}
        assert torch.equal(y, reference(model, x))


async def test_prefetch_zero_copies_one_block_at_a_time() -> None:
    model = linears(n=4)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=0, name="net", ring=False)
        with torch.no_grad():
            await streamed(torch.randn(2, 32))
        await streamed.drain()
        trace = [(t.kind, t.handle.name if t.handle else "") for t in m.trace().transitions]
        for i in range(3):
            assert trace.index(("unlease", f"net.block{i}")) < trace.index(
                ("copy_begin", f"net.block{i + 1}")
            )


async def test_release_waits_for_the_blocks_compute_event() -> None:
    # The blocks run on the simulated compute stream (50 ms each) while the host has long
    # moved on: every release must wait for the event recorded after its block, or the block
    # would read poisoned memory.
    torch.manual_seed(3)
    model = nn.Sequential(*(Sleepy(16, 0.05) for _ in range(4)))
    x = torch.randn(2, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend=SimBackend(copy_gbps=0.05)) as m:
        streamed = stream_module(m, model, prefetch=1, name="net", ring=False)
        with torch.no_grad():
            y = await streamed(x)
        assert torch.equal(y, expected)
        await streamed.drain()
        trace = m.trace()
        for i in range(4):
            kinds = kinds_for(trace, f"net.block{i}")
            assert kinds.index("event_recorded") < kinds.index("event_reaped")
            assert kinds.index("event_reaped") < kinds.index("release")
        assert_all_released(m, streamed)


async def test_the_host_does_not_wait_for_the_blocks_to_run() -> None:
    # With a generous budget the whole forward is enqueued before the first block finished
    # computing: the call awaits only admissions and the final result.
    torch.manual_seed(4)
    model = nn.Sequential(*(Sleepy(16, 0.03) for _ in range(5)))
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=8, name="net", ring=False)
        with torch.no_grad():
            await streamed(torch.randn(2, 16))
        trace = [(t.kind, t.handle.name if t.handle else "") for t in m.trace().transitions]
        last_unlease = trace.index(("unlease", "net.block4"))
        first_reap = trace.index(("event_reaped", "net.block0"))
        assert last_unlease < first_reap
        await streamed.drain()


async def test_repeated_calls_give_identical_results() -> None:
    model = sequential(n=5)
    xs = [torch.randn(3, 32) for _ in range(4)]
    async with ResidencyManager(budgets={"cuda:0": 3 * 4608}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=2)
        with torch.no_grad():
            results = [await streamed(x) for x in xs]
        for x, y in zip(xs, results):
            assert torch.equal(y, reference(model, x))
        await streamed.drain()
        assert_all_released(m, streamed)


# ---------------------------------------------------------------- models with a list of blocks


async def test_module_list_model_runs_its_own_forward_bit_identically() -> None:
    model = Net()
    x = torch.randn(4, 16)
    expected = reference(model, x, shift=0.25)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=2)
        assert len(streamed.block_bytes) == 5 and streamed.resident_bytes > 0
        with torch.no_grad():
            y = await streamed(x, shift=0.25)
        assert torch.equal(y, expected)
        await streamed.drain()
        assert_all_released(m, streamed)


class Twice(Net):
    """A Net whose forward runs its first block twice."""

    def forward(self, x: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
        h = self.embed(x) + self.pos + shift
        h = self.layers[0](h)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


async def test_a_block_run_twice_in_a_call_on_kept_blocks() -> None:
    """Every block kept on the device (a budget that holds them): the blocks are handed back
    to the call's end without an event of their own, and a block the forward runs again
    takes the same lease."""
    model = Twice()
    x = torch.randn(4, 16)
    expected = reference(model, x)
    async with ResidencyManager(budgets={"cuda:0": "16MiB"}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=2, ring=False)
        with torch.no_grad():
            for _ in range(3):  # the first call copies the blocks in, the others find them
                with anyio.fail_after(10):
                    y = await streamed(x)
                assert torch.equal(y, expected)
        assert len(streamed.residency()["kept"]) == 6
        await streamed.drain()


async def test_residency_before_the_first_call_is_the_plan_the_call_then_keeps() -> None:
    """``residency()`` right after ``stream_module`` said no group stays ("0 of 6 groups
    stay: what fits in the budget ...") whatever the budget held, since no call had planned
    yet: it now gives the plan the first call makes, which the call then keeps."""
    model = Net(n=5)
    x = torch.randn(4, 16)
    async with ResidencyManager(backend="sim") as m:
        probe = stream_module(m, model)
        # (less than the whole model, which would stay whole)
        budget = probe.resident_bytes + sum(probe.block_bytes) // 2 + 2 * max(probe.block_bytes)
        await probe.aclose()
        m.set_budget("cuda:0", budget)
        streamed = stream_module(m, model)
        before = streamed.residency()
        assert 1 < len(before["kept"]) < 6
        with anyio.fail_after(10), torch.no_grad():
            await streamed(x)
        await streamed.drain()
        assert streamed.residency() == before
        await streamed.aclose()


async def test_a_budget_below_the_kept_blocks_is_refused_with_how_to_free_them() -> None:
    """A streamed module keeps its blocks between calls; a smaller budget below what they
    charge was refused with "release or move values", values the user does not own. The
    refusal (which changes nothing) says how: ``manager.reclaim`` gives them back, and once
    the releases committed the budget can be set; the next call keeps what fits then."""
    model = Net(n=5)
    x = torch.randn(4, 16)
    expected = reference(model, x)
    async with ResidencyManager(budgets={"cuda:0": "16MiB"}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=1)
        with anyio.fail_after(10), torch.no_grad():
            await streamed(x)
        await streamed.drain()
        assert len(streamed.residency()["kept"]) == 6
        charged = m.snapshot().location("cuda:0").charged_bytes
        smaller = streamed.resident_bytes + 2 * max(streamed.block_bytes)
        before = m.snapshot()
        with pytest.raises(ResidencyBudgetError) as refused:
            m.set_budget("cuda:0", smaller)
        assert m.snapshot() == before  # nothing released, nothing changed
        (note,) = refused.value.__notes__
        assert f"manager.reclaim('cuda:0', {charged - smaller})" in note
        assert m.reclaim("cuda:0", charged - smaller) > 0  # as the note says
        with anyio.fail_after(10):
            while m.snapshot().location("cuda:0").charged_bytes > smaller:
                await m.wait_for_change()
        m.set_budget("cuda:0", smaller)
        with anyio.fail_after(10), torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.aclose()


class Repeats(nn.Module):
    """Two blocks run by the model's own forward in the order ``runs`` (indexes into
    ``layers``): a block run twice in a row (``b(a(a(x)))``) or blocks shared across the depth
    of the model (ALBERT's ``[a, b] * 3``)."""

    def __init__(self, runs: Sequence[int], d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])
        self.runs = list(runs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.runs:
            x = torch.tanh(self.layers[i](x))
        return x


REPEATS = [pytest.param([0, 0, 1], id="twice-in-a-row"), pytest.param([0, 1] * 3, id="shared")]
WAYS = [
    pytest.param(None, "pinned-host", id="ring"),
    pytest.param(False, "pinned-host", id="values"),
    pytest.param(None, "pageable-host", id="pageable"),
]


@pytest.mark.parametrize("ring, host", WAYS)
@pytest.mark.parametrize("runs", REPEATS)
async def test_a_block_listed_twice_is_one_group_and_streams_in_a_one_block_budget(
    runs: list[int], ring: bool | None, host: str
) -> None:
    """``blocks=`` naming a block once per run (the docs allow it): the block's weights are
    packed once (one value), it gets one pair of hooks, and a budget of one block (which
    ``stream_module`` accepts) streams the call, one copy per change of block. Listed
    twice, it once got two groups whose takes waited for each other's room for ever."""
    model = Repeats(runs)
    x = torch.randn(2, 32)
    want = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(
            m,
            model,
            prefetch=1,
            ring=ring,
            host=host,  # type: ignore[arg-type]
            blocks=[model.layers[i] for i in runs],
        )
        assert len(streamed.handles) == 2, "each block's weights are packed once"
        assert [len(b._forward_pre_hooks) for b in model.layers] == [1, 1]
        assert [len(b._forward_hooks) for b in model.layers] == [1, 1]
        m.set_budget("cuda:0", max(streamed.block_bytes))
        switches = 1 + sum(1 for a, b in itertools.pairwise(runs) if a != b)
        for _ in range(2):
            before = streamed.copies
            with anyio.fail_after(10), torch.no_grad():
                assert torch.equal(await streamed(x), want)
            assert streamed.copies - before == switches
        await streamed.drain()
        assert_all_released(m, streamed, host=host)
        await streamed.aclose()


@pytest.mark.parametrize("ring", [None, False], ids=["ring", "values"])
async def test_a_sequential_that_repeats_a_block_streams_it_once_per_run(
    ring: bool | None,
) -> None:
    """``nn.Sequential(a, a, b)`` (the same module twice, run on the loop): one group for
    ``a``, held over from its first run to its second, within a one-block budget."""
    torch.manual_seed(4)
    a, b = nn.Linear(32, 32), nn.Linear(32, 32)
    model = nn.Sequential(a, nn.Tanh(), a, b)
    x = torch.randn(2, 32)
    want = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=1, ring=ring)
        assert len(streamed.handles) == 2
        m.set_budget("cuda:0", max(streamed.block_bytes))
        before = streamed.copies
        with anyio.fail_after(10), torch.no_grad():
            assert torch.equal(await streamed(x), want)
        assert streamed.copies - before == 2
        await streamed.drain()
        assert_all_released(m, streamed)
        await streamed.aclose()


async def test_module_list_model_within_budget_with_resident_tensors() -> None:
    model = Net(n=6)
    x = torch.randn(4, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        probe = stream_module(m, Net(n=6), prefetch=0)
        block, resident = max(probe.block_bytes), probe.resident_bytes
        await probe.aclose()
    budget = resident + 2 * block
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        streamed = stream_module(m, model, prefetch=3, name="net")
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        trace = m.trace()
        assert max_charge(trace) <= budget
        # the resident group is leased for the whole call, the blocks one after the other
        kinds = kinds_for(trace, "net.resident")
        assert kinds.count("lease") == 2 and kinds.count("release") == 2
        assert_all_released(m, streamed)


async def test_threaded_forward_carries_no_grad_into_the_worker() -> None:
    model = Net()
    x = torch.randn(2, 16)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        with torch.no_grad():
            y = await streamed(x)
        assert not y.requires_grad
        with torch.inference_mode():
            z = await streamed(x)
        assert z.is_inference()
        assert torch.equal(y, z)
        await streamed.drain()


async def test_explicit_blocks_and_a_subclassed_sequential() -> None:
    model = Net()
    x = torch.randn(2, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, blocks=[model.embed, *model.layers])
        assert len(streamed.block_bytes) == 6
        with torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert_all_released(m, streamed)


async def test_find_blocks_picks_the_largest_module_list() -> None:
    model = Net(n=3)
    assert find_blocks(model) == list(model.layers)
    seq = sequential(n=2)
    assert find_blocks(seq) == list(seq)
    with pytest.raises(ValueError, match="blocks="):
        find_blocks(nn.Linear(2, 2))


# ---------------------------------------------------------------- host variants and sources


async def test_pageable_host_variant_is_bit_identical() -> None:
    model = Net()
    x = torch.randn(4, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, host="pageable-host")
        with torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert_all_released(m, streamed, host="pageable-host")


async def test_checkpoint_source_rebuilds_each_block_from_safetensors(tmp_path: Path) -> None:
    model = sequential(n=6)
    x = torch.randn(4, 32)
    expected = reference(model, x)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with torch.device("meta"):
        skeleton = sequential(n=6)
    async with ResidencyManager(budgets={"cuda:0": 3 * 4608}, backend="sim") as m:
        streamed = stream_module(m, skeleton, prefetch=2, checkpoint=path, name="ckpt")
        snap = m.snapshot()
        for handle in streamed.handles:
            value = snap.value(handle)
            assert value.has_source and value.locations == ()
            assert value.replica_mode is ReplicaMode.REPLICABLE
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert max_charge(m.trace()) <= 3 * 4608
        assert_all_released(m, streamed, host="none")
        assert all(t.is_meta for t in own_tensors(skeleton))  # the module is left as it was
        kinds = kinds_for(m.trace(), "ckpt.block0")
        assert kinds.count("load_begin") == 2  # rebuilt for each call


async def test_a_checkpoint_under_other_names_says_which_and_streams_with_a_mapping(
    tmp_path: Path,
) -> None:
    """A checkpoint whose keys a model's own loader renames (transformers' ``save_pretrained``
    writes GPT-NeoX's ``lm_head.weight`` as ``embed_out.weight``): the ``KeyError`` names the
    checkpoint's tensor of that shape the module has no name for and the
    ``checkpoint_names=`` that maps it; with that mapping the model streams as it computes.
    A mapping that names no tensor of the module, one without a checkpoint, one of the
    wrong type, or a function that returns neither a name nor ``None`` (it was taken as a
    name the checkpoint lacks, so the module's own name was read) is refused at once,
    registering nothing."""
    model = Net(n=3)
    x = torch.randn(4, 16)
    want = reference(model, x)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["out.weight"] = tensors.pop("head.weight")
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(KeyError) as refused:
            stream_module(m, model, checkpoint=path)
        message = refused.value.args[0]
        assert "no tensor named 'head.weight'" in message
        assert "checkpoint_names={'head.weight': 'out.weight'}" in message
        with pytest.raises(ValueError, match=r"'haed\.weight', not a parameter .*'head\.weight'"):
            stream_module(m, model, checkpoint=path, checkpoint_names={"haed.weight": "out.weight"})
        with pytest.raises(ValueError, match="give checkpoint="):
            stream_module(m, model, checkpoint_names={"head.weight": "out.weight"})
        with pytest.raises(TypeError, match="checkpoint_names must be a mapping"):
            stream_module(m, model, checkpoint=path, checkpoint_names=["out.weight"])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"checkpoint_names\('[\w.]+'\) returned 3: "):
            stream_module(m, model, checkpoint=path, checkpoint_names=lambda name: 3)  # type: ignore[arg-type,return-value]
        assert len(m.snapshot().values) == 0, "nothing was registered"
        for names in ({"head.weight": "out.weight"}, {"head.weight": "out.weight"}.get):
            streamed = stream_module(m, model, checkpoint=path, checkpoint_names=names)
            with anyio.fail_after(10), torch.no_grad():
                assert torch.equal(await streamed(x), want)
            await streamed.aclose()


async def test_a_checkpoint_opened_off_the_loop_is_streamed_and_left_open(tmp_path: Path) -> None:
    # Opening reads every shard's header: a server opens it in a worker thread and passes the
    # opened Checkpoint. The streamed module reads it and leaves closing it to its owner.
    model = sequential(n=4)
    x = torch.randn(4, 32)
    expected = reference(model, x)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with torch.device("meta"):
        skeleton = sequential(n=4)
    async with ResidencyManager(budgets={"cuda:0": 3 * 4608}, backend="sim") as m:
        opened = await anyio.to_thread.run_sync(Checkpoint.open, path)
        with opened:
            streamed = stream_module(m, skeleton, prefetch=1, checkpoint=opened)
            assert streamed.checkpoint == path
            with torch.no_grad():
                assert torch.equal(await streamed(x), expected)
            await streamed.aclose()
            assert torch.equal(opened.read("0.weight"), model[0].weight)  # still open
        with pytest.raises(RuntimeError, match="is closed"):
            opened.read("0.weight")


async def test_checkpoint_takes_what_the_file_lacks_from_the_module(tmp_path: Path) -> None:
    # Net's 'pos' buffer is not persistent, so it is not in the file: it is copied from the
    # module. Strides in a checkpoint are contiguous, so the transposed weights are saved so.
    model = Net()
    x = torch.randn(4, 16)
    path = tmp_path / "net.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    assert "pos" not in model.state_dict()
    fresh = Net(seed=99)  # different weights, all replaced from the file except 'pos'
    for block in fresh.layers:
        assert isinstance(block, Block)
        block.mix = nn.Parameter(block.mix.detach().contiguous())
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, fresh, checkpoint=path)
        with torch.no_grad():
            y = await streamed(x)
        await streamed.drain()
    for block in model.layers:
        assert isinstance(block, Block)
        block.mix = nn.Parameter(block.mix.detach().contiguous())
    assert torch.equal(y, reference(model, x))


async def test_checkpoint_with_a_wrong_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    save_file({"0.weight": torch.zeros(3, 3), "0.bias": torch.zeros(3)}, str(path))
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(ValueError, match=r"0\.weight"):
            stream_module(m, nn.Sequential(nn.Linear(4, 4)), checkpoint=path)
        with pytest.raises(KeyError, match="meta"):
            with torch.device("meta"):
                other = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
            stream_module(m, other, checkpoint=path)


# ---------------------------------------------------------------- the module itself


async def test_parameters_become_views_of_the_managed_host_copy() -> None:
    model = Net()
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        handle = streamed.handles[0]
        host = m.tensor(handle, "pinned-host")
        start, end = host.data_ptr(), host.data_ptr() + host.numel()
        block = model.layers[0]
        assert isinstance(block, Block)
        for tensor in own_tensors(block):
            assert start <= tensor.data_ptr() < end
        assert block.mix.stride() == (1, 32)  # the transposed layout is kept
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, before[name])
        await streamed.aclose()
        # closed: the module owns its memory again, with the same values
        for tensor in own_tensors(block):
            assert not (start <= tensor.data_ptr() < end)
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, before[name])
        snap = m.snapshot()
        assert not any(h in snap.values for h in streamed.handles)  # discarded: gone
        assert snap.location("pinned-host").used_bytes == 0


async def test_module_is_restored_after_a_call_and_after_a_failing_block() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 8), Boom(8), nn.Linear(8, 8))
    originals = [id(t) for t in own_tensors(model)]
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            await streamed(torch.randn(2, 8))
        await streamed.drain()
        assert_all_released(m, streamed)
        assert [id(t) for t in own_tensors(model)] == originals
        assert [id(p) for p in model[0]._parameters.values()] == originals[:2]
    net = Net()
    net.layers[2] = Boom(32)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, net)
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            await streamed(torch.randn(2, 16))
        await streamed.drain()
        assert_all_released(m, streamed)
        for sub in net.modules():
            for tensor in (*sub._parameters.values(), *sub._buffers.values()):
                assert tensor is None or isinstance(tensor, nn.Parameter) or tensor.device.type
        assert all(isinstance(p, nn.Parameter) for p in net.parameters())


async def test_hooks_do_nothing_outside_a_call() -> None:
    model = Net()
    x = torch.randn(2, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        assert torch.equal(reference(model, x), expected)  # plain CPU call, hooks idle
        await streamed.aclose()


async def test_tied_weights_are_packed_once() -> None:
    torch.manual_seed(6)
    first, second = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
    second.weight = first.weight
    model = nn.Sequential(nn.Sequential(first, nn.Tanh(), second))
    x = torch.randn(2, 16)
    expected = reference(model, x)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        assert streamed.block_bytes == [16 * 16 * 4]
        with torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.aclose()
    assert second.weight is first.weight


def tied_linears() -> nn.Sequential:
    model = linears(n=4)
    model[2].weight = model[0].weight  # one weight, in two blocks
    return model


async def test_a_weight_tied_across_blocks_streams_from_a_save_model_checkpoint(
    tmp_path: Path,
) -> None:
    # safetensors' save_model (what a refusal tells a user to write a checkpoint with) keeps
    # one name of a tied weight: the second block's group looked only for its own name,
    # '2.weight', and stream_module failed with a KeyError for it.
    from safetensors.torch import load_file, save_model

    model = tied_linears()
    x = torch.randn(2, 32)
    expected = reference(model, x)
    path = tmp_path / "tied.safetensors"
    save_model(model, str(path))
    assert "2.weight" not in load_file(str(path))
    with torch.device("meta"):
        skeleton = tied_linears()
    async with ResidencyManager(budgets={"cuda:0": 2 * 4608}, backend="sim") as m:
        streamed = stream_module(m, skeleton, checkpoint=path, name="tied")
        with torch.no_grad():
            assert torch.equal(await streamed(x), expected)
        await streamed.drain()
        assert_all_released(m, streamed, host="none")
        await streamed.aclose()
    assert skeleton[2].weight is skeleton[0].weight


class Expanded(nn.Module):
    """A block with an expanded parameter and an expanded buffer (stride 0 along a dimension),
    which records the strides its forward sees."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(64, 64)
        row = torch.randn(64, generator=g)
        self.w = nn.Parameter(row.expand(256, 64), requires_grad=False)
        self.register_buffer("b", torch.randn(256, 1, generator=g).expand(256, 64))
        self.seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.w.stride(), self.b.stride()))
        return torch.tanh(self.lin(x) + (self.w * self.b)[: x.shape[0]])


@pytest.mark.parametrize("ring", [True, False])
async def test_an_expanded_tensor_is_packed_at_the_size_of_its_memory(ring: bool) -> None:
    # An expand()ed parameter or buffer was packed dense: 64 KiB for the 256 B of 'w' and the
    # 1 KiB of 'b' (8 x the block's real bytes), and the module's tensors came back dense.
    model = nn.Sequential(Expanded(1), Expanded(2), Expanded(3))
    x = torch.randn(4, 64)
    expected = reference(model, x)
    # the linear's weight and bias, and the memory of 'w' and 'b', each on a 512 B boundary
    block = 64 * 64 * 4 + 512 + 512 + 1024
    async with ResidencyManager(budgets={"cuda:0": 8 * block}, backend="sim") as m:
        streamed = stream_module(m, model, ring=ring, keep_resident=False)
        assert streamed.block_bytes == [block] * 3
        snap = m.snapshot()
        assert snap.location("pinned-host").used_bytes == 3 * block
        with torch.no_grad():
            assert torch.equal(await streamed(x), expected)
            assert torch.equal(await streamed(x), expected)
        # the forward saw its device tensors expanded as the module's are
        for sub in model:
            assert isinstance(sub, Expanded)
            assert sub.seen[1:] == [((0, 1), (1, 0))] * 2
            assert sub.w.stride() == (0, 1) and sub.b.stride() == (1, 0)
        await streamed.drain()
        assert max_charge(m.trace()) <= 3 * block  # (the window: prefetch + 1 blocks)
        await streamed.aclose()
    # given back expanded, with memory of their own of the size they had
    for sub in model:
        assert isinstance(sub, Expanded)
        assert sub.w.stride() == (0, 1) and sub.w.untyped_storage().nbytes() == 64 * 4
        assert sub.b.stride() == (1, 0) and sub.b.untyped_storage().nbytes() == 256 * 4
    assert torch.equal(reference(model, x), expected)


# ---------------------------------------------------------------- refusals and failures


async def test_a_budget_smaller_than_one_block_is_refused_at_once() -> None:
    async with ResidencyManager(budgets={"cuda:0": 4 * KiB}, backend="sim") as m:
        with pytest.raises(ValueError, match="could never run"):
            stream_module(m, sequential())
        with pytest.raises(ValueError, match="prefetch"):
            stream_module(m, sequential(), prefetch=-1)
        with pytest.raises(ValueError, match="cuda"):
            stream_module(m, sequential(), device="pinned-host")


async def test_an_input_requiring_grad_is_refused_under_grad_mode() -> None:
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, sequential())
        with pytest.raises(ValueError, match="inference"):
            await streamed(torch.randn(2, 32, requires_grad=True))
        y = await streamed(torch.randn(2, 32))  # grad mode on, nothing requires grad: fine
        assert not y.requires_grad
        await streamed.drain()
        assert_all_released(m, streamed)


async def test_a_block_waits_for_another_tenant_and_times_out() -> None:
    async with ResidencyManager(budgets={"cuda:0": 12 * KiB}, backend="sim") as m:
        other = m.register(torch.zeros(2 * KiB), name="other", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(other, "cuda:0")  # 8 KiB of the 12 KiB budget
        streamed = stream_module(m, sequential(n=2), timeout=0.05)
        with pytest.raises(TimeoutError, match="not admitted"), torch.no_grad():
            await streamed(torch.randn(2, 32))
        await streamed.drain()
        assert m.snapshot().location("cuda:0").used_bytes == 8 * KiB

        # Without a timeout it waits until the other tenant releases, then runs.
        model = sequential(n=2)
        x = torch.randn(2, 32)
        patient = stream_module(m, model)
        done = anyio.Event()
        results: list[torch.Tensor] = []

        async def call() -> None:
            results.append(await patient(x))
            done.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call)
            with anyio.move_on_after(0.05):
                await done.wait()  # it must not finish while the other tenant has the room
            assert not done.is_set()
            await m.release(other, "cuda:0")
        with torch.no_grad():
            assert torch.equal(results[0], reference(model, x))
        await patient.drain()
        assert_all_released(m, patient)


@pytest.mark.parametrize("ring", [None, False])
async def test_a_timeout_says_what_the_block_needed_and_whose_reservation_held_the_room(
    ring: bool | None,
) -> None:
    """The ``TimeoutError`` of a block that found no room names the bytes it needed (a ring
    buffer for it, or its own charge), the room there was, and the reservations that took the
    rest, by name: what a person needs to see why it waited."""
    model = linears(n=3)
    async with ResidencyManager(backend="sim") as m:
        probe = stream_module(m, model, ring=ring)
        block = max(probe.block_bytes)
        await probe.aclose()
        m.set_budget("cuda:0", 2 * block)

        async def other_tenant() -> None:
            # Another task's (one the calling task made itself would be refused at once: only
            # its own room would keep the block out, and it waits for no one else).
            m.reserve_nowait("other tenant kv", "cuda:0", block + 1)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(other_tenant)
        streamed = stream_module(m, model, ring=ring, timeout=0.01, keep_resident=False)
        with pytest.raises(TimeoutError) as timed_out, torch.no_grad():
            await streamed(torch.randn(2, 32))
        message = str(timed_out.value)
        assert f"it needs {block} B" in message
        assert f"{block - 1} B free" in message
        assert f"'other tenant kv' {block + 1} B" in message
        await streamed.drain()
        assert_all_released(m, streamed)


@pytest.mark.parametrize("host", ["pinned-host", "pageable-host"])
async def test_the_timeout_counts_the_wait_for_room_not_the_copy(host: str) -> None:
    """``timeout=`` is how long a block may wait for budget. With no budget at all nothing
    waits for room: a copy held up ten times the timeout (the copy stream stalled), which
    the forward's thread waits for on the simulation, delays the call, which then returns
    its result, never ``TimeoutError``."""
    model = SleepyNet(seconds=0.0)
    x = torch.randn(2, 16)
    want = reference(model, x)
    timeout = 0.02
    async with ResidencyManager(backend="sim") as m:  # no budget at cuda:0
        streamed = stream_module(
            m,
            model,
            prefetch=1,
            ring=False,
            host=host,  # type: ignore[arg-type]
            timeout=timeout,
            name="net",
        )
        stalled = HostEvent(label="the copy stream held up")
        m.backend.device_streams(0).h2d.wait_event(stalled)  # every copy from now on waits
        results: list[torch.Tensor] = []
        errors: list[BaseException] = []

        async def call() -> None:
            try:
                with torch.no_grad():
                    results.append(await streamed(x))
            except Exception as error:
                errors.append(error)

        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(call)
                    while "copy_begin" not in kinds_for(m.trace(), "net.block0"):
                        await m.wait_for_change()  # admitted: its copy waits on the stream
                    # What is tested is time passing: ten times the timeout, the copy held up.
                    await anyio.sleep(10 * timeout)
                    stalled.set()
        finally:
            stalled.set()  # (the manager's end waits for the copies)
        assert not errors, errors
        assert torch.equal(results[0], want)
        await streamed.aclose()


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_a_cancelled_call_leaves_no_charge_or_protection(ring: bool) -> None:
    torch.manual_seed(7)
    models: list[nn.Module] = [nn.Sequential(*(Sleepy(16, 0.02) for _ in range(6))), SleepyNet()]

    async def call(
        streamed: StreamedModule, x: torch.Tensor, cancel: anyio.CancelScope, outcome: list[object]
    ) -> None:
        with cancel:
            try:
                outcome.append(await streamed(x))
            except anyio.get_cancelled_exc_class() as exc:
                outcome.append(exc)
                raise

    for model in models:
        async with ResidencyManager(backend=SimBackend(copy_gbps=0.01)) as m:
            streamed = stream_module(m, model, prefetch=2, ring=ring)
            first = next(sub for sub in model.modules() if isinstance(sub, Sleepy))
            ran = threading.Event()
            hook = first.register_forward_hook(lambda *_, ran=ran: ran.set())
            x = torch.randn(2, 16)
            cancel = anyio.CancelScope()
            outcome: list[object] = []
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(call, streamed, x, cancel, outcome)
                # In the middle of the call: its first block ran (about 20 ms into a call of
                # about 120 ms).
                await anyio.to_thread.run_sync(ran.wait)
                cancel.cancel()
            hook.remove()
            (result,) = outcome
            assert isinstance(result, anyio.get_cancelled_exc_class()), (
                f"the cancelled call returned its output instead of raising: {type(result)}"
            )
            await streamed.drain()
            assert_all_released(m, streamed)
            with torch.no_grad():  # and it still works
                assert torch.equal(await streamed(x), reference(model, x))
            await streamed.aclose()


async def test_a_failed_copy_is_raised_and_nothing_leaks() -> None:
    model = sequential(n=3)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=0)
        m.backend.faults.fail_transfer_at = 2
        with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
            await streamed(torch.randn(2, 32))
        await streamed.drain()
        assert_all_released(m, streamed)


async def test_calls_on_one_module_are_serialized() -> None:
    model = Net()
    xs = [torch.randn(2, 16) for _ in range(3)]
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=1)
        ys: list[torch.Tensor | None] = [None] * len(xs)

        async def call(i: int) -> None:
            ys[i] = await streamed(xs[i])

        with torch.no_grad():
            async with anyio.create_task_group() as tasks:
                for i in range(len(xs)):
                    tasks.start_soon(call, i)
        for x, y in zip(xs, ys):
            assert torch.equal(y, reference(model, x))
        await streamed.drain()
        assert_all_released(m, streamed)


async def test_call_threadsafe_from_another_thread() -> None:
    model = sequential(n=3)
    x = torch.randn(2, 32)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)

        def other_thread() -> torch.Tensor:
            assert threading.current_thread() is not threading.main_thread()
            with torch.no_grad():
                result = streamed.call_threadsafe(x)
            assert isinstance(result, torch.Tensor)
            return result

        out = await anyio.to_thread.run_sync(other_thread)
        assert torch.equal(out, reference(model, x))
        with pytest.raises(RuntimeError, match="deadlock"):
            streamed.call_threadsafe(x)
        await streamed.aclose()


async def test_a_given_compute_stream_runs_the_blocks() -> None:
    model = linears(n=4)
    x = torch.randn(2, 32)
    async with ResidencyManager(backend="sim") as m:
        side = m.backend.new_stream("cuda:0")  # type: ignore[attr-defined]
        streamed = stream_module(m, model, stream=side)
        assert "idle" in repr(streamed)
        with torch.no_grad():
            assert torch.equal(await streamed(x), reference(model, x))
        await streamed.drain()
        assert_all_released(m, streamed)


async def test_checkpoint_loads_in_flight_count_against_the_budget(tmp_path: Path) -> None:
    # A load charges the device only once it is loaded; with prefetch 5 and room for two
    # blocks, loads must not all start and then fail the budget (each would be read again).
    model = linears(n=8)
    x = torch.randn(2, 32)
    path = tmp_path / "linears.safetensors"
    save_file(dict(model.state_dict()), str(path))
    with torch.device("meta"):
        skeleton = linears(n=8)
    async with ResidencyManager(budgets={"cuda:0": 2 * 4608}, backend="sim") as m:
        streamed = stream_module(m, skeleton, prefetch=5, checkpoint=path, name="ck")
        with torch.no_grad():
            assert torch.equal(await streamed(x), reference(model, x))
        await streamed.drain()
        trace = m.trace()
        assert max_charge(trace) <= 2 * 4608
        loads = [t for t in trace.transitions if t.kind == "load_begin"]
        assert len(loads) == 8  # each block read once
        assert not [t for t in trace.transitions if t.kind == "copy_abort"]
        assert_all_released(m, streamed, host="none")


@pytest.mark.parametrize("host", ["pinned-host", "pageable-host"])
@pytest.mark.parametrize("kind", ["sequential", "module"])
async def test_device_memory_in_use_never_exceeds_the_budget(kind: str, host: str) -> None:
    """The simulation counts its device memory as torch.cuda.memory_allocated does (a tensor
    counts until its last reference dies, whatever the ledger says): a streamed call's peak
    must stay within the budget. A local that held a released block's payload across the
    reap that freed it once kept a fourth block of a three-block budget alive."""
    model: nn.Module = linears(64, 12) if kind == "sequential" else Net(d=64, n=12)
    x = torch.randn(4, 64) if kind == "sequential" else torch.randn(4, 16)
    expected = reference(model, x)
    backend = SimBackend()
    async with ResidencyManager(backend=backend) as probe_manager:
        probe = stream_module(probe_manager, model, "cuda:0", prefetch=0)
        budget = probe.resident_bytes + 3 * max(probe.block_bytes)
        await probe.aclose()
    backend = SimBackend()
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=2, host=host)  # type: ignore[arg-type]
        for _ in range(2):
            backend.reset_peak_memory_allocated("cuda:0")
            with torch.no_grad():
                y = await streamed(x)
            assert torch.equal(y, expected)
            await streamed.drain()
            assert backend.max_memory_allocated("cuda:0") <= budget, (
                backend.max_memory_allocated("cuda:0"),
                budget,
            )
        await streamed.aclose()
    assert backend.memory_allocated("cuda:0") == 0


async def test_drain_waits_for_a_release_that_waits_for_its_copy_to_arrive() -> None:
    """On a GPU a block is handed back as soon as its kernels are enqueued, often before its
    copy completed: its release starts once the copy arrives, and drain must wait for both."""
    model = linears(256, 3)
    async with ResidencyManager(backend=SimBackend(copy_gbps=0.05)) as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=0)
        group = streamed.groups[0]
        assert group.handle is not None
        pending = m.materialize_nowait(group.handle, "cuda:0")
        assert not pending.done(), "the slow simulated copy is still in flight"
        streamed.release_replica(group.index, pending)
        await streamed.drain()
        assert pending.done()
        assert m.snapshot().location("cuda:0").used_bytes == 0
        await streamed.aclose()
