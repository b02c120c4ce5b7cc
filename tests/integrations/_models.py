"""Small models for the weight-streaming tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A transformer-like block: several parameters of two dtypes, a persistent buffer and a
    transposed (non-contiguous) weight, so one packed group holds a bit of everything."""

    def __init__(self, d: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.mix = nn.Parameter(torch.randn(d, d, generator=g).t())  # transposed storage
        self.gate = nn.Parameter(torch.randn(d, generator=g, dtype=torch.float64))
        self.register_buffer("scale", torch.rand(d, generator=g) + 0.5)
        with torch.no_grad():
            for p in (self.norm.weight, self.norm.bias, *self.up.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            for p in self.down.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))
        return x + (h @ self.mix) * self.scale * self.gate.to(x.dtype).sigmoid()


class Net(nn.Module):
    """A model with a list of blocks and tensors outside it (input projection, head, a
    non-persistent buffer), run through its own forward."""

    def __init__(self, d: int = 32, n: int = 5, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(16, d)
        self.layers = nn.ModuleList(Block(d, seed + 1 + i) for i in range(n))
        self.small = nn.ModuleList([nn.Identity()])  # a smaller list: not the blocks
        self.head = nn.Linear(d, 8)
        self.register_buffer("pos", torch.linspace(-1, 1, d), persistent=False)

    def forward(self, x: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
        h = self.embed(x) + self.pos + shift
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Sleepy(nn.Module):
    """A linear layer whose 'kernel' takes a while (it runs on a simulated stream's thread)."""

    def __init__(self, d: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return torch.tanh(self.linear(x))


class SleepyNet(nn.Module):
    """A list of slow blocks run by the model's own forward (in the streaming worker thread)."""

    def __init__(self, d: int = 16, n: int = 6, seconds: float = 0.02) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Sleepy(d, seconds) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Boom(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def sequential(d: int = 32, n: int = 6, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(n):
        layers.append(nn.Linear(d, d))
        if i % 2:
            layers.append(nn.GELU())  # a block without tensors
    return nn.Sequential(*layers)


def linears(d: int = 32, n: int = 6, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(d, d) for _ in range(n)))


def tiny_llama(
    layers: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    meta: bool = False,
    hidden: int = 64,
    intermediate: int = 128,
) -> nn.Module:
    """A Hugging Face ``LlamaForCausalLM`` built from a small ``LlamaConfig`` (no download):
    an embedding, ``layers`` decoder layers in ``model.layers`` (about 145 KiB each in float32
    at the default sizes), a final norm and a head, a rotary embedding with its non-persistent
    ``inv_freq``. Random weights from ``seed``; ``meta=True`` builds it on the meta device
    (nothing allocated)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model: nn.Module = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    return nn.Module.to(model, dtype).eval()
