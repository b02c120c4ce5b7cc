"""What ``stream_module`` refuses, and that a refusal leaves everything as it was: quantized
(float8) checkpoints into a model of another dtype, budgets that could never fit (checked
before a tensor moves), and the messages of refusals a user has to act on."""

from __future__ import annotations

import copy
from pathlib import Path

import anyio
import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")
from safetensors.torch import save_file

from aresidency import ResidencyManager
from aresidency.integrations import stream_module

pytestmark = pytest.mark.anyio


def _fp8_checkpoint(model: nn.Module, path: Path, dtype: torch.dtype) -> None:
    """``model``'s weights quantized per tensor to ``dtype`` with their scales beside them, as
    block-wise fp8 checkpoints store them (``*.weight_scale_inv``)."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("weight"):
            scale = tensor.abs().max() / 64
            state[name] = (tensor / scale).to(dtype)
            state[f"{name}_scale_inv"] = scale.reshape(1)
        else:
            state[name] = tensor.contiguous()
    save_file(state, str(path))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
async def test_a_float8_checkpoint_into_a_model_of_another_dtype_is_refused(
    tmp_path: Path, fp8: torch.dtype, model_dtype: torch.dtype
) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(model_dtype).eval()
    _fp8_checkpoint(model, tmp_path / "model.safetensors", fp8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pointers = [t.data_ptr() for t in model.state_dict().values()]
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(ValueError) as caught:
            stream_module(m, model, "cuda:0", checkpoint=tmp_path)
        message = str(caught.value)
        assert "'0.weight'" in message and str(fp8) in message and str(model_dtype) in message
        assert "quantiz" in message and "scale" in message
        assert not m.snapshot().values  # nothing registered, nothing left
        # nothing moved: the module is as it was, and can be streamed (without the checkpoint)
        assert [t.data_ptr() for t in model.state_dict().values()] == pointers
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        streamed = stream_module(m, model, "cuda:0")
        await streamed.aclose()


async def test_a_float_checkpoint_into_a_float8_model_is_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.st"))
    quantized = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    quantized[1].weight.data = quantized[1].weight.data.to(torch.float8_e4m3fn)
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(ValueError, match=r"'1\.weight' is torch\.float32.*float8_e4m3fn"):
            stream_module(m, quantized, "cuda:0", checkpoint=tmp_path / "m.st")
        assert not m.snapshot().values


async def test_a_float8_checkpoint_streams_into_a_float8_model_unchanged(tmp_path: Path) -> None:
    """The same dtype is no conversion: a model built with the checkpoint's quantization (its
    float8 weights and their scales as tensors of its own) gets the bytes as they are."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "m.safetensors"))
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, model, "cuda:0", checkpoint=tmp_path / "m.safetensors")
        for group in streamed.all_groups:
            flat = streamed._loaders[group.index]()
            for entry, view in zip(group.entries, group.views(flat)):
                assert view.dtype == state[entry.names[0]].dtype
                assert torch.equal(view.view(torch.uint8), state[entry.names[0]].view(torch.uint8))
        await streamed.aclose()


def _linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))).eval()


@pytest.mark.parametrize(
    "budgets, error",
    [
        pytest.param({"cuda:0": 4096}, ValueError, id="device-budget-never-fits"),
        pytest.param({"pinned-host": 3 * 17_000}, Exception, id="host-budget-too-small"),
    ],
)
async def test_a_budget_that_can_never_fit_is_refused_before_a_tensor_moves(
    budgets: dict[str, int], error: type[Exception]
) -> None:
    """Packing gives every tensor new storage: a refusal that could be made up front is made
    before that, so the module is exactly as it was (same storage, a view taken earlier still
    a view of it), not a copy of itself."""
    model = _linears()
    pointers = [t.data_ptr() for t in model.state_dict().values()]
    view = model[3].weight[0]  # a view of the last block: its group would be packed last
    async with ResidencyManager(backend="sim", budgets=budgets) as m:
        with pytest.raises(error, match="budget") as caught:
            stream_module(m, model, "cuda:0")
        assert "pinned-host" in str(caught.value) or "cuda:0" in str(caught.value)
        assert not m.snapshot().values
        assert [t.data_ptr() for t in model.state_dict().values()] == pointers
        assert view.data_ptr() == model[3].weight.data_ptr()


async def test_a_meta_tensor_in_the_last_block_is_refused_before_a_tensor_moves() -> None:
    model = _linears()
    model[3].bias = nn.Parameter(torch.empty(64, device="meta"))
    pointers = [t.data_ptr() for t in model[0].state_dict().values()]
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(ValueError, match=r"3\.bias is on the meta device.*checkpoint="):
            stream_module(m, model, "cuda:0")
        assert not m.snapshot().values
        assert [t.data_ptr() for t in model[0].state_dict().values()] == pointers


