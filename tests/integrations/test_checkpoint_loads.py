"""Building packed groups' flat buffers from checkpoints, and recovering meta buffers.

Synchronous tests: no event loop, no manager. Each group's loader is called directly and every
tensor of its flat buffer is compared with the model the checkpoint was saved from."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")
from safetensors.torch import save_file, save_model

from aresidency.integrations.streaming.checkpoint import (
    block_loader,
    recover_meta_buffers,
)
from aresidency.integrations.streaming.packing import (
    TensorGroup,
    collect_groups,
    find_blocks,
)
from aresidency.runtime.checkpoints import Checkpoint

from ._models import Net


def groups_of(module: nn.Module) -> list[TensorGroup]:
    blocks, resident = collect_groups(module, find_blocks(module), "t", keep_strides=False)
    return [g for g in (*blocks, resident) if g is not None]


def tensors_by_name(module: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def save_state(module: nn.Module, path: Path, dtype: torch.dtype | None = None) -> None:
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, str(path))


def load_all(
    module: nn.Module, checkpoint: Checkpoint, root: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of every group of ``module`` as loaded from ``checkpoint``, by each name."""
    out: dict[str, torch.Tensor] = {}
    for group in groups_of(module):
        flat = block_loader(group, checkpoint, module=root)()
        assert flat.dtype == torch.uint8 and flat.numel() == group.nbytes
        for entry, view in zip(group.entries, group.views(flat)):
            for name in entry.names:
                out[name] = view
    return out


def assert_all_equal(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype, name
        assert torch.equal(got, tensor.detach()), name


def plain_net(seed: int) -> Net:
    net = Net(seed=seed)
    for block in net.layers:  # a checkpoint's strides are contiguous
        block.mix = nn.Parameter(block.mix.detach().contiguous())
    return net


# ---------------------------------------------------------------- packing knows persistence


def test_pack_layout_marks_only_non_persistent_buffers_as_not_persistent() -> None:
    entries = {e.names[0]: e for g in groups_of(Net()) for e in g.entries}
    assert not entries["pos"].persistent  # registered with persistent=False
    assert entries["layers.0.scale"].persistent  # a persistent buffer
    assert all(entries[name].persistent for name, _ in Net().named_parameters())


# ---------------------------------------------------------------- loads


def test_each_groups_flat_buffer_holds_the_checkpoints_tensors(tmp_path: Path) -> None:
    real = plain_net(seed=0)
    save_state(real, tmp_path / "net.safetensors")
    twin = plain_net(seed=99)  # other weights: all replaced from the file except 'pos'
    with Checkpoint.open(tmp_path / "net.safetensors") as checkpoint:
        loaded = load_all(twin, checkpoint)
    expected = tensors_by_name(real)
    assert not torch.equal(twin.head.weight, real.head.weight)
    assert_all_equal(loaded, expected)


def test_a_non_persistent_buffer_missing_from_the_checkpoint_comes_from_the_module(
    tmp_path: Path,
) -> None:
    real = plain_net(seed=0)
    save_state(real, tmp_path / "net.safetensors")
    twin = plain_net(seed=99)
    with Checkpoint.open(tmp_path / "net.safetensors") as checkpoint:
        (resident,) = [g for g in groups_of(twin) if any("pos" in e.names for e in g.entries)]
        load = block_loader(resident, checkpoint)
        with torch.no_grad():
            twin.pos.copy_(torch.arange(twin.pos.numel(), dtype=twin.pos.dtype) * 3)
        views = dict(zip((e.names[0] for e in resident.entries), resident.views(load())))
    assert torch.equal(views["pos"], twin.pos)  # the module's tensor as it is at load
    assert torch.equal(views["head.weight"], real.head.weight)


def test_a_non_persistent_buffer_in_the_checkpoint_is_read_from_it(tmp_path: Path) -> None:
    real = plain_net(seed=0)
    state = {k: v.detach().contiguous() for k, v in real.state_dict().items()}
    state["pos"] = torch.full_like(real.pos, 5.0)
    save_file(state, str(tmp_path / "net.safetensors"))
    with Checkpoint.open(tmp_path / "net.safetensors") as checkpoint:
        loaded = load_all(plain_net(seed=99), checkpoint)
    assert torch.equal(loaded["pos"], state["pos"])


def test_a_missing_parameter_or_persistent_buffer_fails_when_the_loader_is_built(
    tmp_path: Path,
) -> None:
    real = plain_net(seed=0)
    state = {k: v.detach().contiguous() for k, v in real.state_dict().items()}
    del state["layers.1.up.weight"], state["layers.1.scale"]
    save_file(state, str(tmp_path / "net.safetensors"))
    twin = plain_net(seed=99)
    with Checkpoint.open(tmp_path / "net.safetensors") as checkpoint:
        group = groups_of(twin)[1]
        with pytest.raises(KeyError) as caught:
            block_loader(group, checkpoint)
        message = str(caught.value)
        assert "'layers.1.up.weight'" in message and "'layers.1.scale'" in message
        assert "net.safetensors" in message
        for other in groups_of(twin)[2:]:  # the other groups are complete
            block_loader(other, checkpoint)


def test_a_shape_mismatch_is_an_error_naming_both(tmp_path: Path) -> None:
    real = plain_net(seed=0)
    state = {k: v.detach().contiguous() for k, v in real.state_dict().items()}
    state["layers.0.up.bias"] = torch.zeros(7)
    save_file(state, str(tmp_path / "net.safetensors"))
    with (
        Checkpoint.open(tmp_path / "net.safetensors") as checkpoint,
        pytest.raises(ValueError, match=r"'layers\.0\.up\.bias' has shape \[7\].*\[64\]"),
    ):
        block_loader(groups_of(plain_net(seed=1))[0], checkpoint)


def test_a_bf16_checkpoint_loads_into_a_float32_module_bit_exact(tmp_path: Path) -> None:
    real = plain_net(seed=0)
    save_state(real, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    with Checkpoint.open(tmp_path / "bf16.safetensors") as checkpoint:
        assert checkpoint.info("head.weight").dtype == torch.bfloat16
        loaded = load_all(plain_net(seed=99), checkpoint)
    for name, tensor in real.state_dict().items():
        if tensor.is_floating_point():
            assert loaded[name].dtype == tensor.dtype, name
            assert torch.equal(loaded[name], tensor.to(torch.bfloat16).to(tensor.dtype)), name


def test_a_float32_checkpoint_loads_into_a_bf16_module_rounded(tmp_path: Path) -> None:
    real = plain_net(seed=0)
    save_state(real, tmp_path / "f32.safetensors")
    twin = plain_net(seed=99).to(torch.bfloat16)
    with Checkpoint.open(tmp_path / "f32.safetensors") as checkpoint:
        loaded = load_all(twin, checkpoint)
    for name, tensor in real.state_dict().items():
        assert loaded[name].dtype == torch.bfloat16, name
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16)), name


