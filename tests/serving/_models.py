"""Small models for the serving tests, and helpers that check what a pool left behind."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aresidency import MaterializationState, ResidencyManager, ResidencyTrace
from aresidency.serving import ModelPool


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, a list of blocks, a head: the shape of a language model, in kilobytes.
    With ``d=32, n=4`` each block is 17.5 KiB and the rest (embedding, head) 6 KiB."""

    def __init__(self, d: int = 32, n: int = 4, vocab: int = 24, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)
        # Built without autograd, as a server builds its models: the tests need no grad-mode
        # context around their awaits (one entered in concurrent tasks of one thread would
        # leak: grad mode is the thread's, and the tasks exit out of order).
        self.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def tiny_llama(seed: int = 0, layers: int = 3) -> nn.Module:
    """A Llama with hidden size 64, built from its config (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def reference(model: nn.Module, *args: object) -> torch.Tensor:
    with torch.no_grad():
        out = model(*args)
    assert isinstance(out, torch.Tensor)
    return out


def max_charge(trace: ResidencyTrace, location: str = "cuda:0") -> int:
    """Replay the trace: the largest charge (values and reservations) the location ever had."""
    assert trace.overwritten == 0, "raise trace_capacity: the replay needs every transition"
    current = peak = 0
    for transition in trace.transitions:
        if transition.location is not None and str(transition.location) == location:
            current += transition.nbytes
            peak = max(peak, current)
    assert current >= 0
    return peak


def assert_nothing_leaked(manager: ResidencyManager, pool: ModelPool) -> None:
    """No request is admitted or waiting; at the device nothing is reserved, incoming, held
    or in use (what stays there is the pool's cache: unprotected, evictable)."""
    assert pool.admitted == 0 and pool.waiting == 0
    snap = manager.snapshot()
    device = snap.location("cuda:0")
    assert device.reserved_bytes == 0
    for value in snap.values.values():
        for record in value.materializations:
            if str(record.location) != "cuda:0":
                continue
            assert record.state is MaterializationState.RESIDENT, (value.handle, record)
            assert record.use_count == 0 and record.hold_count == 0, (value.handle, record)
    for name in pool.models:
        assert pool.stats()[name]["active"] == 0


def cache_argument(module: nn.Module) -> str:
    """The keyword a Hugging Face model takes its KV cache under: ``cache`` in transformers 5,
    ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def returned_cache(output: object) -> object:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


async def greedy(model: Any, module: nn.Module, prompt: torch.Tensor, steps: int) -> list[int]:
    """Prefill ``prompt`` then ``steps`` greedy decode steps with the KV cache, through
    ``model`` (a pooled model, or an async wrapper of the plain module)."""
    key = cache_argument(module)
    tokens: list[int] = []
    out = await model(prompt, use_cache=True)  # no grad-mode context: see TinyLM
    for _ in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(int(token))
        out = await model(token, use_cache=True, **{key: returned_cache(out)})
    tokens.append(int(out.logits[:, -1:].argmax(-1)))
    return tokens