def _run_in_thread(
    module: nn.Module, x: torch.Tensor, kwargs: dict[str, object], threads: int
) -> torch.Tensor:
    """``module(x, **kwargs)`` in a worker thread (not on the loop) whose BLAS uses the
    process's intra-op thread count, as the thread running a streamed forward does: a new
    thread's first CPU matmul may otherwise round differently."""
    torch.set_num_threads(threads)
    out = module(x, **kwargs)
    assert isinstance(out, torch.Tensor)
    return out


async def reference_output(module: nn.Module, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
    return await anyio.to_thread.run_sync(
        _run_in_thread, module, x, kwargs, torch.get_num_threads()
    )


def _encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False).eval()


def _as_streamed(encoder: nn.TransformerEncoder) -> nn.TransformerEncoder:
    """A copy of ``encoder`` that picks the kernels its streamed calls pick (see
    docs/streaming.md, Gradients): weights that do not require grad, a hook on each block."""
    reference = copy.deepcopy(encoder).requires_grad_(False)
    for block in reference.layers:
        block.register_forward_pre_hook(lambda module, args: None)
    return reference


async def test_the_first_call_in_the_new_worker_thread_rounds_as_the_callers_thread() -> None:
    """The thread that runs a streamed forward uses the caller's intra-op thread count from
    its first operation on (``torch.set_num_threads``; the tests run with one): a new
    thread's BLAS otherwise sets itself up from the default and may split (and round) the
    first call's CPU matmuls differently from every later call's."""
    encoder = _encoder()
    x = torch.randn(2, 5, 32)
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, encoder, "cuda:0")
        with torch.no_grad():
            first = await streamed(x)
            second = await streamed(x)
        assert torch.equal(first, second)
        await streamed.aclose()
    with torch.no_grad():
        assert torch.equal(first, await reference_output(_as_streamed(encoder), x))


async def test_grad_mode_changes_nothing_the_weights_never_require_grad() -> None:
    """Streamed calls are for inference (docs/streaming.md, Gradients): a call in grad mode
    computes what it computes under no_grad, with weights that do not require grad, so a
    kernel chosen by those flags (nn.TransformerEncoderLayer's, nn.MultiheadAttention's) is
    the one the module picks with ``requires_grad_(False)`` and a hook on each block."""
    encoder = _encoder()
    reference = _as_streamed(encoder)
    seen: list[bool] = []
    encoder.layers[1].linear1.register_forward_pre_hook(
        lambda module, args: seen.append(module.weight.requires_grad)
    )
    x = torch.randn(2, 5, 32)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3:] = True
    async with ResidencyManager(backend="sim") as m:
        streamed = stream_module(m, encoder, "cuda:0")
        for kwargs in ({}, {"src_key_padding_mask": mask}):
            expected = await reference_output(reference, x, **kwargs)
            in_grad_mode = await streamed(x, **kwargs)
            with torch.no_grad():
                under_no_grad = await streamed(x, **kwargs)
            assert torch.is_grad_enabled() and not in_grad_mode.requires_grad
            assert torch.equal(in_grad_mode, under_no_grad)
            assert torch.equal(in_grad_mode, expected)
        assert seen == [False] * 4
        assert all(p.requires_grad for p in encoder.parameters())  # the module's flags stay
        await streamed.aclose()


async def test_a_checkpoint_directory_of_pytorch_model_bin_is_refused_saying_to_convert(
    tmp_path: Path,
) -> None:
    model = _linears()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(
            FileNotFoundError, match=r"pytorch_model\.bin.*convert it to safetensors"
        ):
            stream_module(m, model, "cuda:0", checkpoint=tmp_path)
        assert not m.snapshot().values


async def test_a_refused_stream_module_closes_the_checkpoint_it_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint opened from a path is the streamed module's: a refusal closes it (its
    shards' descriptors and mappings), not the garbage collector some time later."""
    from aresidency.runtime.checkpoints import Checkpoint

    closed: list[Checkpoint] = []
    close = Checkpoint.close

    def recording(self: Checkpoint) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(Checkpoint, "close", recording)
    model = _linears()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "3.bias"}
    save_file(state, str(tmp_path / "model.safetensors"))
    async with ResidencyManager(backend="sim") as m:
        with pytest.raises(KeyError, match=r"3\.bias"):
            stream_module(m, model, "cuda:0", checkpoint=tmp_path)
        assert len(closed) == 1 and closed[0].path == tmp_path
        with Checkpoint.open(tmp_path) as given:  # one given opened stays the caller's
            with pytest.raises(KeyError, match=r"3\.bias"):
                stream_module(m, model, "cuda:0", checkpoint=given)
            assert len(closed) == 1
            assert "0.weight" in given and given.read("0.weight").shape == (64, 64)