# ---------------------------------------------------------------- meta buffers


def test_a_meta_non_persistent_buffer_without_module_is_an_error_saying_so(
    tmp_path: Path,
) -> None:
    save_state(plain_net(seed=0), tmp_path / "net.safetensors")
    with torch.device("meta"):
        skeleton = Net()
    resident = groups_of(skeleton)[-1]
    with Checkpoint.open(tmp_path / "net.safetensors") as checkpoint:
        with pytest.raises(ValueError, match=r"'pos' .*meta device.*pass module="):
            block_loader(resident, checkpoint)
        # A plain module has no config nor initialisation to recompute it from.
        with pytest.raises(ValueError, match=r"'pos' \(Net\)"):
            block_loader(resident, checkpoint, module=skeleton)


class Rope(nn.Module):
    """A rotary module of the transformers 4.x kind: buffers computed from a config."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        inv = 1.0 / (10000 ** (torch.arange(0, config.dim, 2, dtype=torch.float32) / config.dim))
        self.register_buffer("inv_freq", inv, persistent=False)


class RopeNet(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.rope = Rope(config)
        self.layers = nn.ModuleList(nn.Linear(config.dim, config.dim) for _ in range(2))


def test_a_meta_buffer_of_a_parameterless_module_is_rebuilt_from_its_config() -> None:
    config = SimpleNamespace(dim=16)
    real = RopeNet(config)
    with torch.device("meta"):
        skeleton = RopeNet(config)
    recovered = recover_meta_buffers(skeleton)
    assert sorted(recovered) == ["rope.inv_freq"]
    assert torch.equal(recovered["rope.inv_freq"], real.rope.inv_freq)
    assert skeleton.rope.inv_freq.is_meta  # the module is left as it was
    with pytest.raises(KeyError, match=r"'layers\.0\.weight'"):
        recover_meta_buffers(skeleton, names=["layers.0.weight"])


class Positions(nn.Module):
    """Has a parameter, so it is never rebuilt: only ``_init_weights`` can recover its buffers."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.register_buffer("ids", torch.arange(n), persistent=False)
        self.register_buffer("other", torch.ones(n), persistent=False)


