"""Layer-by-layer weight streaming on one GPU, side by side with the alternatives, in one run.

Why this module is long: one script runs every workload and every baseline in one process (so
the ratios come from one run on one machine), and the baselines are written out in full.

Part 1, ``nn.Sequential`` of matmuls: the reference workload of docs/performance.md
("Streaming 16 layers of 8192x8192 bf16 weights (128 MiB each) from pinned host", x @ W per
layer, batch 8192) and two variants of it, a copy-bound one (batch 1024) and a compute-bound
one (4096x4096 weights, batch 32768). For each, in ms (median wall time from the call to
``torch.cuda.synchronize()`` returning, after warm-up):

* compute only: the weights already on the GPU;
* copies only: the 16 host-to-device copies from pinned memory, back to back on one stream;
* serial: copy, then compute, layer by layer on one stream;
* double buffering: hand-written, two device buffers, a copy stream and events;
* accelerate ``cpu_offload`` on the same layers (weights in pageable host memory, as there);
* aresidency: ``stream_module(manager, model, prefetch=2)`` with a ``cuda:0`` budget of three
  layers, weights in pinned host memory.

For the reference workload also: aresidency with other prefetch depths (budget = prefetch + 1
layers), with the weights in pageable host memory (staged through pinned buffers), and rebuilt
from a safetensors checkpoint for every call. For every aresidency run, device memory: the peak
of ``torch.cuda.max_memory_allocated`` above what was allocated before, against the budget
plus the activations (measured in the compute-only run), and the manager's own ledger peak.

Part 2, Llama-shaped decoders built with ``transformers`` (``LlamaForCausalLM`` from a
``LlamaConfig``, random weights, bf16) at about 6.5, 24.5 and 416 MiB per decoder layer (96, 48
and 12 layers), prefill (1 x 512 tokens) and decode (one token on a KV cache of the prompt),
each by: compute only (the model on the GPU), copies only (every layer's packed weights, back
to back), a hand-written double buffer over the same layers (two device buffers, copies from
pinned host on a side stream, events both ways, forward hooks), accelerate's ``cpu_offload``
and diffusers' group offloading (``apply_group_offloading(..., offload_type="block_level",
num_blocks_per_group=1, use_stream=True)``) where installed, aresidency with budget = the
resident tensors + three layers, and aresidency with a budget of half the model (timed from the
second call: what fits stays resident). Ratios against the hand double buffer, the floor
max(copies, compute) and diffusers, and aresidency's host CPU time per layer (process CPU time
of the call, every thread, divided by the layers).

Goals (issue 12): aresidency <= 1.02x the hand double buffer, <= 1.05x the floor, faster than
diffusers at every layer size, host time per layer <= 50 us; with half the model in the budget,
<= 1.05x max(compute, copies of the half that does not fit). Figures: benchmarks/RESULTS.md.

usage: python3 benchmarks/bench_stream.py [--quick] [--sim | --backend sim] [--only NAME]
       [--json PATH] [--markdown PATH]

``--quick`` runs fewer iterations; ``--sim`` (or ``--backend sim``) runs tiny sizes on the
simulated backend without a GPU (a smoke test of this script, not a measurement); ``--only
matmul`` or ``--only llama`` runs one part.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aresidency import ResidencyManager
from aresidency.integrations import StreamedModule, stream_module

MiB = 1 << 20
REFERENCE_MS = {  # docs/performance.md, the reference workload
    "compute": 23.0,
    "copies": 38.9,
    "serial": 60.1,
    "double buffer": 40.3,
    "cpu_offload": 315.9,
}
METHODS = ["compute", "copies", "serial", "double buffer", "cpu_offload", "aresidency"]
T0 = time.perf_counter()
TIME_LIMIT_S = 140.0  # optional variants are skipped past this (the whole run: < 5 min)


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {message}", flush=True)


@dataclass
class Workload:
    name: str
    layers: int
    n: int
    batch: int
    variants: bool = False  # also the prefetch, pageable and checkpoint variants

    @property
    def layer_bytes(self) -> int:
        return self.n * self.n * 2

    def describe(self) -> str:
        return (
            f"{self.layers} x {self.n}x{self.n} bf16 ({self.layer_bytes / MiB:.0f} MiB each), "
            f"batch {self.batch}"
        )


@dataclass
class Result:
    ms: float | None = None
    error: str | None = None
    samples: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def cell(self) -> str:
        if self.error is not None:
            return f"error: {self.error[:60]}"
        if self.ms is None:
            return "n/a"
        return f"{self.ms:.1f}"


class MatMul(nn.Module):
    """``x @ W``: one layer of the workload."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class Device:
    """CUDA, or (``--sim``) the CPU with no-op streams, so the script can be smoke-tested."""

    def __init__(self, sim: bool) -> None:
        self.sim = sim
        self.name = "cpu" if sim else "cuda:0"

    def sync(self) -> None:
        if not self.sim:
            torch.cuda.synchronize()

    def stream(self) -> Any:
        return None if self.sim else torch.cuda.Stream()

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.sim else torch.cuda.stream(stream)

    def event(self) -> Any:
        return None if self.sim else torch.cuda.Event()

    def reset_peak(self) -> int:
        if self.sim:
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())

    def peak_since(self, base: int) -> int | None:
        if self.sim:
            return None
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated()) - base


