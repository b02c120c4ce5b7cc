"""Host time per call on a model whose weights are all on the device: the module called
directly, through a ``ModelPool`` request (direct calls on the held replicas, the default;
through the streaming pipeline, ``direct_calls=False``; as shared calls,
``shared_calls=True``), and a whole request per call (admission of a hit, the call, the
request's end).

What a server bound by the host (an eager decoder launching its kernels) pays per forward on
top of the model itself. Prints a markdown table; one request, calls back to back, median of
``--rounds`` rounds of ``--calls`` calls.

    python benchmarks/bench_call_overhead.py                    # CUDA if present, else sim
    python benchmarks/bench_call_overhead.py --backend sim      # the simulation (host memory)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch

from aresidency import ResidencyManager
from aresidency.serving import ModelPool


def build(layers: int, hidden: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


async def main(args: argparse.Namespace) -> None:
    gpu = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    backend = "cuda" if gpu else "sim"
    device = "cuda:0" if gpu else "cpu"
    model = build(args.layers, args.hidden)
    ids = torch.arange(16).reshape(1, 16).to(device)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    async def timed(call: Callable[[], Awaitable[object]]) -> float:
        """Median ms per ``await call()`` over the rounds (the device's work included)."""
        times = []
        with torch.no_grad():
            for _ in range(args.rounds):
                sync()
                start = time.perf_counter()
                for _ in range(args.calls):
                    await call()
                sync()
                times.append(time.perf_counter() - start)
        return statistics.median(times) / args.calls * 1e3

    rows: list[tuple[str, float]] = []
    direct = model.to(device) if gpu else model

    async def direct_call() -> object:
        return direct(ids)

    rows.append(("module called directly", await timed(direct_call)))
    if gpu:
        model = model.to("cpu")
    async with ResidencyManager(backend=backend) as manager:
        paths: list[tuple[str, dict[str, bool]]] = [
            ("pool, direct calls (default)", {}),
            ("pool, through the pipeline", {"direct_calls": False}),
            ("pool, shared calls", {"shared_calls": True}),
        ]
        for label, options in paths:
            pool = ModelPool(manager, **options)
            pool.add("m", model)
            async with pool.use("m") as pooled:
                with torch.no_grad():
                    await pooled(ids)  # loads the model

                async def pooled_call() -> object:
                    return await pooled(ids)

                rows.append((label, await timed(pooled_call)))
            if not options:
                # A request per call: admission (a hit: nothing to load), the call, the end.
                async def request(pool: ModelPool = pool) -> object:
                    async with pool.use("m", reserve="1MiB") as pooled:
                        return await pooled(ids)

                rows.append(("pool, a request per call", await timed(request)))
            await pool.aclose()
    note = "" if gpu else " (the simulation: CUDA simulated in host memory, compute on the CPU)"
    print(
        f"Llama of {args.layers} layers, hidden {args.hidden}, 16 tokens, backend {backend}"
        f"{note}; median of {args.rounds} rounds of {args.calls} calls\n"
    )
    print("| path | ms per call | over the direct call |")
    print("|---|---:|---:|")
    base = rows[0][1]
    for label, ms in rows:
        print(f"| {label} | {ms:.2f} | {ms - base:+.2f} |")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("auto", "cuda", "sim"), default="auto")
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args(argv)


if __name__ == "__main__":
    torch.set_num_threads(1)
    anyio.run(main, parse())