class FakePretrained(nn.Module):
    """The shape of a Hugging Face model: a ``config`` and an ``_init_weights(module)`` that
    sets the non-persistent buffers it knows (``ids``, not ``other``) and re-draws weights."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.pos = Positions(config.n)
        self.layers = nn.ModuleList(nn.Linear(config.n, config.n) for _ in range(2))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, Positions):
            nn.init.normal_(module.weight)
            module.ids.copy_(torch.arange(self.config.n))


def test_meta_buffers_are_recomputed_by_the_models_init_weights_on_a_twin() -> None:
    model = FakePretrained(SimpleNamespace(n=6))
    weight = model.pos.weight.detach().clone()
    model.pos._buffers["ids"] = torch.empty(6, dtype=torch.int64, device="meta")
    recovered = recover_meta_buffers(model, names=["pos.ids"])
    assert torch.equal(recovered["pos.ids"], torch.arange(6))
    assert model.pos.ids.is_meta  # the module is left as it was...
    assert torch.equal(model.pos.weight, weight)  # ...its real weights not re-drawn


def test_a_meta_buffer_init_weights_does_not_set_is_an_error_naming_it() -> None:
    with torch.device("meta"):
        skeleton = FakePretrained(SimpleNamespace(n=6))
    with pytest.raises(ValueError, match=r"'pos.other' \(Positions\).*does not set it") as caught:
        recover_meta_buffers(skeleton)
    assert "pos.ids" not in str(caught.value)  # that one was recovered


# ---------------------------------------------------------------- Hugging Face Llama


def llama_config(**overrides: object) -> object:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # ImportError too: transformers refuses to import with dependencies too old for it
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        **overrides,
    )


def llama(config: object, seed: int = 0, meta: bool = False) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    return LlamaForCausalLM(config)


def save_llama(model: nn.Module, where: Path, sharded: bool) -> Path:
    if not sharded:
        save_model(model, str(where / "model.safetensors"))
        return where / "model.safetensors"
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    weight_map: dict[str, str] = {}
    for number, part in enumerate((names[::2], names[1::2]), start=1):
        shard = f"model-{number:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, str(where / shard))
        weight_map.update(dict.fromkeys(part, shard))
    index = where / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_a_llama_built_on_meta_loads_every_tensor_equal_to_the_real_model(
    tmp_path: Path, sharded: bool
) -> None:
    config = llama_config()
    real = llama(config, seed=0)
    path = save_llama(real, tmp_path, sharded)
    skeleton = llama(config, meta=True)
    assert skeleton.model.rotary_emb.inv_freq.is_meta
    with Checkpoint.open(path) as checkpoint:
        assert len(checkpoint.files) == (2 if sharded else 1)
        assert "model.rotary_emb.inv_freq" not in checkpoint  # non-persistent: not saved
        loaded = load_all(skeleton, checkpoint, root=skeleton)
    expected = tensors_by_name(real)
    assert {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"} <= set(expected)
    assert_all_equal(loaded, expected)
    assert all(t.is_meta for t in tensors_by_name(skeleton).values())  # left as it was


def test_a_llama_with_tied_embeddings_loads_the_shared_weight_once(tmp_path: Path) -> None:
    config = llama_config(tie_word_embeddings=True)
    real = llama(config, seed=1)
    assert real.lm_head.weight is real.model.embed_tokens.weight
    path = save_llama(real, tmp_path, sharded=False)  # save_model keeps one of the names
    skeleton = llama(config, meta=True)
    with Checkpoint.open(path) as checkpoint:
        assert ("lm_head.weight" in checkpoint) != ("model.embed_tokens.weight" in checkpoint)
        loaded = load_all(skeleton, checkpoint, root=skeleton)
    assert_all_equal(loaded, tensors_by_name(real))


def test_recover_meta_buffers_recomputes_llama_rotary_buffers() -> None:
    config = llama_config()
    real = llama(config)
    skeleton = llama(config, meta=True)
    with torch.inference_mode():  # works whatever the caller's mode
        recovered = recover_meta_buffers(skeleton)
    assert sorted(recovered) == [
        "model.rotary_emb.inv_freq",
        "model.rotary_emb.original_inv_freq",
    ]
    for name, tensor in recovered.items():
        assert tensor.device.type == "cpu"
        assert torch.equal(tensor, tensors_by_name(real)[name]), name
    assert skeleton.model.rotary_emb.inv_freq.is_meta
    only = recover_meta_buffers(skeleton, names=["model.rotary_emb.inv_freq"])
    assert sorted(only) == ["model.rotary_emb.inv_freq"]