class LedgerWatch:
    """The manager's own evidence: replays its trace from now on to find the largest charge
    ``cuda:0`` had (the trace is the ledger's history, one entry per transition)."""

    def __init__(self, manager: ResidencyManager) -> None:
        self.manager = manager
        self.start = manager.snapshot().location("cuda:0").charged_bytes
        transitions = manager.trace().transitions
        self.seq = transitions[-1].seq if transitions else -1

    def peak(self) -> int:
        trace = self.manager.trace()
        transitions = [t for t in trace.transitions if t.seq > self.seq]
        if transitions and transitions[0].seq != self.seq + 1:
            raise RuntimeError("the trace overwrote entries: raise trace_capacity")
        current = peak = self.start
        for t in transitions:
            if t.location is not None and str(t.location) == "cuda:0":
                current += t.nbytes
                peak = max(peak, current)
        return peak


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def time_sync(dev: Device, fn: Callable[[], Any], iters: int, warmup: int) -> Result:
    for _ in range(warmup):
        fn()
        dev.sync()
    samples = []
    for _ in range(iters):
        dev.sync()
        start = time.perf_counter()
        fn()
        dev.sync()
        samples.append(time.perf_counter() - start)
    return Result(median_ms(samples), samples=samples)


async def time_async(
    dev: Device,
    fn: Callable[[], Awaitable[Any]],
    after: Callable[[], Awaitable[None]],
    iters: int,
    warmup: int,
) -> tuple[Result, Any]:
    out = None
    for _ in range(warmup):
        out = None
        out = await fn()
        dev.sync()
        await after()
    samples = []
    for _ in range(iters):
        # The previous output must not be alive during the next call: it would count in the
        # call's memory peak (one output tensor above budget + activations).
        out = None
        dev.sync()
        start = time.perf_counter()
        out = await fn()
        dev.sync()
        samples.append(time.perf_counter() - start)
        await after()  # the releases finish (not timed: the device work is done)
    return Result(median_ms(samples), samples=samples), out


async def paired(
    dev: Device,
    ours: Callable[[], Awaitable[Any]],
    after: Callable[[], Awaitable[None]],
    theirs: Callable[[], Any],
    rounds: int,
) -> dict[str, float]:
    """aresidency and double buffering timed in alternating rounds (ABBA order), so that
    drift in the link or the clocks during the run falls on both alike."""
    ours_s: list[float] = []
    theirs_s: list[float] = []
    with torch.no_grad():
        for r in range(rounds):
            for which in (0, 1) if r % 2 == 0 else (1, 0):
                dev.sync()
                start = time.perf_counter()
                out = await ours() if which == 0 else theirs()
                dev.sync()
                (ours_s if which == 0 else theirs_s).append(time.perf_counter() - start)
                del out
                if which == 0:
                    await after()
    ratios = [a / b for a, b in zip(ours_s, theirs_s, strict=True)]
    return {
        "rounds": rounds,
        "aresidency_ms": round(median_ms(ours_s), 2),
        "double_buffer_ms": round(median_ms(theirs_s), 2),
        "ratio_median": round(statistics.median(ratios), 4),
    }


# ---------------------------------------------------------------- the methods


