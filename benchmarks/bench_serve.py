"""Serving more models than the GPU holds, over real HTTP: ``ModelPool`` against the usual ways.

N Llama-shaped models (``LlamaForCausalLM`` from a ``LlamaConfig``, random weights, bf16 on a
GPU; full size: 8 models of about 1.5 GB), a GPU budget that holds about three of them, and
Zipf-distributed requests (prefill of a few hundred tokens, a few greedy decode steps) from 32
concurrent clients over HTTP (httpx) to a uvicorn server started in this process (in a thread
of its own, on a free port). Side by side in one run, each server in turn:

* ``aresidency``: ``examples/server_app.py`` (a ``ModelPool``: resident by demand, streamed
  when a model cannot fit, evictions decided by the controller, requests admitted first come
  first served);
* ``aresidency-strict`` (only when asked for): the same with ``express_joins=False``, strict
  first come, first served (no request joins its model past the head of the line);
* ``aresidency-shared`` (only when asked for): the same with ``shared_calls=True``: the calls
  on a resident model run at the same time, each in a worker thread;
* ``aresidency-onethread`` (only when asked for): the same with ``one_thread=True``: the calls
  on every resident model run in one thread, one after the other;
* ``aresidency-pipeline`` (only when asked for): the same with ``direct_calls=False``: every
  call goes through the streaming pipeline (a lease per block), as before direct calls;
* ``swap (ollama)``: whole-model swapping under a lock, the Ollama way: ``.to("cuda")`` the
  requested model, move the least recently used out (``.to("cpu")``) while over budget;
  requests run one at a time in a worker thread;
* ``cpu_offload``: accelerate's ``cpu_offload`` per model (weights stay in host memory and are
  copied in at every forward); skipped, with a note, when accelerate is not installed;
* ``all resident``: every model on the GPU with no budget (the upper bound), only when they
  all fit the GPU.

Reported per method: requests, throughput (requests/s), p50/p99 latency, failed requests (must
be 0), the ledger peak against the budget (aresidency: the manager's ``cuda:0`` peak; swap:
the bytes of the models it had on the GPU), GPU ``max_memory_allocated`` at the start and end
of the run, host RSS at the start, end and its maximum (memory over time is in the JSON), the
process's CPU time per second over the measured window (all threads, the clients' too: near 1
core, the interpreter lock sets the pace), and for aresidency the pool's per-model
statistics. The goals of the issue are printed beside the measurements: throughput >= 2x swap
and >= 5x cpu_offload, p99 <= 0.5x swap, within 1.5x of all-resident when the hot set fits.

usage: python benchmarks/bench_serve.py [--backend auto|cuda|sim] [--quick] [--seconds 30]
           [--warmup 5] [--tail 10] [--clients 32] [--models 8] [--zipf 1.1]
           [--methods aresidency,swap,...] [--no-defer] [--strict-fifo] [--json PATH]
           [--markdown PATH]

``--quick`` uses tiny models and a short run; ``--backend sim`` runs aresidency on the
simulated backend (a simulation of CUDA devices in host memory) and the other methods on the
CPU: a smoke test of this script, not a measurement. The issue's 10-minute stability run is
``--seconds 600`` (memory over time shows a leak as a slope). The default full run (four
methods, each 5 s of warm-up, 30 s measured and at most 10 s for the requests in flight at the
end, plus building the models and starting each server) takes about three to four minutes.
Throughput counts the requests answered within the measured window; the latencies are those of
every request started in it (those that end in the tail too); a request still unanswered at the
end of the tail is cancelled and reported as unfinished, not failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aresidency.core.sizes import format_nbytes, parse_nbytes  # noqa: E402

HOT_SHARE = 0.7  # the hot set: the models that carry this share of the requests
T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {message}", flush=True)


def load_example() -> ModuleType:
    path = ROOT / "examples" / "server_app.py"
    spec = importlib.util.spec_from_file_location("server_app", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["server_app"] = module
    spec.loader.exec_module(module)
    return module


example = load_example()
ModelSpec = example.ModelSpec


# ---------------------------------------------------------------------------- workload


@dataclass
class Workload:
    specs: list[Any]
    budget: int
    prompt_len: int
    new_tokens: int
    clients: int
    seconds: float
    warmup: float
    tail: float  # seconds the requests in flight at the end may take before they are dropped
    zipf: float
    seed: int
    device: str  # where the baselines compute: "cuda:0", or "cpu" with the simulation
    backend: str  # the manager's backend for aresidency
    dtype: torch.dtype
    defer: bool = True
    express: bool = True

    def weights(self) -> list[float]:
        return [1.0 / (rank + 1) ** self.zipf for rank in range(len(self.specs))]

    def hot_set(self) -> int:
        """How many models (the most asked for) carry 70% of the requests."""
        weights = self.weights()
        total, share, count = sum(weights), 0.0, 0
        for weight in weights:
            share += weight / total
            count += 1
            if share >= HOT_SHARE:
                break
        return count

    def hot_set_fits(self, model_bytes: int) -> bool:
        return self.hot_set() * model_bytes <= self.budget


def full_specs(count: int) -> list[Any]:
    # 14 layers of hidden 2048 / intermediate 5504 and a 32000-token vocabulary: 751 M
    # parameters, about 1.5 GB in bf16 (TinyLlama's shape, a little shallower).
    return [
        ModelSpec(
            f"llama-{i}",
            layers=14,
            hidden=2048,
            intermediate=5504,
            heads=16,
            kv_heads=4,
            vocab=32000,
            seed=i,
            prefetch=2,
        )
        for i in range(count)
    ]


def quick_specs(count: int) -> list[Any]:
    return [
        ModelSpec(f"llama-{i}", layers=4, hidden=64, intermediate=128, seed=i) for i in range(count)
    ]


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


# ---------------------------------------------------------------------------- measuring


def host_rss() -> int:
    """This process's resident set (bytes), from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096
    except OSError:
        return 0


