"""Hugging Face decoders streamed on the simulated backend (a simulation of CUDA devices in host
memory: its streams run work in order on worker threads, released memory is poisoned).

Tiny ``LlamaForCausalLM`` models built from a config (no download). Outputs are compared bit for
bit with the same model run unstreamed on the CPU: the simulation computes with the same CPU
kernels, so any difference is a streaming bug. References (and checkpoints) are computed in a
worker thread, never on the event loop (the loop-stall guard watches every test)."""

from __future__ import annotations

import inspect
import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from aresidency import ResidencyManager, ResidencyTrace
from aresidency.backends.sim import SimBackend
from aresidency.integrations import StreamedModule, stream_module
from aresidency.integrations.streaming.checkpoint import recover_meta_buffers
from aresidency.integrations.streaming.ring import RingCall
from aresidency.serving import ModelPool

from ._models import Net, tiny_llama

# Imported here, at collection (seconds), not on an event loop in a test.
pytest.importorskip("transformers.models.llama.modeling_llama")

pytestmark = pytest.mark.anyio

T = TypeVar("T")
LAYERS = 6
NEW_TOKENS = 5


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread: unstreamed references take long enough to stall."""
    return await anyio.to_thread.run_sync(lambda: fn(*args))


async def built(
    layers: int, dtype: torch.dtype = torch.float32, *, meta: bool = False
) -> nn.Module:
    """:func:`tiny_llama` built in a worker thread (tens of ms: too long for the loop)."""
    return await off_loop(lambda: tiny_llama(layers, dtype=dtype, meta=meta))


def inputs(batch: int = 2, length: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask with left padding on the first row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 0
    return ids, mask


def logits_of(model: nn.Module, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model(**kwargs)
    return out.logits  # type: ignore[no-any-return]


def generated(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert isinstance(out, torch.Tensor)
    return out


def cache_of(output: Any) -> Any:
    """The KV cache a forward returned (``cache`` in newer transformers, else
    ``past_key_values``)."""
    keys = list(output.keys())
    return output["cache"] if "cache" in keys else output["past_key_values"]


def cache_kwarg(model: nn.Module) -> str:
    """The name under which this transformers version takes the cache back."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def block_bytes_copied(trace: ResidencyTrace, since: int = -1) -> int:
    """Bytes copied into ``cuda:0`` after transition ``since``."""
    return sum(
        t.nbytes
        for t in trace.transitions
        if t.seq > since and t.kind == "copy_begin" and str(t.destination) == "cuda:0"
    )


def last_seq(manager: ResidencyManager) -> int:
    transitions = manager.trace().transitions
    return transitions[-1].seq if transitions else -1


def max_charge(trace: ResidencyTrace, location: str = "cuda:0") -> int:
    """Replay the trace: the largest charge the location ever had."""
    assert trace.overwritten == 0
    current = peak = 0
    for transition in trace.transitions:
        if transition.location is not None and str(transition.location) == location:
            current += transition.nbytes
            peak = max(peak, current)
    return peak


def assert_nothing_left(manager: ResidencyManager, streamed: StreamedModule) -> None:
    """No lease, no hold and no pending reader at the device; on the device only what the
    module keeps resident between calls."""
    snap = manager.snapshot()
    kept = set(streamed.residency()["kept"])
    kept_bytes = 0
    for handle in streamed.handles:
        value = snap.value(handle)
        on_device = "cuda:0" in [str(loc) for loc in value.locations]
        assert on_device == (handle.name in kept), handle.name
        if on_device:
            kept_bytes += value.charge_bytes
        for record in value.materializations:
            assert record.use_count == 0 and record.pending_event_count == 0
            if str(record.location) == "cuda:0":
                assert record.hold_count == 0
    assert snap.location("cuda:0").used_bytes == kept_bytes
    assert manager.owners() == [
        o for o in manager.owners() if str(o[1]) != "cuda:0"
    ]  # only the host copies' holds


# ---------------------------------------------------------------- forward


