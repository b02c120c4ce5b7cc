"""Hugging Face decoders streamed on a real GPU (marked ``cuda``; skipped without one).

A Llama-shaped ``LlamaForCausalLM`` built from a config (no download), bf16: its forward and its
greedy ``generate`` bit for bit against the same model run entirely on the GPU, and device
memory: the peak of ``torch.cuda.max_memory_allocated`` during a streamed call stays within the
manager's budget plus the activations (and the KV cache) the all-GPU run needed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from aresidency import ResidencyManager
from aresidency.integrations import stream_module

from ._models import tiny_llama

pytest.importorskip("transformers.models.llama.modeling_llama")

pytestmark = [pytest.mark.anyio, pytest.mark.cuda]

LAYERS = 8
NEW_TOKENS = 8


def llama() -> nn.Module:
    """About 22 MiB per decoder layer in bf16."""
    return tiny_llama(LAYERS, dtype=torch.bfloat16, hidden=1024, intermediate=2816)


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 64), generator=g).to("cuda:0")
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return ids, mask


def on_gpu(model: nn.Module, run: Any) -> tuple[torch.Tensor, int]:
    """``run(model on the GPU)`` and the peak bytes it allocated beyond the weights."""
    gpu = copy.deepcopy(model).to("cuda:0")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = run(gpu)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    del gpu
    torch.cuda.synchronize()
    return out, extra


async def test_llama_forward_and_generate_are_bit_identical_within_budget() -> None:
    model = llama()
    ids, mask = inputs()
    expected, activations = on_gpu(
        model, lambda gpu: gpu(input_ids=ids, attention_mask=mask).logits
    )
    expected_ids, generate_extra = on_gpu(
        model,
        lambda gpu: gpu.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        ),
    )
    async with ResidencyManager(backend="cuda") as m:
        probe = stream_module(m, llama(), prefetch=0)
        budget = probe.resident_bytes + 3 * max(probe.block_bytes)
        await probe.aclose()
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="cuda") as m:
        streamed = stream_module(m, model, prefetch=2)
        # The first call creates the worker thread's cuBLAS handle and workspace (kept for
        # the process's life, not residency memory): warm up, then measure.
        with torch.no_grad():
            await streamed(input_ids=ids, attention_mask=mask)
        await streamed.drain()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            out = await streamed(input_ids=ids, attention_mask=mask)
        torch.cuda.synchronize()
        assert torch.equal(out.logits, expected)
        assert torch.cuda.max_memory_allocated() - base <= budget + activations
        del out
        await streamed.drain()

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        generated = await streamed.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False
        )
        torch.cuda.synchronize()
        assert generated.device.type == "cuda"
        assert torch.equal(generated, expected_ids)
        assert torch.cuda.max_memory_allocated() - base <= budget + generate_extra
        await streamed.drain()
        snap = m.snapshot()
        assert snap.location("cuda:0").peak_bytes <= budget
        assert snap.location("cuda:0").used_bytes == sum(
            snap.value(h).charge_bytes
            for h in streamed.handles
            if h.name in streamed.residency()["kept"]
        )
        await streamed.aclose()


async def test_half_the_model_in_the_budget_keeps_layers_on_the_gpu() -> None:
    model = llama()
    ids, mask = inputs()
    expected, _ = on_gpu(model, lambda gpu: gpu(input_ids=ids, attention_mask=mask).logits)
    async with ResidencyManager(backend="cuda", trace_capacity=1 << 14) as m:
        streamed = stream_module(m, model, prefetch=1, name="llama")
        total = streamed.resident_bytes + sum(streamed.block_bytes)
        m.set_budget("cuda:0", total // 2)
        copied = []
        for _ in range(3):
            before = streamed.copied_bytes
            with torch.no_grad():
                out = await streamed(input_ids=ids, attention_mask=mask)
            torch.cuda.synchronize()
            assert torch.equal(out.logits, expected)
            await streamed.drain()
            copied.append(streamed.copied_bytes - before)
        residency = streamed.residency()
        assert copied[0] == total
        assert copied[1] == copied[2] == residency["streamed_bytes"] < total
        assert m.snapshot().location("cuda:0").peak_bytes <= total // 2
        await streamed.aclose()