def gpu_allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def gpu_max_allocated() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


@dataclass
class Result:
    method: str
    requests: int = 0  # started after the warm-up and answered (ok or not)
    completed: int = 0  # of those, answered with 200 before the measured window ended
    unfinished: int = 0  # started after the warm-up, still unanswered ``tail`` s after the end
    failed: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ledger_peak: int | None = None
    budget: int | None = None
    gpu_max_start: int = 0
    gpu_max_end: int = 0
    rss_start: int = 0
    rss_end: int = 0
    rss_max: int = 0
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # t, rss, gpu
    # the process's CPU time over the measured seconds, all threads (server and clients):
    # about 1 core means the interpreter lock sets the pace
    cpu_cores: float | None = None
    modes: dict[str, int] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def throughput(self) -> float:
        """Requests answered within the measured window, per second of it (requests in
        flight when it ends count in the latencies, not here)."""
        return self.completed / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "skipped": self.skipped,
            "requests": self.requests,
            "completed_in_window": self.completed,
            "unfinished": self.unfinished,
            "failed": self.failed,
            "seconds": self.seconds,
            "throughput_rps": self.throughput,
            "p50_s": self.percentile(0.5),
            "p99_s": self.percentile(0.99),
            "mean_s": statistics.fmean(self.latencies) if self.latencies else None,
            "errors": self.errors[:10],
            "ledger_peak_bytes": self.ledger_peak,
            "budget_bytes": self.budget,
            "gpu_max_allocated_start": self.gpu_max_start,
            "gpu_max_allocated_end": self.gpu_max_end,
            "rss_start": self.rss_start,
            "rss_end": self.rss_end,
            "rss_max": self.rss_max,
            "memory_over_time": self.samples,
            "cpu_cores": self.cpu_cores,
            "modes": self.modes,
            "server": self.server,
        }


# ---------------------------------------------------------------------------- baselines