async def test_llama_forward_is_bit_identical_to_the_unstreamed_model() -> None:
    model = await built(LAYERS)
    ids, mask = inputs()
    expected = await off_loop(lambda: logits_of(model, input_ids=ids, attention_mask=mask))
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=2, name="llama")
        assert len(streamed.block_bytes) == LAYERS and streamed.resident_bytes > 0
        with torch.no_grad():
            out = await streamed(input_ids=ids, attention_mask=mask)
        assert torch.equal(out.logits, expected)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_a_forward_on_blocks_all_kept_wakes_the_loop_per_call_not_per_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every block kept on the device (a budget that holds them all), the worker thread
    hands the blocks back without waking the loop: nothing is left to start or release, and
    the call's end takes them. The output is unchanged and nothing stays in use."""
    from aresidency.integrations.streaming.pipeline import CallPipeline

    model = await built(LAYERS)
    ids, mask = inputs()
    expected = await off_loop(lambda: logits_of(model, input_ids=ids, attention_mask=mask))
    wakes: list[int] = []
    woken = CallPipeline._woken

    def counted(self: CallPipeline) -> None:
        wakes.append(1)
        woken(self)

    monkeypatch.setattr(CallPipeline, "_woken", counted)
    async with ResidencyManager(budgets={"cuda:0": "64MiB"}, backend="sim") as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=2, name="llama", ring=False)
        with torch.no_grad():
            await streamed(input_ids=ids, attention_mask=mask)  # copies in, keeps them all
            await streamed.drain()
            assert len(streamed.residency()["kept"]) == LAYERS + 1
            wakes.clear()
            recorded: list[Any] = []
            record = m.backend.record_event

            def counting(stream: Any = None) -> Any:
                recorded.append(stream)
                return record(stream)

            monkeypatch.setattr(m.backend, "record_event", counting)
            for _ in range(3):
                out = await streamed(input_ids=ids, attention_mask=mask)
                assert torch.equal(out.logits, expected)
        assert wakes == []
        # One event after the forward for the blocks' leases and one for the outside group,
        # not one per block.
        assert len(recorded) <= 3 * 2, len(recorded)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_hf_keyword_arguments_and_a_kv_cache_pass_through() -> None:
    model = await built(LAYERS)
    ids, mask = inputs()
    name = cache_kwarg(model)

    def unstreamed() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, use_cache=True)
            step = first.logits[:, -1:].argmax(-1)
            longer = torch.cat([mask, torch.ones_like(step)], dim=1)
            second = model(
                input_ids=step, attention_mask=longer, use_cache=True, **{name: cache_of(first)}
            )
        return first.logits, second.logits

    first_ref, second_ref = await off_loop(unstreamed)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=2)
        with torch.no_grad():
            first = await streamed(input_ids=ids, attention_mask=mask, use_cache=True)
            step = first.logits[:, -1:].argmax(-1)
            longer = torch.cat([mask, torch.ones_like(step)], dim=1)
            second = await streamed(
                input_ids=step, attention_mask=longer, use_cache=True, **{name: cache_of(first)}
            )
        assert torch.equal(first.logits, first_ref)
        assert torch.equal(second.logits, second_ref)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


# ---------------------------------------------------------------- generate


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_generate_gives_the_tokens_of_unstreamed_generate(ring: bool) -> None:
    model = await built(LAYERS)
    ids, mask = inputs()
    expected = await off_loop(generated, model, ids, mask)
    assert expected.shape[1] > ids.shape[1]
    budget_layers = 3
    async with ResidencyManager(backend="sim", trace_capacity=1 << 16) as m:
        probe = stream_module(m, await built(LAYERS), prefetch=0)
        budget = probe.resident_bytes + budget_layers * max(probe.block_bytes)
        await probe.aclose()
        m.set_budget("cuda:0", budget)
        streamed = stream_module(m, model, prefetch=2, name="llama", ring=ring)
        out = await streamed.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )
        assert torch.equal(out, expected)
        await streamed.drain()
        assert max_charge(m.trace()) <= budget
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        assert_nothing_left(m, streamed)
        # every forward pass streamed every block (the budget keeps none of them)
        assert streamed.residency()["kept"] == ["llama.resident"]
        assert streamed.copies >= NEW_TOKENS * len(streamed.groups)
        await streamed.aclose()


