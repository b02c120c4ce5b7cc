"""Automatic Example 16: weight streaming runs a model bigger than the GPU budget, block by block.

The model keeps its weights in pinned host memory; a budget of three blocks on ``cuda:0`` is
all it gets. A call reserves a ring of device buffers for the blocks (one reservation). While
block ``i`` computes, the copies of blocks ``i+1`` and ``i+2`` are already on the copy stream,
each into the buffer of a block whose kernels finished (the copy waits for them on the device;
nobody synchronizes). The result is the same, bit for
bit, as running the whole model on the GPU.

Runs on a GPU when there is one (backend "auto") and on the simulated backend otherwise, which
makes ``cuda:N`` out of host memory (a simulation, said so in the output; smaller sizes).

    python examples/16_weight_streaming.py
"""

from __future__ import annotations

import asyncio
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

from aresidency import ResidencyManager
from aresidency.integrations import stream_module

MiB = 1 << 20


class Block(nn.Module):
    """A transformer-style MLP block."""

    def __init__(self, d: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, dtype=dtype)
        self.up = nn.Linear(d, 4 * d, dtype=dtype)
        self.down = nn.Linear(4 * d, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm(x))))
        return out


class Model(nn.Module):
    """Embedding, a list of blocks, a head: the usual shape of a large model."""

    def __init__(self, vocab: int, d: int, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, dtype=dtype)
        self.blocks = nn.ModuleList(Block(d, dtype) for _ in range(n))
        self.head = nn.Linear(d, vocab, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(h)
        return logits


async def main() -> None:
    gpu = torch.cuda.is_available()
    # On a GPU: 24 blocks of 64 MiB (bf16, d=2048) = 1.5 GiB of blocks. Simulated: small.
    d, n, dtype = (2048, 24, torch.bfloat16) if gpu else (128, 12, torch.float32)
    torch.manual_seed(0)
    model = Model(vocab=1000, d=d, n=n, dtype=dtype).eval()
    reference_model = copy.deepcopy(model)  # to check the result against, at the end

    async with ResidencyManager(backend="auto") as manager:
        simulated = manager.backend.host_compute  # "device" work runs on host threads
        note = " (a simulation of CUDA devices made of host memory)" if simulated else ""
        print(f"backend: {manager.backend.name}{note}")

        # 1. Register: each block's parameters become one managed value in pinned host memory
        #    (the module's parameters now point into it: no second host copy).
        streamed = stream_module(manager, model, "cuda:0", prefetch=2, host="pinned-host")
        block = max(streamed.block_bytes)
        total = sum(streamed.block_bytes)
        print(
            f"{len(streamed.block_bytes)} blocks of {block / MiB:.1f} MiB "
            f"({total / MiB:.0f} MiB in all), {streamed.resident_bytes / MiB:.1f} MiB "
            "outside the blocks (embedding, head: held for the whole call)"
        )

        # 2. Choose a budget: the resident tensors and three blocks. The model does not fit.
        budget = streamed.resident_bytes + 3 * block
        manager.set_budget("cuda:0", budget)
        print(f"cuda:0 budget: {budget / MiB:.1f} MiB for a {total / MiB:.0f} MiB model")

        # 3. Call the module as usual (awaited). Inputs live on the device.
        device = "cuda:0" if not simulated else "cpu"  # simulated cuda:0 is host memory
        tokens = torch.randint(0, 1000, (8, 256), device=device)
        with torch.no_grad():
            for attempt in range(3):
                start = time.perf_counter()
                logits = await streamed(tokens)
                if gpu:
                    torch.cuda.synchronize()
                elapsed = (time.perf_counter() - start) * 1e3
                print(f"call {attempt}: {elapsed:.1f} ms")
        await streamed.drain()  # every released replica has left the budget

        # 4. The evidence: the ledger never went past the budget; what stays on cuda:0 between
        #    calls is what fits beside the prefetch window (here the embedding and head).
        record = manager.snapshot().location("cuda:0")
        residency = streamed.residency()
        print(
            f"cuda:0 peak charge {record.peak_bytes / MiB:.1f} MiB <= budget "
            f"{budget / MiB:.1f} MiB; kept between calls: {residency['kept']} "
            f"({residency['kept_bytes'] / MiB:.1f} MiB): {residency['reason']}"
        )
        assert record.peak_bytes <= budget and record.used_bytes == residency["kept_bytes"]
        # The blocks' copies run inside a call's ring (its reservation is all the manager sees
        # of them; a call that starts while the device still runs the previous one takes its
        # ring over); the manager's own copies are the resident group's.
        kinds = [t.kind for t in manager.trace().transitions]
        print(
            f"trace: {kinds.count('reserve')} ring reservation(s), "
            f"{kinds.count('copy_begin')} managed copies, {kinds.count('event_reaped')} "
            f"compute events reaped, {kinds.count('release')} releases"
        )

        # 5. Same result as the model run in one piece on the device.
        on_device = reference_model.to(device)
        with torch.no_grad():
            expected = on_device(tokens)
        print(
            f"bit-identical to the model run entirely on {device}: {torch.equal(logits, expected)}"
        )

        # 6. Close: the module gets its own host tensors back; the values are discarded.
        await streamed.aclose()


if __name__ == "__main__":
    asyncio.run(main())