def greedy_sync(module: nn.Module, prompt: torch.Tensor, steps: int) -> list[int]:
    """Prefill and ``steps`` greedy steps with the KV cache, in the calling thread."""
    key = example.cache_keyword(module)
    with torch.inference_mode():
        out = module(prompt, use_cache=True, logits_to_keep=1)
        tokens = [out.logits[:, -1:].argmax(-1)]
        for _ in range(steps):
            cache = example.returned_cache(out)
            out = module(tokens[-1], use_cache=True, logits_to_keep=1, **{key: cache})
            tokens.append(out.logits[:, -1:].argmax(-1))
        return [int(t) for t in torch.cat(tokens, dim=1)[0].tolist()]


class Engine:
    """A baseline: runs one request at a time in a worker thread (under ``lock``)."""

    name = "?"

    def __init__(self, models: dict[str, nn.Module], device: str) -> None:
        self.models = models
        self.device = device
        self.lock = threading.Lock()
        self.peak = 0
        self.closing = False  # set when the clients are done: queued requests end at once

    def prepare(self) -> None: ...

    def module_for(self, name: str) -> nn.Module:
        return self.models[name]

    def generate(self, name: str, prompt: list[int], steps: int) -> list[int]:
        with self.lock:
            if self.closing:  # its client gave up (the run's tail ended): do not run it
                raise RuntimeError("the benchmark run is over")
            module = self.module_for(name)
            ids = torch.tensor([prompt], device=self.device)
            return greedy_sync(module, ids, steps)

    def finish(self) -> None: ...

    def info(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak}


class SwapEngine(Engine):
    """Whole-model swapping, the Ollama way: the requested model is moved to the GPU with
    ``.to()``; the least recently used ones go back to the host while over budget."""

    name = "swap (ollama)"

    def __init__(self, models: dict[str, nn.Module], device: str, budget: int) -> None:
        super().__init__(models, device)
        self.budget = budget
        self.loaded: list[str] = []  # least recently used first
        self.sizes = {name: module_bytes(m) for name, m in models.items()}
        self.swaps = 0

    def module_for(self, name: str) -> nn.Module:
        if name in self.loaded:
            self.loaded.remove(name)
        else:
            while self.loaded and sum(self.sizes[n] for n in self.loaded) + self.sizes[name] > (
                self.budget
            ):
                victim = self.loaded.pop(0)
                self.models[victim].to("cpu")
            self.models[name].to(self.device)
            self.swaps += 1
        self.loaded.append(name)
        self.peak = max(self.peak, sum(self.sizes[n] for n in self.loaded))
        return self.models[name]

    def finish(self) -> None:
        for name in self.loaded:
            self.models[name].to("cpu")
        self.loaded.clear()

    def info(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak, "swaps": self.swaps}


class ResidentEngine(Engine):
    """Every model on the GPU, no budget: the upper bound."""

    name = "all resident"

    def prepare(self) -> None:
        for module in self.models.values():
            module.to(self.device)
        self.peak = sum(module_bytes(m) for m in self.models.values())

    def finish(self) -> None:
        for module in self.models.values():
            module.to("cpu")


class OffloadEngine(Engine):
    """accelerate's ``cpu_offload`` on every model: weights in host memory, copied to the GPU
    at every forward. Runs last (it leaves the modules' parameters on the meta device)."""

    name = "cpu_offload"

    def prepare(self) -> None:
        from accelerate import cpu_offload  # type: ignore[import-not-found, unused-ignore]

        for module in self.models.values():
            cpu_offload(module, execution_device=torch.device(self.device))


def engine_app(engine: Engine) -> Any:
    from fastapi import FastAPI

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(engine.prepare)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.finish)

    app = FastAPI(lifespan=lifespan)

    @app.post("/generate/{name}")
    async def generate(
        name: str,
        body: example.GenerateBody,  # type: ignore[name-defined]  # loaded from its file
    ) -> dict[str, Any]:
        assert body.tokens is not None
        tokens = await asyncio.to_thread(engine.generate, name, body.tokens, body.max_new_tokens)
        return {"model": name, "mode": engine.name, "tokens": tokens}

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return engine.info()

    return app