class WrapGate:
    """Hooks of the test's own on the decoder layers (they run in the streaming worker thread,
    after the streaming pre-hook took the layer's weights): before the last layer of each
    forward pass runs, wait until block 0 began copying for the next pass. Only a pipeline
    that wraps around copies it then: the next pass cannot ask for block 0 while this one waits.
    Copies are counted on the loop by a change listener reading the trace."""

    def __init__(self, manager: ResidencyManager, model: nn.Module, block0: str) -> None:
        self.manager = manager
        self.block0 = block0
        self.passes = 0  # forward passes begun (worker thread)
        self.copies = 0  # copies of block 0 begun (loop thread, read under the condition)
        self.seen = last_seq(manager)
        self.gaps = 0  # batches whose first transitions the trace ring had overwritten
        self.condition = threading.Condition()
        layers: nn.ModuleList = cast(Any, model).model.layers
        self.handles = [
            layers[0].register_forward_pre_hook(self._first),
            layers[-1].register_forward_pre_hook(self._last),
        ]
        self.unlisten = manager.add_change_listener(self._changed)

    def _changed(self) -> None:
        transitions = self.manager.trace().transitions
        new = [t for t in transitions if t.seq > self.seen]
        if not new:
            return
        # (a listener must not raise: a gap is reported by the test instead)
        self.gaps += new[0].seq != self.seen + 1
        self.seen = new[-1].seq
        begun = sum(
            1
            for t in new
            if t.kind == "copy_begin" and t.handle is not None and t.handle.name == self.block0
        )
        if begun:
            with self.condition:
                self.copies += begun
                self.condition.notify_all()

    def _first(self, module: nn.Module, args: Any) -> None:
        self.passes += 1

    def _last(self, module: nn.Module, args: Any) -> None:
        want = self.passes + 1  # one copy per pass so far, and the next pass's
        with self.condition:
            if not self.condition.wait_for(lambda: self.copies >= want, timeout=5):
                raise AssertionError(
                    f"pass {self.passes}: block 0 was not copied for the next pass while the "
                    "last layer waited (no wrap-around prefetch)"
                )

    def remove(self) -> None:
        self.unlisten()
        for handle in self.handles:
            handle.remove()


async def test_generate_copies_the_next_pass_first_blocks_while_the_last_ones_run() -> None:
    model = await built(LAYERS)
    ids, mask = inputs()
    expected = await off_loop(generated, model, ids, mask)
    async with ResidencyManager(backend="sim", trace_capacity=1 << 12) as m:
        streamed = stream_module(m, model, prefetch=2, name="llama", ring=False)
        gate = WrapGate(m, model, "llama.block0")
        try:
            with anyio.fail_after(60):
                out = await streamed.generate(
                    ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
                )
        finally:
            gate.remove()
        assert torch.equal(out, expected)
        assert gate.passes == NEW_TOKENS and gate.copies >= NEW_TOKENS + 1
        assert gate.gaps == 0
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_generate_through_the_ring_copies_the_next_pass_first_blocks_early() -> None:
    """The ring wraps around too: when the last layer of a forward pass is taken, the copy of
    the first layer for the next pass is already enqueued (the ring's own count of copies
    issued, read in the worker thread that moves it)."""
    model = await built(LAYERS)
    ids, mask = inputs()
    expected = await off_loop(generated, model, ids, mask)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, prefetch=2, name="llama", ring=True)
        layers: nn.ModuleList = cast(Any, model).model.layers
        count = len(streamed.groups)
        passes: list[int] = []
        ahead: list[int] = []

        def first(module: nn.Module, args: Any) -> None:
            passes.append(len(passes))

        def last(module: nn.Module, args: Any) -> None:
            call = streamed.current_call
            assert isinstance(call, RingCall)
            ahead.append(call.issued - len(passes) * count)

        hooks = [
            layers[0].register_forward_pre_hook(first),
            layers[-1].register_forward_pre_hook(last),
        ]
        try:
            out = await streamed.generate(
                ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
            )
        finally:
            for hook in hooks:
                hook.remove()
        assert torch.equal(out, expected)
        assert len(ahead) == NEW_TOKENS
        # copies of the next pass's first two layers enqueued while this pass's last one runs
        assert all(n >= 1 for n in ahead), ahead
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