def compute_only(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    for w in weights:
        x = x @ w
    return x


def copies_only(dev: Device, host: list[torch.Tensor], bufs: list[torch.Tensor], s: Any) -> None:
    with dev.on(s):
        for i, w in enumerate(host):
            bufs[i % 2].copy_(w, non_blocking=True)
    if not dev.sim:
        torch.cuda.current_stream().wait_stream(s)


def serial(x: torch.Tensor, host: list[torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
    for w in host:
        buf.copy_(w, non_blocking=True)
        x = x @ buf
    return x


def double_buffer(
    dev: Device, x: torch.Tensor, host: list[torch.Tensor], bufs: list[torch.Tensor], s: Any
) -> torch.Tensor:
    """Copy layer i+1 on the copy stream while layer i computes; a buffer is overwritten only
    after the compute that read it (events, no host waits)."""
    if dev.sim:
        return serial(x, host, bufs[0])
    compute = torch.cuda.current_stream()
    copied = [torch.cuda.Event(), torch.cuda.Event()]
    consumed = [torch.cuda.Event(), torch.cuda.Event()]

    def issue(i: int) -> None:
        with torch.cuda.stream(s):
            if i >= 2:
                s.wait_event(consumed[i % 2])
            bufs[i % 2].copy_(host[i], non_blocking=True)
            copied[i % 2].record(s)

    issue(0)
    for i in range(len(host)):
        if i + 1 < len(host):
            issue(i + 1)
        compute.wait_event(copied[i % 2])
        x = x @ bufs[i % 2]
        consumed[i % 2].record(compute)
    return x


# ---------------------------------------------------------------- one workload


async def run_workload(
    dev: Device, wl: Workload, iters: int, warmup: int, report: dict[str, Any]
) -> None:
    log(f"== {wl.name}: {wl.describe()}")
    results: dict[str, Result] = {}
    variants: dict[str, Result] = {}
    report[wl.name] = {"workload": wl.__dict__, "methods": results, "variants": variants}

    # Weights: made on the GPU (fast), kept in pageable host memory, scaled to keep |x| ~ 1.
    gen_device = "cpu" if dev.sim else "cuda:0"
    torch.manual_seed(0)
    pageable = []
    for _ in range(wl.layers):
        w = torch.randn(wl.n, wl.n, device=gen_device, dtype=torch.bfloat16) * wl.n**-0.5
        pageable.append(w.cpu())
        del w
    x = torch.randn(wl.batch, wl.n, device=dev.name, dtype=torch.bfloat16)
    layer = wl.layer_bytes
    budget = 3 * layer

    async with ResidencyManager(
        budgets={"cuda:0": budget}, backend=backend_for(dev), trace_capacity=1 << 17
    ) as manager:
        # aresidency first: registration copies the weights into pinned host memory and the
        # model's parameters become views of it, which the hand-written methods reuse.
        model = nn.Sequential(*(MatMul(w) for w in pageable))
        streamed: StreamedModule | None = None
        try:
            start = time.perf_counter()
            streamed = stream_module(
                manager, model, "cuda:0", prefetch=2, host="pinned-host", ring=RING
            )
            elapsed = time.perf_counter() - start
            log(f"registered {wl.layers} layers in pinned memory in {elapsed:.1f} s")
            pinned = [layer.weight.detach() for layer in model if isinstance(layer, MatMul)]
        except Exception as error:
            traceback.print_exc()
            results["aresidency"] = Result(error=repr(error))
            pinned = [w.pin_memory() if not dev.sim else w for w in pageable]

        # compute only (also the reference output and the activations' peak)
        reference = None
        activations = 0
        try:
            on_gpu = [w.to(dev.name) for w in pinned]
            dev.sync()
            base = dev.reset_peak()
            with torch.no_grad():
                res = time_sync(dev, lambda: compute_only(x, on_gpu), iters, warmup)
                reference = compute_only(x, on_gpu)
            peak = dev.peak_since(base)
            activations = peak or 0
            res.extra["activations_bytes"] = activations
            results["compute"] = res
            on_gpu.clear()
        except Exception as error:
            traceback.print_exc()
            results["compute"] = Result(error=repr(error))
        log(f"compute only: {results['compute'].cell()} ms")
        gc.collect()

        bufs = [torch.empty(wl.n, wl.n, device=dev.name, dtype=torch.bfloat16) for _ in range(2)]
        copy_stream = dev.stream()
        for name, fn in (
            ("copies", lambda: copies_only(dev, pinned, bufs, copy_stream)),
            ("serial", lambda: serial(x, pinned, bufs[0])),
            ("double buffer", lambda: double_buffer(dev, x, pinned, bufs, copy_stream)),
        ):
            try:
                with torch.no_grad():
                    results[name] = time_sync(dev, fn, iters, warmup)
                if name == "double buffer" and reference is not None:
                    with torch.no_grad():
                        out = fn()
                    dev.sync()
                    exact = isinstance(out, torch.Tensor) and torch.equal(out, reference)
                    results[name].extra["bit_exact"] = exact
            except Exception as error:
                traceback.print_exc()
                results[name] = Result(error=repr(error))
            log(f"{name}: {results[name].cell()} ms")
        if "copies" in results and results["copies"].ms:
            gbps = wl.layers * layer / (results["copies"].ms / 1e3) / 1e9
            results["copies"].extra["GB/s"] = round(gbps, 1)

        async def measure(name: str, sm: StreamedModule, budget_bytes: int) -> Result:
            manager.set_budget("cuda:0", budget_bytes)
            ledger = LedgerWatch(manager)
            base = dev.reset_peak()
            with torch.no_grad():
                res, out = await time_async(dev, lambda: sm(x), sm.drain, iters, warmup)
            peak = dev.peak_since(base)
            ledger_peak = ledger.peak()
            res.extra.update(
                budget_bytes=budget_bytes,
                peak_bytes=peak,
                activations_bytes=activations,
                within_budget_plus_activations=None
                if peak is None
                else peak <= budget_bytes + activations,
                ledger_peak_bytes=ledger_peak,
                ledger_within_budget=ledger_peak <= budget_bytes,
                bit_exact=None if reference is None else bool(torch.equal(out, reference)),
            )
            log(
                f"{name}: {res.cell()} ms, peak {(peak or 0) / MiB:.0f} MiB above base "
                f"(budget {budget_bytes / MiB:.0f} + activations {activations / MiB:.0f} MiB), "
                f"ledger peak {ledger_peak / MiB:.0f} MiB, bit-exact {res.extra['bit_exact']}"
            )
            return res

        if streamed is not None:
            try:
                results["aresidency"] = await measure("aresidency", streamed, budget)
            except Exception as error:
                traceback.print_exc()
                results["aresidency"] = Result(error=repr(error))
            if results["aresidency"].ms is not None:
                try:
                    report[wl.name]["paired"] = await paired(
                        dev,
                        lambda: streamed(x),
                        streamed.drain,
                        lambda: double_buffer(dev, x, pinned, bufs, copy_stream),
                        max(iters, 15),
                    )
                    log(f"paired: {report[wl.name]['paired']}")
                except Exception:
                    traceback.print_exc()
        bufs.clear()
        gc.collect()

        if wl.variants and streamed is not None:
            for depth in (1, 3):
                if time.perf_counter() - T0 > TIME_LIMIT_S:
                    break
                name = f"pinned, prefetch={depth}, budget {depth + 1} layers"
                try:
                    streamed.prefetch = depth
                    variants[name] = await measure(name, streamed, (depth + 1) * layer)
                except Exception as error:
                    traceback.print_exc()
                    variants[name] = Result(error=repr(error))
            streamed.prefetch = 2
        if streamed is not None:
            await streamed.aclose()  # the model gets its own (pageable) tensors back
        pinned, model = [], nn.Sequential()
        gc.collect()

        if wl.variants and time.perf_counter() - T0 < TIME_LIMIT_S:
            name = "pageable-host, prefetch=2, budget 3 layers"
            try:
                model_pg = nn.Sequential(*(MatMul(w) for w in pageable))
                sm = stream_module(manager, model_pg, "cuda:0", prefetch=2, host="pageable-host")
                variants[name] = await measure(name, sm, budget)
                await sm.aclose()
                del sm, model_pg
            except Exception as error:
                traceback.print_exc()
                variants[name] = Result(error=repr(error))
            gc.collect()

        if wl.variants and time.perf_counter() - T0 < TIME_LIMIT_S:
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(prefix="bench_stream_") as tmp:
                path = Path(tmp) / "layers.safetensors"
                name = "checkpoint"
                try:
                    start = time.perf_counter()
                    save_file({f"{i}.weight": w for i, w in enumerate(pageable)}, str(path))
                    log(f"checkpoint written in {time.perf_counter() - start:.1f} s")
                    with torch.device("meta"):
                        skeleton = nn.Sequential(
                            *(
                                MatMul(torch.empty(wl.n, wl.n, dtype=torch.bfloat16))
                                for _ in range(wl.layers)
                            )
                        )
                    for depth in (2, 5):
                        if time.perf_counter() - T0 > TIME_LIMIT_S:
                            break
                        name = f"checkpoint, prefetch={depth}, budget {depth + 1} layers"
                        sm = stream_module(manager, skeleton, prefetch=depth, checkpoint=path)
                        variants[name] = await measure(name, sm, (depth + 1) * layer)
                        await sm.aclose()
                        del sm
                except Exception as error:
                    traceback.print_exc()
                    variants[name] = Result(error=repr(error))

    # accelerate's cpu_offload last: it rewrites the model it is given.
    if time.perf_counter() - T0 < TIME_LIMIT_S + 20:
        try:
            from accelerate import cpu_offload

            offloaded = nn.Sequential(*(MatMul(w.clone()) for w in pageable))
            cpu_offload(offloaded, execution_device=torch.device(dev.name))
            with torch.no_grad():
                res = time_sync(dev, lambda: offloaded(x), max(2, iters // 3), 1)
                if reference is not None:
                    res.extra["bit_exact"] = bool(torch.equal(offloaded(x), reference))
            results["cpu_offload"] = res
            del offloaded
        except ImportError:
            results["cpu_offload"] = Result(error="accelerate is not installed")
        except Exception as error:
            traceback.print_exc()
            results["cpu_offload"] = Result(error=repr(error))
        log(f"cpu_offload: {results['cpu_offload'].cell()} ms")
    pageable.clear()
    gc.collect()
    if not dev.sim:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- Llama-shaped decoders


@dataclass
class LlamaWorkload:
    """A ``LlamaForCausalLM`` from a ``LlamaConfig`` (random weights, bf16): embedding,
    ``layers`` decoder layers (attention + MLP), norm and head."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    prompt: int  # prefill tokens (batch 1)

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=max(2048, 2 * self.prompt),
        )


def build_llama(wl: LlamaWorkload, device: str) -> nn.Module:
    """The model with random weights, made on ``device`` (fast on the GPU), then kept in
    pageable host memory, in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model: nn.Module = LlamaForCausalLM(wl.config())
    model = model.to(torch.bfloat16)
    return model.to("cpu").eval()


class HandDoubleBuffer:
    """The hand-written baseline over a decoder's layers: each layer's weights packed into one
    pinned host buffer, two device buffers, copies on a side stream, events both ways (the
    copy into a buffer waits for the compute that read it; the compute waits for its copy);
    forward hooks point the layer's parameters into the device buffer. The rest of the model
    (embedding, norm, head, rotary buffers) stays on the device."""

    def __init__(self, dev: Device, model: nn.Module) -> None:
        self.dev = dev
        self.model = model
        self.layers: list[nn.Module] = list(cast_any(model).model.layers)
        self.params = [list(layer.parameters()) for layer in self.layers]
        sizes = [sum(p.numel() * p.element_size() for p in ps) for ps in self.params]
        self.nbytes = max(sizes)
        self.host: list[torch.Tensor] = []
        for params in self.params:
            flat = torch.empty(sum(p.numel() * p.element_size() for p in params), dtype=torch.uint8)
            flat = flat if dev.sim else flat.pin_memory()
            offset = 0
            for p in params:
                n = p.numel() * p.element_size()
                flat[offset : offset + n].copy_(p.detach().reshape(-1).view(torch.uint8))
                offset += n
            self.host.append(flat)
        self.shapes = [[(p, p.shape) for p in ps] for ps in self.params]
        for layer in self.layers:  # the layers' own weights go: the host copies hold them
            for p in layer.parameters():
                p.data = torch.empty(0, dtype=p.dtype)
        model.to(dev.name)  # the rest of the model on the device
        self.bufs = [torch.empty(self.nbytes, dtype=torch.uint8, device=dev.name) for _ in (0, 1)]
        self.stream = dev.stream()
        self.copied = [dev.event(), dev.event()]
        self.consumed = [dev.event(), dev.event()]
        self.hooks = []
        for i, layer in enumerate(self.layers):
            self.hooks.append(layer.register_forward_pre_hook(self._pre(i)))
            self.hooks.append(layer.register_forward_hook(self._post(i)))
        self.started = False

    def issue(self, i: int) -> None:
        if i >= len(self.layers):
            return
        buf = self.bufs[i % 2]
        src = self.host[i]
        if self.dev.sim:
            buf[: src.numel()].copy_(src)
            return
        with torch.cuda.stream(self.stream):
            if self.started or i >= 2:
                self.stream.wait_event(self.consumed[i % 2])
            buf[: src.numel()].copy_(src, non_blocking=True)
            self.copied[i % 2].record(self.stream)

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if i == 0:
                self.issue(0)
                self.issue(1)
            if not self.dev.sim:
                torch.cuda.current_stream().wait_event(self.copied[i % 2])
            buf = self.bufs[i % 2]
            offset = 0
            for p, shape in self.shapes[i]:
                n = shape.numel() * p.element_size()
                p.data = buf[offset : offset + n].view(p.dtype).view(shape)
                offset += n

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.dev.sim:
                self.consumed[i % 2].record(torch.cuda.current_stream())
            self.started = True
            self.issue(i + 2)

        return hook

    def copies_only(self) -> None:
        for i in range(len(self.layers)):
            self.issue_plain(i)
        if not self.dev.sim:
            torch.cuda.current_stream().wait_stream(self.stream)

    def issue_plain(self, i: int) -> None:
        src = self.host[i]
        with self.dev.on(self.stream):
            self.bufs[i % 2][: src.numel()].copy_(src, non_blocking=True)


def cast_any(obj: Any) -> Any:
    return obj


def host_cpu_s() -> float:
    """CPU time of the whole process (every thread): the host's cost of a call."""
    return time.process_time()


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds per thread so far, keyed by the Python thread's name (digits dropped, so
    that a pool's threads add up; threads Python did not start are "native"). Linux only
    (``/proc/self/task``); empty elsewhere."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "native")
        name = name.rstrip("0123456789_-").split(" ")[0] or "native"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def thread_cpu_since(before: dict[str, float], calls: int) -> dict[str, float]:
    """ms of CPU per call for each thread group since ``before`` (groups under 0.05 ms left out)."""
    after = thread_cpu_s()
    per = {k: (v - before.get(k, 0.0)) * 1e3 / calls for k, v in after.items()}
    return {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.05}


def cache_of(output: Any) -> Any:
    """The KV cache a forward returned (``past_key_values``, or ``cache`` in newer versions)."""
    cache = getattr(output, "past_key_values", None)
    return cache if cache is not None else output["cache"]


def decode_fns(
    model: Callable[..., Any], ids: torch.Tensor
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Prefill (the whole prompt) and decode (one token on a KV cache of the prompt; the cache
    is cropped back after each call, so every call decodes the same step)."""
    state: dict[str, Any] = {}

    def prefill() -> Any:
        return model(input_ids=ids, use_cache=False).logits

    def decode() -> Any:
        if "cache" not in state:
            state["cache"] = cache_of(model(input_ids=ids, use_cache=True))
        cache = state["cache"]
        out = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits
        cache.crop(-1)  # back to the prompt (negative: tokens to drop, in every version)
        return out

    return prefill, decode


def streamed_fns(
    streamed: StreamedModule, ids: torch.Tensor
) -> tuple[Callable[[], Awaitable[Any]], Callable[[], Awaitable[Any]]]:
    """:func:`decode_fns` for the streamed model (awaitables)."""
    state: dict[str, Any] = {}

    async def prefill() -> Any:
        return (await streamed(input_ids=ids, use_cache=False)).logits

    async def decode() -> Any:
        if "cache" not in state:
            state["cache"] = cache_of(await streamed(input_ids=ids, use_cache=True))
        cache = state["cache"]
        out = await streamed(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
        cache.crop(-1)  # back to the prompt (negative: tokens to drop, in every version)
        return out.logits

    return prefill, decode


async def run_llama(
    dev: Device, wl: LlamaWorkload, iters: int, warmup: int, report: dict[str, Any]
) -> None:
    """Prefill and decode of one Llama-shaped workload by every method (see the docstring)."""
    log(f"== {wl.name}")
    entry: dict[str, Any] = {"workload": wl.__dict__, "prefill": {}, "decode": {}}
    report[wl.name] = entry
    gen = "cpu" if dev.sim else "cuda:0"
    model = build_llama(wl, gen)
    layers = list(cast_any(model).model.layers)
    layer_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    entry["layer_bytes"] = layer_bytes
    entry["layers"] = wl.layers
    entry["model_bytes"] = total
    log(f"{wl.layers} layers of {layer_bytes / MiB:.1f} MiB, model {total / MiB:.0f} MiB")
    ids = torch.randint(3, wl.vocab, (1, wl.prompt), device=dev.name)

    def fresh() -> nn.Module:
        """A copy of the model in pageable host memory (each method changes the one it gets)."""
        return copy.deepcopy(model)

    def timed(phase: str, method: str, fn: Callable[[], Any], n: int = iters) -> None:
        try:
            cpu = host_cpu_s()
            threads = thread_cpu_s()
            with torch.no_grad():
                res = time_sync(dev, fn, n, warmup)
            res.extra["host_cpu_ms_per_call"] = (host_cpu_s() - cpu) * 1e3 / (n + warmup)
            res.extra["thread_cpu_ms_per_call"] = thread_cpu_since(threads, n + warmup)
            entry[phase][method] = res
        except Exception as error:
            traceback.print_exc()
            entry[phase][method] = Result(error=repr(error))
        log(f"{phase} {method}: {entry[phase][method].cell()} ms")
        threads_ms = entry[phase][method].extra.get("thread_cpu_ms_per_call")
        if threads_ms:
            log(f"  CPU ms per call by thread: {threads_ms}")

    # compute only: the whole model on the device
    on_dev = fresh().to(dev.name)
    for phase, fn in zip(("prefill", "decode"), decode_fns(on_dev, ids), strict=True):
        timed(phase, "compute", fn)
        with torch.no_grad():
            entry[phase]["_reference"] = fn().float().cpu()
    del on_dev
    gc.collect()

    # copies only and the hand-written double buffer (kept for the alternating rounds below)
    hand: HandDoubleBuffer | None = None
    try:
        hand = HandDoubleBuffer(dev, fresh())
        timed("prefill", "copies", hand.copies_only)
        entry["decode"]["copies"] = entry["prefill"]["copies"]  # the same copies
        for phase, fn in zip(("prefill", "decode"), decode_fns(hand.model, ids), strict=True):
            timed(phase, "double buffer", fn)
    except Exception as error:
        traceback.print_exc()
        hand = None
        for phase in ("prefill", "decode"):
            entry[phase]["double buffer"] = Result(error=repr(error))
    gc.collect()

    # aresidency: budget = the resident tensors + three layers, then half the model
    async with ResidencyManager(backend=backend_for(dev), trace_capacity=1 << 16) as manager:
        streamed = stream_module(manager, fresh(), "cuda:0", prefetch=2, ring=RING)
        budgets = {
            "aresidency": streamed.resident_bytes + 3 * max(streamed.block_bytes),
            "aresidency half": (streamed.resident_bytes + sum(streamed.block_bytes)) // 2,
        }
        for method, budget in budgets.items():
            manager.set_budget("cuda:0", budget)
            for phase, fn in zip(("prefill", "decode"), streamed_fns(streamed, ids), strict=True):
                try:
                    with torch.no_grad():
                        await fn()  # the first call (fills what stays resident)
                        await streamed.drain()
                        samples = []
                        cpu = host_cpu_s()
                        threads = thread_cpu_s()
                        for _ in range(iters):
                            dev.sync()
                            start = time.perf_counter()
                            out = await fn()
                            dev.sync()
                            samples.append(time.perf_counter() - start)
                            await streamed.drain()
                        cpu_ms = (host_cpu_s() - cpu) * 1e3 / iters
                        per_thread = thread_cpu_since(threads, iters)
                    res = Result(median_ms(samples), samples=samples)
                    res.extra.update(
                        budget_bytes=budget,
                        host_cpu_ms_per_call=cpu_ms,
                        host_us_per_layer=cpu_ms * 1e3 / wl.layers,
                        thread_cpu_ms_per_call=per_thread,
                        kept=len(streamed.residency()["kept"]),
                        bit_exact=bool(torch.equal(out.float().cpu(), entry[phase]["_reference"])),
                    )
                    entry[phase][method] = res
                except Exception as error:
                    traceback.print_exc()
                    entry[phase][method] = Result(error=repr(error))
                log(f"{phase} {method}: {entry[phase][method].cell()} ms")
                threads_ms = entry[phase][method].extra.get("thread_cpu_ms_per_call")
                if threads_ms:
                    log(f"  CPU ms per call by thread: {threads_ms}")
            if method == "aresidency" and hand is not None:
                # The same two methods in alternating rounds: this machine's host speed
                # drifts by tens of percent from one minute to the next (the medians above
                # were taken minutes apart); a ratio of neighbours does not drift.
                theirs = decode_fns(hand.model, ids)
                ours = streamed_fns(streamed, ids)
                for phase, our, their in zip(("prefill", "decode"), ours, theirs, strict=True):
                    rounds = 2 if dev.sim else LLAMA_ROUNDS
                    pair = await paired(dev, our, streamed.drain, their, rounds)
                    entry[phase]["paired"] = pair
                    log(f"{phase} alternating rounds: {pair}")
        await streamed.aclose()
    del hand
    gc.collect()

    # accelerate's cpu_offload and diffusers' group offloading, where installed
    skipped = os.environ.get("BENCH_STREAM_SKIP", "").split(",")  # e.g. cpu_offload,diffusers
    for method in ("cpu_offload", "diffusers"):
        if method in skipped:
            continue
        if time.perf_counter() - T0 > TIME_LIMIT_S + 60:
            break
        try:
            other = fresh()
            if method == "cpu_offload":
                from accelerate import cpu_offload

                cpu_offload(other, execution_device=torch.device(dev.name))
            else:
                from diffusers.hooks import (  # type: ignore[import-not-found]
                    apply_group_offloading,
                )

                apply_group_offloading(
                    other,
                    torch.device(dev.name),
                    offload_type="block_level",
                    num_blocks_per_group=1,
                    use_stream=not dev.sim,
                )
        except ImportError as error:
            for phase in ("prefill", "decode"):
                entry[phase][method] = Result(error=f"not installed ({error.name})")
            continue
        except Exception as error:
            traceback.print_exc()
            for phase in ("prefill", "decode"):
                entry[phase][method] = Result(error=repr(error))
            continue
        for phase, fn in zip(("prefill", "decode"), decode_fns(other, ids), strict=True):
            timed(phase, method, fn, max(2, iters // 2))
        del other
        gc.collect()
    for phase in ("prefill", "decode"):
        entry[phase].pop("_reference", None)
    if not dev.sim:
        torch.cuda.empty_cache()


LLAMA_ROUNDS = int(os.environ.get("BENCH_STREAM_ROUNDS", "9"))  # alternating rounds, ours and hand

LLAMA_METHODS = [
    "compute",
    "copies",
    "double buffer",
    "cpu_offload",
    "diffusers",
    "aresidency",
    "aresidency half",
]


def llama_markdown(report: dict[str, Any]) -> str:
    head = [
        "workload",
        "phase",
        *LLAMA_METHODS,
        "ours / double buffer",
        "same, alternating rounds",
        "ours / floor",
        "ours / diffusers",
        "half / max(compute, copies x streamed share)",
        "host us / layer",
        "added host us / layer: ours, double buffer",
    ]
    lines = [
        "Llama-shaped decoders (LlamaForCausalLM, bf16, random weights). Median ms; ours = "
        "aresidency with budget = resident tensors + 3 layers; half = budget of half the model "
        "(second and later calls); floor = max(copies, compute).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, entry in report.items():
        for phase in ("prefill", "decode"):
            res: dict[str, Result] = entry[phase]
            cells = [name, phase, *(res.get(m, Result()).cell() for m in LLAMA_METHODS)]
            ours, half = res.get("aresidency"), res.get("aresidency half")
            copies, compute = res.get("copies"), res.get("compute")
            floor = None
            if copies and compute and copies.ms is not None and compute.ms is not None:
                floor = max(copies.ms, compute.ms)
            half_floor = None
            if half is not None and half.ms is not None and floor is not None and compute:
                share = 0.5  # about half the bytes stream when half the model stays
                assert copies is not None and copies.ms is not None and compute.ms is not None
                half_floor = half.ms / max(compute.ms, share * copies.ms)
            cells += [
                fmt(ratio(ours, res.get("double buffer"))),
                fmt(cast_any(res).get("paired", {}).get("ratio_median")),
                fmt(None if floor is None or ours is None or ours.ms is None else ours.ms / floor),
                fmt(ratio(ours, res.get("diffusers"))),
                fmt(half_floor),
                fmt(None if ours is None else ours.extra.get("host_us_per_layer"), digits=0),
                " , ".join(
                    fmt(added_host_us(res.get(m), compute, entry.get("layers")), digits=0)
                    for m in ("aresidency", "double buffer")
                ),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def added_host_us(method: Result | None, compute: Result | None, layers: Any) -> float | None:
    """Process CPU per layer a method adds to the forward's own (the model run all on the
    device, measured the same way): the host cost of streaming, which the goal bounds."""
    if method is None or compute is None or not layers:
        return None
    ours = method.extra.get("host_cpu_ms_per_call")
    base = compute.extra.get("host_cpu_ms_per_call")
    if ours is None or base is None:
        return None
    return (float(ours) - float(base)) * 1e3 / int(layers)


RING: bool | None = None  # --no-ring: stream through managed values, block by block
WAITER = "auto"  # --waiter: how the CUDA backend learns that events completed
LOOP_POLL_US: float | None = None  # --loop-poll-us: the waiter's loop polling (0: none)


def backend_for(dev: Device) -> Any:
    """The manager's backend: the simulation, or CUDA with the waiter ``--waiter`` and
    ``--loop-poll-us`` chose."""
    if dev.sim:
        return "sim"
    if WAITER == "auto" and LOOP_POLL_US is None:
        return "cuda"
    from aresidency.backends import CudaBackend
    from aresidency.backends.waiter import EventWaiter

    waiter = EventWaiter(
        WAITER, **({} if LOOP_POLL_US is None else {"loop_poll_s": LOOP_POLL_US * 1e-6})
    )
    return CudaBackend(waiter=waiter)


def llama_workloads(sim: bool) -> list[LlamaWorkload]:
    if sim:
        return [
            LlamaWorkload("llama-tiny-a", 6, 64, 128, 4, 2, 96, 16),
            LlamaWorkload("llama-tiny-b", 4, 128, 256, 4, 2, 96, 16),
        ]
    chosen = os.environ.get("BENCH_STREAM_WORKLOADS")  # a comma-separated subset, by name
    return [
        wl
        for wl in [
            # about 6.5, 24.5 and 416 MiB per decoder layer (bf16)
            LlamaWorkload("llama-6MiB", 96, 512, 1536, 8, 8, 32000, 512),
            LlamaWorkload("llama-25MiB", 48, 1024, 2816, 16, 16, 32000, 512),
            LlamaWorkload("llama-400MiB", 12, 4096, 14336, 32, 8, 32000, 512),
        ]
        if chosen is None or wl.name in chosen.split(",")
    ]


# ---------------------------------------------------------------- report


def ratio(a: Result | None, b: Result | None) -> float | None:
    if a is None or b is None or a.ms is None or b.ms is None or b.ms == 0:
        return None
    return a.ms / b.ms


def fmt(value: float | None, suffix: str = "", digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(report: dict[str, Any], env: str) -> str:
    lines = [
        f"Weight streaming, {env}. Median ms; docs/performance.md's figures in brackets "
        "(anchor workload).",
        "",
    ]
    head = [
        "workload",
        *METHODS,
        "floor = max(copies, compute)",
        "aresidency / floor",
        "aresidency / double buffer",
        "cpu_offload / aresidency",
    ]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    goals: list[str] = []
    for name, entry in report.items():
        res: dict[str, Result] = entry["methods"]
        cells = [name]
        for method in METHODS:
            cell = res.get(method, Result()).cell()
            if name == "anchor" and method in REFERENCE_MS:
                cell += f" [{REFERENCE_MS[method]}]"
            cells.append(cell)
        copies, compute = res.get("copies"), res.get("compute")
        floor = None
        if copies and compute and copies.ms is not None and compute.ms is not None:
            floor = max(copies.ms, compute.ms)
        ours = res.get("aresidency")
        to_floor = None if floor is None or ours is None or ours.ms is None else ours.ms / floor
        # aresidency against double buffering: from the alternating rounds when measured
        # (drift between the two separate measurements is often larger than the difference)
        pair = entry.get("paired")
        to_dbuf = pair["ratio_median"] if pair else ratio(ours, res.get("double buffer"))
        offload = ratio(res.get("cpu_offload"), ours)
        cells += [fmt(floor, digits=1), fmt(to_floor), fmt(to_dbuf), fmt(offload, "x", 1)]
        lines.append("| " + " | ".join(cells) + " |")
        reachable = ""
        offload_floor = None if floor is None else ratio(res.get("cpu_offload"), Result(floor))
        if offload_floor is not None and offload_floor < 7:
            reachable = (
                f"; out of reach for any method here: cpu_offload / floor {offload_floor:.1f}x"
            )
        paired_note = (
            f" [alternating rounds: {pair['aresidency_ms']} vs {pair['double_buffer_ms']} ms, "
            f"median of {pair['rounds']} per-round ratios]"
            if pair
            else ""
        )
        goals.append(
            f"- {name}: aresidency / floor {fmt(to_floor)} (goal <= 1.05: "
            f"{'PASS' if to_floor is not None and to_floor <= 1.05 else 'FAIL'}); "
            f"/ double buffer {fmt(to_dbuf)}{paired_note} (goal <= 1.00: "
            f"{'PASS' if to_dbuf is not None and to_dbuf <= 1.0 else 'FAIL'}); "
            f"cpu_offload / aresidency {fmt(offload, 'x', 1)} (goal >= 7x: "
            f"{'PASS' if offload is not None and offload >= 7 else 'FAIL'}{reachable})"
        )
    lines += ["", "Goals:", *goals, ""]
    lines.append(
        "| workload | aresidency variant | ms | / floor | weights GB/s | peak above base MiB | "
        "budget + activations MiB | within | ledger peak MiB | ledger <= budget | bit-exact |"
    )
    lines.append("|" + "---|" * 11)
    for name, entry in report.items():
        res = entry["methods"]
        copies, compute = res.get("copies"), res.get("compute")
        floor = None
        if copies and compute and copies.ms is not None and compute.ms is not None:
            floor = max(copies.ms, compute.ms)
        wl = entry["workload"]
        total = wl["layers"] * wl["n"] * wl["n"] * 2
        rows = {"pinned, prefetch=2, budget 3 layers": res.get("aresidency", Result())}
        rows.update(entry["variants"])
        for variant, r in rows.items():
            ex = r.extra
            peak = ex.get("peak_bytes")
            limit = ex.get("budget_bytes", 0) + ex.get("activations_bytes", 0)
            gbps = None if r.ms is None else total / (r.ms / 1e3) / 1e9
            lines.append(
                "| "
                + " | ".join(
                    [
                        name,
                        variant,
                        r.cell(),
                        fmt(None if floor is None or r.ms is None else r.ms / floor),
                        fmt(gbps, digits=1),
                        fmt(None if peak is None else peak / MiB, digits=0),
                        fmt(limit / MiB if limit else None, digits=0),
                        str(ex.get("within_budget_plus_activations", "n/a")),
                        fmt(ex.get("ledger_peak_bytes", 0) / MiB, digits=0),
                        str(ex.get("ledger_within_budget", "n/a")),
                        str(ex.get("bit_exact", "n/a")),
                    ]
                )
                + " |"
            )
    return "\n".join(lines)


def environment(dev: Device) -> str:
    parts = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    if not dev.sim:
        parts.insert(0, torch.cuda.get_device_name(0))
    else:
        parts.insert(0, "SIMULATED backend on the CPU (smoke test, not a measurement)")
    try:
        import accelerate

        parts.append(f"accelerate {accelerate.__version__}")
    except ImportError:
        parts.append("no accelerate")
    return ", ".join(parts)


async def main(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    dev = Device(sim=args.sim or args.backend == "sim" or not torch.cuda.is_available())
    if dev.sim and not args.sim:
        print("no CUDA device: running the --sim smoke test instead", flush=True)
    if dev.sim:
        workloads = [
            Workload("anchor", 4, 256, 64, variants=True),
            Workload("copy-bound", 4, 256, 16),
            Workload("compute-bound", 4, 128, 256),
        ]
    else:
        workloads = [
            Workload("anchor", 16, 8192, 8192, variants=True),
            Workload("copy-bound", 16, 8192, 1024),
            Workload("compute-bound", 16, 4096, 32768),
        ]
    iters, warmup = (3, 1) if args.quick else (7, 2)
    env = environment(dev)
    log(env)
    report: dict[str, Any] = {}
    for wl in workloads if args.only in (None, "matmul") else []:
        try:
            await run_workload(dev, wl, iters, warmup, report)
        except Exception:
            traceback.print_exc()
            log(f"workload {wl.name} failed; continuing")
    llama: dict[str, Any] = {}
    for lw in llama_workloads(dev.sim) if args.only in (None, "llama") else []:
        try:
            await run_llama(dev, lw, iters, warmup, llama)
        except Exception:
            traceback.print_exc()
            log(f"workload {lw.name} failed; continuing")
    text = markdown(report, env) if report else f"Weight streaming, {env}."
    if llama:
        text += "\n\n" + llama_markdown(llama)
    print("\n" + text, flush=True)

    def plain(obj: Any) -> Any:
        if isinstance(obj, Result):
            return {"ms": obj.ms, "error": obj.error, "samples_s": obj.samples, **obj.extra}
        if isinstance(obj, dict):
            return {k: plain(v) for k, v in obj.items()}
        return obj

    return text, {"env": env, **plain(report), "llama": plain(llama)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--sim", action="store_true", help="tiny smoke test, no GPU needed")
    parser.add_argument(
        "--backend", choices=["cuda", "sim"], default="cuda", help="sim: the same as --sim"
    )
    parser.add_argument("--only", choices=["matmul", "llama"], help="run one part only")
    parser.add_argument(
        "--waiter",
        default="auto",
        choices=["auto", "hybrid", "hostfunc", "poll", "blocking"],
        help="the CUDA backend's event waiter (its polling threads share the interpreter "
        "with the thread that runs a streamed model's forward)",
    )
    parser.add_argument(
        "--loop-poll-us",
        type=float,
        help="events expected within this many us are polled on the event loop (0: never)",
    )
    parser.add_argument(
        "--no-ring",
        action="store_true",
        help="stream pinned weights through managed values block by block (ring=False), "
        "as before the ring",
    )
    parser.add_argument(
        "--switch-interval-us",
        type=float,
        help="sys.setswitchinterval for the whole run (how long a thread that wants the GIL "
        "waits before asking its holder to drop it; Python's default is 5000 us)",
    )
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--markdown", help="write the markdown tables to this path")
    arguments = parser.parse_args()
    WAITER = arguments.waiter
    LOOP_POLL_US = arguments.loop_poll_us
    RING = False if arguments.no_ring else None
    if arguments.switch_interval_us is not None:
        sys.setswitchinterval(arguments.switch_interval_us * 1e-6)
    text, data = asyncio.run(main(arguments))
    if arguments.markdown:
        Path(arguments.markdown).write_text(text + "\n")
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(data, indent=1, default=str))
    log("done")