# ---------------------------------------------------------------------------- serving


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """A uvicorn server in a thread of its own (its own event loop), on a free port."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="bench-server", daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 1800  # building large models takes a while
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread ended before it started (see above)")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(600)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def drive(workload: Workload, url: str, result: Result) -> None:
    """32 (``clients``) concurrent clients over HTTP for ``warmup + seconds``; only requests
    that start after the warm-up count. Requests in flight at the end get ``tail`` more
    seconds (their latencies count); those still unanswered then are cancelled (the client
    disconnects) and counted as unfinished, so a slow method cannot stretch the run."""
    import httpx

    names = [spec.name for spec in workload.specs]
    weights = workload.weights()
    vocab = workload.specs[0].vocab
    start = time.perf_counter()
    measure_from = start + workload.warmup
    stop = measure_from + workload.seconds
    limits = httpx.Limits(
        max_connections=workload.clients, max_keepalive_connections=workload.clients
    )
    timeout = httpx.Timeout(max(600.0, 4 * workload.seconds))

    async def client(index: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(workload.seed * 1000 + index)
        while time.perf_counter() < stop:
            name = rng.choices(names, weights)[0]
            prompt = [rng.randrange(vocab) for _ in range(workload.prompt_len)]
            body = {"tokens": prompt, "max_new_tokens": workload.new_tokens}
            began = time.perf_counter()
            try:
                try:
                    answer = await http.post(f"/generate/{name}", json=body)
                except asyncio.CancelledError:
                    if began >= measure_from:
                        result.unfinished += 1
                    raise
                ok = answer.status_code == 200
                detail = "" if ok else f"{answer.status_code}: {answer.text[:200]}"
                mode = answer.json().get("mode", "?") if ok else None
            except Exception as error:  # counted as a failure
                ok, detail, mode = False, f"{type(error).__name__}: {error}", None
            ended = time.perf_counter()
            if began < measure_from:
                continue
            result.requests += 1
            if ok:
                result.latencies.append(ended - began)
                if ended <= stop:
                    result.completed += 1
                if mode is not None:
                    result.modes[mode] = result.modes.get(mode, 0) + 1
            else:
                result.failed += 1
                result.errors.append(detail)

    async def cpu_window() -> None:
        await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.sleep(max(0.0, stop - time.perf_counter()))
        result.cpu_cores = (time.process_time() - cpu) / max(1e-9, time.perf_counter() - wall)

    async def sample() -> None:
        while True:
            rss = host_rss()
            result.rss_max = max(result.rss_max, rss)
            result.samples.append((round(time.perf_counter() - start, 3), rss, gpu_allocated()))
            await asyncio.sleep(1.0)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        sampler = asyncio.ensure_future(sample())
        cpu = asyncio.ensure_future(cpu_window())
        clients = [asyncio.ensure_future(client(i, http)) for i in range(workload.clients)]
        _, late = await asyncio.wait(clients, timeout=stop + workload.tail - time.perf_counter())
        for task in (*late, sampler, cpu):
            task.cancel()
        await asyncio.gather(*late, sampler, cpu, return_exceptions=True)
        for task in clients:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    result.seconds = max(1e-9, min(time.perf_counter(), stop) - measure_from)


def run_method(
    method: str,
    workload: Workload,
    make_app: Callable[[], Any],
    after: Callable[[str], None],
    stopping: Callable[[], None] = lambda: None,
) -> Result:
    result = Result(method)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    result.rss_start = host_rss()
    log(f"{method}: starting the server")
    with Server(make_app()) as server:
        result.gpu_max_start = gpu_max_allocated()
        log(f"{method}: {workload.clients} clients for {workload.warmup:g}+{workload.seconds:g} s")
        asyncio.run(drive(workload, server.url, result))
        stopping()
        after(server.url)
    result.gpu_max_end = gpu_max_allocated()
    result.rss_end = host_rss()
    log(
        f"{method}: {result.requests} requests, {result.throughput:.2f} req/s, "
        f"p50 {result.percentile(0.5) * 1e3:.0f} ms, p99 {result.percentile(0.99) * 1e3:.0f} ms, "
        f"{result.failed} failed"
        + ("" if result.cpu_cores is None else f", host CPU {result.cpu_cores:.2f} cores")
    )
    for error in sorted(set(result.errors))[:5]:  # what failed, each kind once
        log(f"{method}: failed: {error}")
    return result


def fetch_json(url: str) -> Any:
    import httpx

    return httpx.get(url, timeout=60).json()


# ---------------------------------------------------------------------------- report


def markdown(workload: Workload, results: Sequence[Result], model_bytes: int) -> str:
    def ms(seconds: float) -> str:
        return "-" if seconds != seconds else f"{seconds * 1e3:.0f}"

    lines = [
        f"{len(workload.specs)} models of {format_nbytes(model_bytes)}, budget "
        f"{format_nbytes(workload.budget)} ({workload.budget / model_bytes:.1f} models), "
        f"Zipf s={workload.zipf}, {workload.clients} clients, prompt {workload.prompt_len} "
        f"tokens + {workload.new_tokens} decode steps, {workload.seconds:g} s measured "
        f"after {workload.warmup:g} s of warm-up, backend {workload.backend}"
        + ("" if workload.backend != "sim" else " (a simulation: a smoke test, not a measurement)"),
        "",
        "| method | requests | req/s | p50 ms | p99 ms | failed | unfinished "
        "| ledger peak / budget | GPU max alloc start -> end | host RSS start -> end (max) "
        "| host CPU, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.method} | skipped: {r.skipped} | | | | | | | | | |")
            continue
        cores = "-" if r.cpu_cores is None else f"{r.cpu_cores:.2f}"
        peak = "-" if r.ledger_peak is None else format_nbytes(r.ledger_peak)
        budget = "none" if r.budget is None else format_nbytes(r.budget)
        over = (
            ""
            if r.ledger_peak is None or r.budget is None or r.ledger_peak <= r.budget
            else " OVER"
        )
        lines.append(
            f"| {r.method} | {r.requests} | {r.throughput:.2f} | {ms(r.percentile(0.5))} | "
            f"{ms(r.percentile(0.99))} | {r.failed} | {r.unfinished} | {peak} / {budget}{over} | "
            f"{format_nbytes(r.gpu_max_start)} -> {format_nbytes(r.gpu_max_end)} | "
            f"{format_nbytes(r.rss_start)} -> {format_nbytes(r.rss_end)} "
            f"({format_nbytes(r.rss_max)}) | {cores} |"
        )
    by = {r.method: r for r in results if not r.skipped and r.requests}
    ours = by.get("aresidency")
    lines += ["", "| goal | measured | target | met |", "|---|---:|---:|---|"]

    def goal(label: str, value: float | None, target: float, at_least: bool) -> None:
        if value is None:
            lines.append(f"| {label} | - | {target:g} | not run |")
            return
        met = value >= target if at_least else value <= target
        sign = ">=" if at_least else "<="
        lines.append(f"| {label} | {value:.2f} | {sign} {target:g} | {'yes' if met else 'NO'} |")

    def ratio(other: str, attribute: Callable[[Result], float]) -> float | None:
        if ours is None or other not in by or not attribute(by[other]):
            return None
        return attribute(ours) / attribute(by[other])

    goal("throughput vs swap (ollama)", ratio("swap (ollama)", lambda r: r.throughput), 2.0, True)
    goal("throughput vs cpu_offload", ratio("cpu_offload", lambda r: r.throughput), 5.0, True)
    goal("p99 vs swap (ollama)", ratio("swap (ollama)", lambda r: r.percentile(0.99)), 0.5, False)
    fits = workload.hot_set_fits(model_bytes)
    hot = f"hot set: {workload.hot_set()} models carry {HOT_SHARE:.0%} of the requests"
    label = f"throughput vs all resident ({hot}, {'fits' if fits else 'does not fit: no goal'})"
    goal(label, ratio("all resident", lambda r: r.throughput), 1 / 1.5, True)
    for label, result in by.items():
        if not label.startswith("aresidency") or not result.server.get("stats"):
            continue
        lines += [
            "",
            f"{label}, per model: requests / hits / loads / evictions / copied / waiting for "
            "admission; calls (shared, direct) / seconds in calls / of which waiting for earlier "
            "calls",
            "",
        ]
        for name, row in result.server["stats"].items():
            lines.append(
                f"- {name}: {row['requests']} / {row['hits']} / {row['loads']} / "
                f"{row['evictions']} / {format_nbytes(row['bytes_copied'])} / "
                f"{row['wait_seconds']:.2f} s; {row.get('calls', 0)} "
                f"({row.get('shared_calls', 0)}, {row.get('direct_calls', 0)}) / "
                f"{row.get('call_seconds', 0.0):.2f} s / "
                f"{row.get('call_wait_seconds', 0.0):.2f} s (last {row['last_mode']}; "
                f"{row.get('joined_past', 0)} joined past the head of the line)"
            )
        lines.append(f"\n{label} modes: {result.modes}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


POOL_METHODS = {
    "aresidency": "aresidency",
    "aresidency-strict": "aresidency (strict FIFO)",
    "aresidency-shared": "aresidency (shared calls)",
    "aresidency-onethread": "aresidency (one thread)",
    "aresidency-pipeline": "aresidency (pipeline calls)",
}


def run_one(
    method: str, workload: Workload, models: dict[str, nn.Module], budget: int, gpu: bool
) -> Result:
    """One method's server, driven by the clients."""
    if method in POOL_METHODS:
        server: dict[str, Any] = {}
        express = workload.express and method != "aresidency-strict"
        label = POOL_METHODS[method]

        def make_app() -> Any:
            config = example.ServerConfig(
                models=workload.specs,
                device="cuda:0",
                budget=budget,
                backend=workload.backend,
                dtype=workload.dtype,
                timeout=None,
                prebuilt=models,
                pool_options={
                    "defer_hot_evictions": workload.defer,
                    "express_joins": express,
                    "shared_calls": method == "aresidency-shared",
                    "one_thread": method == "aresidency-onethread",
                    "direct_calls": method != "aresidency-pipeline",
                },
            )
            return example.create_app(config)

        def after(url: str) -> None:
            server["stats"] = fetch_json(url + "/stats")
            snapshot = fetch_json(url + "/residency")
            device = next(r for r in snapshot["locations"] if r["location"] == "cuda:0")
            server["peak"] = device["peak_bytes"]
            server["decisions"] = fetch_json(url + "/decisions?limit=10")

        result = run_method(label, workload, make_app, after)
        result.ledger_peak, result.budget = server.pop("peak", None), budget
        result.server = server
        return result
    engine: Engine
    if method == "resident":
        total = sum(module_bytes(m) for m in models.values())
        if gpu and total > 0.9 * torch.cuda.mem_get_info()[0]:
            return Result("all resident", skipped="the models do not fit the GPU")
        engine = ResidentEngine(models, workload.device)
    elif method == "swap":
        engine = SwapEngine(models, workload.device, budget)
    elif method == "cpu_offload":
        if importlib.util.find_spec("accelerate") is None:
            return Result("cpu_offload", skipped="accelerate is not installed")
        if not gpu:
            return Result("cpu_offload", skipped="needs a GPU")
        engine = OffloadEngine(models, workload.device)
    else:
        raise ValueError(
            f"unknown method {method!r}: aresidency, aresidency-strict, aresidency-shared, "
            "aresidency-onethread, aresidency-pipeline, swap, resident, cpu_offload"
        )
    info: dict[str, Any] = {}
    result = run_method(
        engine.name,
        workload,
        lambda: engine_app(engine),
        lambda url: info.update(fetch_json(url + "/info")),
        stopping=lambda: setattr(engine, "closing", True),
    )
    result.server = info
    if method == "swap":
        result.ledger_peak, result.budget = info.get("peak_bytes"), budget
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    parser.add_argument("--quick", action="store_true", help="tiny models, a short run")
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="measured seconds per method (default 30; --quick 4; the issue's stability run: 600)",
    )
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds before measuring (default 5)"
    )
    parser.add_argument(
        "--tail",
        type=float,
        default=None,
        help="seconds the requests in flight at the end may take (default 10; --quick 5)",
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the models")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256)")
    parser.add_argument("--decode", type=int, default=4, help="decode steps per request")
    parser.add_argument("--budget", default=None, help="GPU budget (default: 3.2 models)")
    parser.add_argument(
        "--methods",
        default="aresidency,swap,resident,cpu_offload",
        help="comma-separated: aresidency, aresidency-strict (no joins past the head of the line), "
        "aresidency-shared (calls on a resident model at the same time), aresidency-onethread "
        "(calls on every resident model in one thread), aresidency-pipeline (every call through "
        "the streaming pipeline), swap, resident, cpu_offload",
    )
    parser.add_argument(
        "--no-defer",
        action="store_true",
        help="aresidency: evict an idle hot model rather than wait for a colder one in use",
    )
    parser.add_argument(
        "--strict-fifo",
        action="store_true",
        help="aresidency: no request joins its model past the head of the line",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "sim"
    gpu = backend == "cuda"
    specs = quick_specs(args.models) if args.quick else full_specs(args.models)
    dtype = torch.bfloat16 if gpu else torch.float32
    log(f"building {len(specs)} models ({backend}, {dtype})")
    # In parallel: filling the weights is serial per model (one seeded generator each) and
    # releases the GIL, so eight 1.5 GB models take seconds instead of most of a minute.
    # transformers imports lazily, and not safely from several threads at once: import first.
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    with ThreadPoolExecutor(max_workers=max(1, min(len(specs), os.cpu_count() or 1))) as pool:
        built = list(pool.map(lambda spec: spec.build(dtype), specs))
    models = {spec.name: module for spec, module in zip(specs, built, strict=True)}
    model_bytes = max(module_bytes(m) for m in models.values())
    budget = parse_nbytes(args.budget) if args.budget else int(3.2 * model_bytes)
    workload = Workload(
        specs=specs,
        budget=budget,
        prompt_len=args.prompt or (16 if args.quick else 256),
        new_tokens=args.decode if not args.quick else min(args.decode, 2),
        clients=args.clients,
        seconds=args.seconds if args.seconds is not None else (4.0 if args.quick else 30.0),
        warmup=args.warmup if args.warmup is not None else (1.0 if args.quick else 5.0),
        tail=args.tail if args.tail is not None else (5.0 if args.quick else 10.0),
        zipf=args.zipf,
        seed=args.seed,
        device="cuda:0" if gpu else "cpu",
        backend=backend,
        dtype=dtype,
        defer=not args.no_defer,
        express=not args.strict_fifo,
    )
    log(f"{len(specs)} models of {format_nbytes(model_bytes)}; budget {format_nbytes(budget)}")
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    per_method = workload.warmup + workload.seconds + workload.tail
    log(
        f"{len(wanted)} methods, each at most {per_method:g} s of clients "
        f"({workload.warmup:g} warm-up + {workload.seconds:g} measured + {workload.tail:g} tail) "
        f"plus its server's start-up: about {len(wanted) * per_method:g} s in all"
    )
    results: list[Result] = []

    for method in wanted:
        try:
            result = run_one(method, workload, models, budget, gpu)
        except Exception as error:
            traceback.print_exc()
            result = Result(method, skipped=f"{type(error).__name__}: {error}")
        results.append(result)

    report = markdown(workload, results, model_bytes)
    print()
    print(report)
    if args.markdown is not None:
        args.markdown.write_text(report + "\n")
    if args.json is not None:
        payload = {
            "workload": {
                "models": [spec.name for spec in specs],
                "model_bytes": model_bytes,
                "budget_bytes": budget,
                "prompt_len": workload.prompt_len,
                "new_tokens": workload.new_tokens,
                "clients": workload.clients,
                "seconds": workload.seconds,
                "warmup": workload.warmup,
                "tail": workload.tail,
                "zipf": workload.zipf,
                "backend": backend,
            },
            "results": [r.to_dict() for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    failed = sum(r.failed for r in results)
    over = any(
        r.ledger_peak is not None and r.budget is not None and r.ledger_peak > r.budget
        for r in results
        if r.method.startswith("aresidency")
    )
    return 1 if failed or over else 0


if __name__ == "__main__":
    sys.exit(main())