async def test_generate_on_a_module_without_generate_is_a_type_error() -> None:
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, Net())
        with pytest.raises(TypeError, match="has no generate"):
            await streamed.generate(torch.randn(2, 16))
        await streamed.aclose()


async def test_cancelling_generate_stops_at_a_block_boundary_and_leaves_nothing() -> None:
    model = await built(LAYERS)
    ids, mask = inputs()
    expected = await off_loop(generated, model, ids, mask)
    runs: list[int] = []
    lock = threading.Lock()

    def count(module: nn.Module, args: Any, output: Any) -> None:
        with lock:
            runs.append(1)

    layers: nn.ModuleList = cast(Any, model).model.layers
    hooks = [layer.register_forward_hook(count) for layer in layers]
    passes = [0]  # forward passes begun (worker thread)
    go = threading.Event()

    def first(module: nn.Module, args: Any) -> None:
        passes[0] += 1

    async with ResidencyManager(backend=SimBackend(copy_gbps=0.05), trace_capacity=1 << 16) as m:
        probe = stream_module(m, await built(LAYERS), prefetch=0)
        # room for the resident tensors, the window and two kept blocks
        budget = probe.resident_bytes + 5 * max(probe.block_bytes)
        await probe.aclose()
        m.set_budget("cuda:0", budget)
        streamed = stream_module(m, model, prefetch=2, name="llama")
        reached = anyio.Event()

        def middle(module: nn.Module, args: Any) -> None:
            # In the middle of the third forward pass (after the streaming pre-hook took the
            # layer's weights): hold the worker there until the test cancelled the call.
            if passes[0] == 3 and not go.is_set():
                m.bridge.call_soon(reached.set)
                if not go.wait(30):
                    raise AssertionError("the test never let the layer run")

        hooks.append(layers[0].register_forward_pre_hook(first))
        hooks.append(layers[LAYERS // 2].register_forward_pre_hook(middle))
        outcome: list[object] = []
        cancel = anyio.CancelScope()

        async def generate() -> None:
            with cancel:
                try:
                    outcome.append(
                        await streamed.generate(
                            ids, attention_mask=mask, max_new_tokens=40, do_sample=False
                        )
                    )
                except anyio.get_cancelled_exc_class() as exc:
                    outcome.append(exc)
                    raise

        try:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(generate)
                    await reached.wait()
                    with lock:
                        at_cancel = len(runs)
                    cancel.cancel()
                    # the call is aborted once the generate task saw its cancellation
                    call = streamed.current_call
                    while call is not None and call.active:
                        await anyio.wait_all_tasks_blocked()
                    go.set()  # the held layer runs; the next one must not
        finally:
            go.set()
        (result,) = outcome
        assert isinstance(result, anyio.get_cancelled_exc_class())
        assert len(runs) - at_cancel == 1  # only the layer that was running
        await streamed.drain()
        assert_nothing_left(m, streamed)
        assert len(streamed.residency()["kept"]) >= 2
        assert max_charge(m.trace()) <= budget
        for hook in hooks:
            hook.remove()
        # and it still works
        out = await streamed.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )
        assert torch.equal(out, expected)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()


# ---------------------------------------------------------------- budgets that remember


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_half_the_model_in_the_budget_copies_about_half_of_it_per_call(ring: bool) -> None:
    layers = 32
    model = await built(layers)
    ids, mask = inputs()
    expected = await off_loop(lambda: logits_of(model, input_ids=ids, attention_mask=mask))
    async with ResidencyManager(backend="sim", trace_capacity=1 << 16) as m:
        streamed = stream_module(m, model, prefetch=1, name="llama", ring=ring)
        total = streamed.resident_bytes + sum(streamed.block_bytes)
        block = max(streamed.block_bytes)
        budget = total // 2
        m.set_budget("cuda:0", budget)
        per_call = []
        for _ in range(3):
            since = last_seq(m)
            before = streamed.copied_bytes
            with torch.no_grad():
                out = await streamed(input_ids=ids, attention_mask=mask)
            assert torch.equal(out.logits, expected)
            await streamed.drain()
            per_call.append(streamed.copied_bytes - before)
            if not ring:  # the managed values' copies are in the trace too
                assert block_bytes_copied(m.trace(), since) == per_call[-1]
        residency = streamed.residency()
        assert per_call[0] == total  # the first call copies everything
        # later calls copy only what does not stay: the budget less the window, at most
        assert per_call[1] == per_call[2] == residency["streamed_bytes"]
        assert residency["kept_bytes"] + residency["streamed_bytes"] == total
        # what does not fit beside the window, give or take a block of rounding
        assert per_call[1] <= total - budget + residency["window_bytes"] + block
        assert 0.45 * total <= per_call[1] <= 0.6 * total
        # which layers stay, and why: the resident tensors, then layers spread evenly over the
        # call order (as many in each half), so copies overlap the compute of kept layers
        kept = residency["kept"]
        assert kept[0] == "llama.resident"
        indexes = [int(name.removeprefix("llama.block")) for name in kept[1:]]
        first_half = sum(1 for i in indexes if i < layers // 2)
        assert abs(first_half - (len(indexes) - first_half)) <= 1
        assert max(b - a for a, b in itertools.pairwise(indexes)) <= 3
        assert residency["streamed"] == [
            f"llama.block{i}" for i in range(layers) if i not in set(indexes)
        ]
        assert "spread evenly" in residency["reason"]
        assert max_charge(m.trace()) <= budget
        assert_nothing_left(m, streamed)
        await streamed.aclose()


# ---------------------------------------------------------------- checkpoints


def save_sharded(model: nn.Module, path: Path, dtype: torch.dtype | None = None) -> None:
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, max_shard_size="200KB")  # type: ignore[operator]


# stream_module opens the checkpoint (its index and every shard's header) in the calling thread,
# here the loop's: on a cold disk that file I/O blocked the loop for 136 ms once (a fresh clone's
# CI run), over the project's 100 ms.
@pytest.mark.allow_loop_stall(0.5)
@pytest.mark.parametrize("which", ["directory", "index"])
async def test_sharded_checkpoint_streams_a_meta_model_bit_identically(
    tmp_path: Path, which: str
) -> None:
    model = await built(LAYERS)
    ids, mask = inputs()
    expected = await off_loop(lambda: logits_of(model, input_ids=ids, attention_mask=mask))
    expected_gen = await off_loop(generated, model, ids, mask)
    await off_loop(save_sharded, model, tmp_path)
    shards = await off_loop(lambda: sorted(tmp_path.glob("*.safetensors")))
    assert len(shards) >= 3
    index = tmp_path / "model.safetensors.index.json"
    skeleton = await built(LAYERS, meta=True)
    # rotary inv_freq is a non-persistent buffer: not in the checkpoint, recovered
    recovered = recover_meta_buffers(skeleton)
    inv_freq = cast(Any, model).model.rotary_emb.inv_freq
    assert torch.equal(recovered["model.rotary_emb.inv_freq"], inv_freq)
    checkpoint = tmp_path if which == "directory" else index
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, skeleton, prefetch=2, checkpoint=checkpoint)
        with torch.no_grad():
            out = await streamed(input_ids=ids, attention_mask=mask)
        assert torch.equal(out.logits, expected)
        gen = await streamed.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )
        assert torch.equal(gen, expected_gen)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()
    assert all(t.is_meta for t in skeleton.parameters())  # the module is left as it was


def made(model_class: Any, config: Any, *, seed: int, meta: bool) -> nn.Module:
    """``model_class(config)`` in eval mode, its weights drawn after ``torch.manual_seed(seed)``,
    or on the meta device (``meta=True``: a skeleton for a checkpoint)."""
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return model_class(config).eval()
    return model_class(config).eval()


def dynamic_rope_llama(meta: bool = False) -> nn.Module:
    """A small ``LlamaForCausalLM`` with dynamic RoPE scaling past 8 positions: its rotary
    embedding (a tensor outside the blocks) recomputes ``inv_freq`` with
    ``register_buffer`` when a sequence outgrows the longest it has seen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    return made(LlamaForCausalLM, config, seed=3, meta=meta)


@pytest.mark.allow_loop_stall(0.5)  # (stream_module opens the checkpoint on the loop)
@pytest.mark.parametrize("way", ["ring", "values", "kept", "checkpoint", "pool"])
async def test_dynamic_rope_frequencies_a_call_recomputed_are_the_next_calls(
    tmp_path: Path, way: str
) -> None:
    """After a 20-token call the rotary embedding keeps the frequencies scaled for 20
    positions (and remembers 20 as its longest), so a 12-token call runs them unstreamed. The
    streamed module ran that second call with the unscaled frequencies it packed: silently
    different logits."""
    model = await off_loop(dynamic_rope_llama)
    reference = await off_loop(dynamic_rope_llama)
    lengths = [20, 12, 5, 12]
    calls = [inputs(batch=1, length=n, seed=n)[0] for n in lengths]
    expected = [await off_loop(lambda x=x: logits_of(reference, input_ids=x)) for x in calls]
    skeleton = model
    if way == "checkpoint":
        await off_loop(save_sharded, model, tmp_path)
        skeleton = await off_loop(dynamic_rope_llama, True)
    if way == "pool":
        async with ResidencyManager(backend="sim") as m:
            pool = ModelPool(m, device="cuda:0")
            pool.add("llama", model)
            for x, want in zip(calls, expected):
                async with pool.use("llama") as pooled:
                    with torch.no_grad():
                        out = await pooled(input_ids=x)
                assert torch.equal(out.logits, want)
        return
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(
            m,
            skeleton,
            ring=False if way == "values" else None,
            checkpoint=tmp_path if way == "checkpoint" else None,
        )
        if way == "kept":
            m.set_budget("cuda:0", streamed.resident_bytes + 4 * sum(streamed.block_bytes))
        for x, want in zip(calls, expected):
            with torch.no_grad():
                out = await streamed(input_ids=x)
            assert torch.equal(out.logits, want)
        await streamed.drain()
        assert_nothing_left(m, streamed)
        await streamed.aclose()
    if way != "checkpoint":
        rotary, wanted = model.model.rotary_emb, reference.model.rotary_emb  # type: ignore[union-attr]
        assert torch.equal(rotary.inv_freq, wanted.inv_freq)


def tiny_m2m100() -> nn.Module:
    """A small ``M2M100ForConditionalGeneration`` whose sinusoidal position tables (8
    positions) are rebuilt larger by the forward (``register_buffer``) for a longer input."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    config = M2M100Config(
        vocab_size=96,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=8,
        decoder_start_token_id=2,
    )
    torch.manual_seed(4)
    return M2M100ForConditionalGeneration(config).eval()


def tiny_bart() -> nn.Module:
    """A small ``BartForConditionalGeneration``: two encoder layers, three decoder layers."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(5)
    return BartForConditionalGeneration(config).eval()


@pytest.mark.parametrize("prefetch", [1, 2])
async def test_generate_through_the_ring_stops_copying_the_encoder_after_its_pass(
    prefetch: int,
) -> None:
    """``blocks=[*encoder, *decoder]``: generate runs the encoder once, then the decoder for
    every token. The ring learns that cycle at the first wrap, so the copies it issues ahead
    at the end of a pass are the decoder's first blocks, not encoder blocks it never runs
    again (before: each encoder block copied about once per token)."""
    model, reference = await off_loop(tiny_bart), await off_loop(tiny_bart)
    ids = inputs(batch=1, length=7)[0]
    options = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    expected = await off_loop(lambda: reference.generate(ids, **options))
    encoder, decoder = list(model.model.encoder.layers), list(model.model.decoder.layers)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(
            m, model, blocks=[*encoder, *decoder], prefetch=prefetch, keep_resident=False
        )
        assert streamed.ring
        owner = {g.host_flat.data_ptr(): g.index for g in streamed.groups}  # type: ignore[union-attr]
        copies: dict[int, int] = {}
        copy_into = m.backend.copy_into

        def counting(src: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            index = owner[src.data_ptr()]
            copies[index] = copies.get(index, 0) + 1
            return copy_into(src, *args, **kwargs)

        m.backend.copy_into = counting  # type: ignore[method-assign]
        with torch.no_grad():
            got = await streamed.generate(ids, **options)
        assert torch.equal(got, expected)
        passes = 8
        # once in the first pass, at most once more ahead of the first wrap
        assert all(copies[index] <= 2 for index in range(len(encoder))), copies
        # decoder blocks: at most once per pass, and once ahead of a pass that never came
        assert all(copies[len(encoder) + i] <= passes + 1 for i in range(len(decoder))), copies
        await streamed.aclose()


async def test_a_position_table_the_forward_grows_keeps_streaming_with_a_warning() -> None:
    """M2M100 (NLLB) grows its sinusoidal position tables for an input longer than they are:
    a replacement of another shape, which the streamed module cannot keep. Every call still
    runs (the forward grows the table again) and equals the unstreamed model's."""
    model, reference = await off_loop(tiny_m2m100), await off_loop(tiny_m2m100)
    ids = inputs(batch=1, length=20)[0]
    expected = await off_loop(
        lambda: logits_of(reference, input_ids=ids, decoder_input_ids=ids[:, :3])
    )
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model)
        with torch.no_grad(), pytest.warns(RuntimeWarning, match="embed_positions.weights"):
            for _ in range(3):
                out = await streamed(input_ids=ids, decoder_input_ids=ids[:, :3])
                assert torch.equal(out.logits, expected)
        await streamed.aclose()


@pytest.mark.allow_loop_stall(0.5)  # (stream_module opens the checkpoint on the loop)
async def test_a_meta_skeleton_built_in_bfloat16_matches_from_pretrained(tmp_path: Path) -> None:
    """The recipe of docs/streaming.md: a skeleton built on the meta device with its dtype
    (``from_config(config, dtype=...)``) keeps the rotary ``inv_freq`` in float32, as
    ``from_pretrained(path, dtype=...)`` does, and streams bit-identically to it."""
    from transformers import AutoModelForCausalLM

    model = await built(LAYERS)
    await off_loop(save_sharded, model, tmp_path)
    loaded = await off_loop(
        lambda: AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    )
    ids, mask = inputs()
    expected = await off_loop(lambda: logits_of(loaded, input_ids=ids, attention_mask=mask))

    def meta_skeleton() -> Any:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)

    skeleton = await off_loop(meta_skeleton)
    assert skeleton.model.rotary_emb.inv_freq.dtype == torch.float32
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, skeleton.eval(), checkpoint=tmp_path)
        with torch.no_grad():
            out = await streamed(input_ids=ids, attention_mask=mask)
        assert torch.equal(out.logits, expected)
        await streamed.aclose()


async def test_a_float32_checkpoint_streams_into_a_bfloat16_model(tmp_path: Path) -> None:
    model = await built(LAYERS)
    await off_loop(save_sharded, model, tmp_path)  # float32 on disk
    half = await built(LAYERS, dtype=torch.bfloat16)
    ids, mask = inputs()
    expected = await off_loop(lambda: logits_of(half, input_ids=ids, attention_mask=mask))
    skeleton = await built(LAYERS, dtype=torch.bfloat16, meta=True)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, skeleton, checkpoint=tmp_path)
        with torch.no_grad():
            out = await streamed(input_ids=ids, attention_mask=mask)
        assert out.logits.dtype == torch.bfloat16
        assert torch.equal(out.logits, expected)
        await streamed.drain()
        await streamed.aclose()


def drop_from_checkpoint(path: Path, name: str) -> None:
    """Remove tensor ``name`` from a sharded checkpoint (its shard and the index)."""
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = path / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


async def test_a_checkpoint_missing_a_tensor_is_a_key_error_naming_it(tmp_path: Path) -> None:
    model = await built(LAYERS)
    await off_loop(save_sharded, model, tmp_path)
    missing = "model.layers.3.mlp.up_proj.weight"
    await off_loop(drop_from_checkpoint, tmp_path, missing)
    skeleton = await built(LAYERS, meta=True)
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(KeyError, match=r"has no tensor named '" + missing.replace(".", r"\.")):
            stream_module(m, skeleton, checkpoint=tmp_path)
        assert not list(m.state.values())  # nothing stays registered


def gpt_neox(meta: bool = False) -> nn.Module:
    """A small ``GPTNeoXForCausalLM`` (no download); ``meta=True`` on the meta device."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return made(GPTNeoXForCausalLM, config, seed=5, meta=meta)


@pytest.mark.allow_loop_stall(0.5)  # (stream_module opens the checkpoint on the loop)
async def test_a_save_pretrained_checkpoint_with_renamed_keys_streams_with_checkpoint_names(
    tmp_path: Path,
) -> None:
    """transformers' ``save_pretrained`` may write a key under another name than the model's
    state_dict (GPT-NeoX's ``lm_head.weight`` as ``embed_out.weight``, which its
    ``from_pretrained`` renames back): the ``KeyError`` says which tensor it is and what to
    pass, and with ``checkpoint_names=`` the meta skeleton streams what the model computes."""
    pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    model = await off_loop(gpt_neox)
    ids, _ = inputs()
    want = await off_loop(lambda: logits_of(model, input_ids=ids))
    await off_loop(save_sharded, model, tmp_path)
    skeleton = await off_loop(gpt_neox, True)
    async with ResidencyManager(backend="sim") as m:
        try:
            stream_module(m, skeleton, checkpoint=tmp_path)
        except KeyError as error:  # (a transformers that saves it under its own name: no error)
            assert "checkpoint_names={'lm_head.weight': 'embed_out.weight'}" in error.args[0]
            names = {"lm_head.weight": "embed_out.weight"}
        else:
            names = {}
        assert not list(m.state.values())  # nothing stays registered
        streamed = stream_module(m, skeleton, checkpoint=tmp_path, checkpoint_names=names or None)
        with anyio.fail_after(30), torch.no_grad():
            got = (await streamed(input_ids=ids)).logits
        assert torch.equal(got, want)
        await streamed.aclose()


def mixtral(meta: bool = False) -> nn.Module:
    """A small ``MixtralForCausalLM`` (no download): four experts per layer, two per token;
    ``meta=True`` on the meta device."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return made(MixtralForCausalLM, config, seed=6, meta=meta)


@pytest.mark.allow_loop_stall(0.5)  # (stream_module opens the checkpoint on the loop)
async def test_a_checkpoint_with_experts_saved_one_by_one_says_how_to_write_one_that_streams(
    tmp_path: Path,
) -> None:
    """transformers 5 fuses a Mixtral layer's experts into one tensor each when it loads, and
    its ``save_pretrained`` writes them back one by one: no ``checkpoint_names=`` can map
    that. The ``KeyError`` says so, and how to write the module's own layout
    (``save_original_format=False``), which then streams what the model computes."""
    pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    model = await off_loop(mixtral)
    if "save_original_format" not in inspect.signature(model.save_pretrained).parameters:
        pytest.skip("a transformers whose save_pretrained writes the module's own layout")
    ids, _ = inputs()
    want = await off_loop(lambda: logits_of(model, input_ids=ids))
    original, own = tmp_path / "original", tmp_path / "own"
    await off_loop(lambda: model.save_pretrained(original))
    await off_loop(lambda: model.save_pretrained(own, save_original_format=False))
    skeleton = await off_loop(mixtral, True)
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(KeyError) as refused:
            stream_module(m, skeleton, checkpoint=original)
        message = refused.value.args[0]
        assert "'model.layers.0.mlp.experts.gate_up_proj'" in message
        assert "checkpoint_names= cannot" in message
        assert "save_pretrained(directory, save_original_format=False)" in message
        assert not list(m.state.values())  # nothing stays registered
        streamed = stream_module(m, skeleton, checkpoint=own)
        with anyio.fail_after(30), torch.no_grad():
            got = (await streamed(input_ids=ids)).logits
        assert torch.equal(got, want)
        await streamed.aclose()
