"""An inference server for more models than the GPU holds: FastAPI on a ``ModelPool``.

Several Llama-shaped models (random weights, built from their configs: nothing is downloaded)
share one device budget. For each request the pool decides whether its model is kept
resident (evicting the models least in demand to make room), or, when it cannot fit at all,
streamed through the budget; the request's KV cache and activations are reserved for its
duration. Endpoints:

* ``POST /generate/{model}``: prefill of a prompt (``tokens``, or ``prompt_len`` random ones)
  and ``max_new_tokens`` greedy decode steps with the KV cache; returns the tokens, the mode
  (resident or streamed) and the time spent waiting for admission;
* ``POST /embed/{model}``: the mean of the last hidden state over the prompt;
* ``GET /residency``: ``(await manager.snapshot_async()).to_dict()`` (what is where, budgets,
  peaks; built without blocking the loop);
* ``GET /stats``: ``pool.stats()`` (per model: requests, hits, loads, evictions, bytes
  copied, time waiting, mode of the last request);
* ``GET /decisions``: the pool's latest decisions with their evidence.

The manager and the pool live in the app's lifespan; at shutdown the pool finishes the
requests in flight first. A client that disconnects mid-request has its handler cancelled
(Starlette does not do that for plain endpoints: :func:`until_disconnected` listens for the
disconnect), which ends its reservation and holds. Run it with::

    pip install 'aresidency[serve]'   # fastapi, uvicorn
    uvicorn examples.server_app:app

On a machine without a GPU it runs on the simulated backend (a simulation of CUDA devices in
host memory, tiny models). ``create_app(ServerConfig(...))`` or
``create_app(manager_factory=...)`` builds other set-ups (tests, the benchmark).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictFloat, StrictInt, StrictStr
from torch import nn

from aresidency import ResidencyError, ResidencyManager, ResidencyPlanError
from aresidency.core.locations import Location
from aresidency.core.sizes import ByteSize, parse_nbytes
from aresidency.serving import ModelPool, PooledModel

logger = logging.getLogger("aresidency.examples.server")

T = TypeVar("T")

#: Status for a request whose client went away (nginx's convention; never seen by a client).
CLIENT_CLOSED = 499


# ---------------------------------------------------------------------------- set-up


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-shaped model built from its config with random weights (seeded)."""

    name: str
    layers: int = 4
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    seed: int = 0
    prefetch: int = 2

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            vocab_size=self.vocab,
            max_position_embeddings=4096,
        )

    def build(self, dtype: torch.dtype) -> nn.Module:
        """The model on the CPU, in ``dtype``, in eval mode, without autograd. Blocks the
        calling thread (call it in a worker thread): filling a large model takes seconds."""
        from transformers import LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = self.config()
        with torch.device("meta"):  # no initialisation pass: the weights are filled below
            built = LlamaForCausalLM(config)
        model: nn.Module = built.to_empty(device="cpu")
        model = model.to(dtype)
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.fill_(1.0)
                else:
                    parameter.normal_(0.0, 0.02, generator=generator)
        # The rotary embedding's buffers are not parameters: rebuild them on the CPU.
        built.model.rotary_emb = LlamaRotaryEmbedding(config=config)
        return model.eval().requires_grad_(False)

    def kv_bytes(self, tokens: int, element_size: int) -> int:
        """Bytes of the KV cache for ``tokens`` tokens of one sequence."""
        head_dim = self.hidden // self.heads
        return 2 * self.layers * self.kv_heads * head_dim * tokens * element_size


def default_models() -> list[ModelSpec]:
    """Three small models that fit two at a time in the default budget, and one that does not
    fit at all (it is streamed)."""
    return [
        ModelSpec("llama-a", layers=6, seed=1),
        ModelSpec("llama-b", layers=6, seed=2),
        ModelSpec("llama-c", layers=6, seed=3),
        ModelSpec("llama-wide", layers=6, hidden=128, intermediate=512, heads=4, seed=4),
    ]


@dataclass
class ServerConfig:
    """What the server hosts: ``models``, the ``device`` and its ``budget`` (bytes or a size
    string), the ``backend`` (``"auto"``: CUDA if present, else the simulation), ``dtype``
    (``None``: bfloat16 on a GPU, float32 on the simulation), the pool's
    ``demand_half_life`` (seconds), the default ``timeout`` for admission (seconds),
    ``workspace_per_token`` (bytes of activations reserved per token, beside the KV cache),
    ``prebuilt`` (name -> an ``nn.Module`` already built, served instead of building the
    spec's: the benchmark builds its models once for every method it compares),
    ``pool_options`` (more keyword arguments of ``ModelPool``) and ``freeze_gc`` (once the
    models are built and added, ``gc.freeze()`` every object alive, so that the collector's
    full collections leave torch's and the models' objects out: ``docs/performance.md``,
    "Python's garbage collector"; undone at shutdown)."""

    models: Sequence[ModelSpec] = field(default_factory=default_models)
    device: str = "cuda:0"
    budget: ByteSize = "2560KiB"
    backend: Any = "auto"
    dtype: torch.dtype | None = None
    demand_half_life: float = 30.0
    timeout: float | None = 60.0
    workspace_per_token: int = 4096
    prebuilt: Mapping[str, nn.Module] = field(default_factory=dict)
    pool_options: Mapping[str, Any] = field(default_factory=dict)
    freeze_gc: bool = False


# ---------------------------------------------------------------------------- requests


class GenerateBody(BaseModel):
    tokens: list[int] | None = Field(None, description="prompt token ids (default: random)")
    prompt_len: int = Field(32, ge=1, le=4096, description="random prompt length")
    max_new_tokens: int = Field(4, ge=0, le=256)
    # Strict: pydantic would take JSON true for the int 1 (a reserve of one byte).
    reserve: StrictInt | StrictFloat | StrictStr | None = Field(
        None, description="workspace to reserve, bytes or a size such as '64MiB' (default: KV)"
    )
    timeout: float | None = Field(None, ge=0, description="seconds to wait for admission")


class EmbedBody(BaseModel):
    tokens: list[int] | None = None
    prompt_len: int = Field(32, ge=1, le=4096)


def cache_keyword(module: nn.Module) -> str:
    """``cache`` (transformers 5) or ``past_key_values`` (before)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


async def greedy_decode(
    model: Callable[..., Awaitable[Any]], module: nn.Module, prompt: torch.Tensor, steps: int
) -> torch.Tensor:
    """Prefill then ``steps`` greedy decode steps through ``model`` (an awaitable callable
    running ``module``); returns the new tokens, ``[1, steps + 1]``, where the model computes
    (on a GPU: enqueued, not waited for)."""
    cache_key = cache_keyword(module)
    extra: dict[str, Any] = {}
    if "logits_to_keep" in inspect.signature(module.forward).parameters:
        extra["logits_to_keep"] = 1  # the last position's logits only: not seq x vocab
    out = await model(prompt, use_cache=True, **extra)
    tokens = [out.logits[:, -1:].argmax(-1)]
    for _ in range(steps):
        out = await model(tokens[-1], use_cache=True, **{cache_key: returned_cache(out)}, **extra)
        tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


async def until_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run ``work()``; if the client disconnects first, cancel it (which ends its reservation
    and holds) and return ``None``. Listens for ``http.disconnect`` on the request's
    ``receive`` (its body was read already: nothing else arrives). ``work``'s exception is
    raised as it is."""
    outcome: list[tuple[bool, Any]] = []
    async with anyio.create_task_group() as tasks:

        async def listen() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    logger.info("client of %s disconnected: request cancelled", request.url.path)
                    tasks.cancel_scope.cancel()
                    return

        async def run() -> None:
            try:
                outcome.append((True, await work()))
            except Exception as error:  # raised below, outside the task group's wrapping
                outcome.append((False, error))
            tasks.cancel_scope.cancel()  # done: stop listening

        tasks.start_soon(listen)
        tasks.start_soon(run)
    if not outcome:
        return None
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result


class ShuttingDown(Exception):
    """The pool is closing (the server shuts down): the request is refused with 503."""


def check_open(pool: ModelPool) -> None:
    """Raise :class:`ShuttingDown` once the pool began closing. Called right before
    ``pool.use`` with no await in between, so that no request is refused with the pool's
    ``RuntimeError`` (a 500) while the server shuts down."""
    if pool.closed:
        raise ShuttingDown("the server is shutting down: it admits no new request")


class LoadFailed(Exception):
    """Bringing the request's model to the device failed (a copy, or an allocation the device
    refused): answered 503 with the error. The pool's other requests go on, and the next
    request for the model loads it again."""


@asynccontextmanager
async def use_loaded(
    pool: ModelPool, name: str, *, reserve: ByteSize, timeout: float | None
) -> AsyncIterator[PooledModel]:
    """``pool.use(name, ...)`` once the pool is open (:func:`check_open`), with a failure to
    load the model (a ``RuntimeError`` such as a CUDA error or ``torch.OutOfMemoryError``, a
    ``ResidencyError`` other than the never-fits ``ResidencyPlanError``) raised as
    :class:`LoadFailed`. What the body raises is left as it is."""
    check_open(pool)
    async with contextlib.AsyncExitStack() as stack:
        try:
            model = await stack.enter_async_context(
                pool.use(name, reserve=reserve, timeout=timeout)
            )
        except ResidencyPlanError:
            raise
        except (RuntimeError, ResidencyError) as error:
            notes = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))
            raise LoadFailed(
                f"model {name!r} could not be loaded: {type(error).__name__}: {error}{notes}"
            ) from error
        yield model


# ---------------------------------------------------------------------------- the app


def create_app(
    config: ServerConfig | None = None,
    *,
    manager_factory: Callable[[], ResidencyManager] | None = None,
) -> FastAPI:
    """The FastAPI app. ``config``: models, budget and backend (default: ``ServerConfig()``);
    ``manager_factory``: makes the manager instead (its budgets and backend are used as
    they are). The manager and the pool are made in the app's lifespan."""
    config = config if config is not None else ServerConfig()
    device = config.device

    def make_manager() -> ResidencyManager:
        if manager_factory is not None:
            return manager_factory()
        budget = parse_nbytes(config.budget, "budget")
        return ResidencyManager(budgets={device: budget}, backend=config.backend)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with make_manager() as manager:
            dtype = config.dtype
            if dtype is None:
                dtype = torch.float32 if manager.backend.host_compute else torch.bfloat16
            pool = ModelPool(
                manager, device, demand_half_life=config.demand_half_life, **config.pool_options
            )
            specs: dict[str, ModelSpec] = {}
            for spec in config.models:
                module = config.prebuilt.get(spec.name)
                if module is None:
                    module = await anyio.to_thread.run_sync(spec.build, dtype)
                pool.add(spec.name, module, prefetch=spec.prefetch)
                specs[spec.name] = spec
            app.state.manager = manager
            app.state.pool = pool
            app.state.specs = specs
            app.state.dtype = dtype
            logger.info("serving %s on %s (%s)", ", ".join(specs), device, manager.backend.name)
            if config.freeze_gc:
                gc.collect()
                gc.freeze()
            try:
                yield
            finally:
                try:
                    await pool.aclose()  # waits for the requests in flight
                finally:
                    if config.freeze_gc:
                        gc.unfreeze()

    app = FastAPI(title="aresidency model pool", lifespan=lifespan)

    def state(request: Request) -> tuple[ResidencyManager, ModelPool, dict[str, ModelSpec]]:
        s = request.app.state
        return s.manager, s.pool, s.specs

    def prompt_of(
        manager: ResidencyManager, spec: ModelSpec, tokens: list[int] | None, length: int
    ) -> torch.Tensor:
        if tokens is None:
            ids = torch.randint(0, spec.vocab, (1, length))
        else:
            if not tokens or len(tokens) > 4096 or any(t < 0 or t >= spec.vocab for t in tokens):
                raise HTTPException(422, f"tokens must be 1 to 4096 ids in [0, {spec.vocab})")
            ids = torch.tensor([tokens])
        # The simulation computes on the host; a GPU needs the ids on the device.
        return ids if manager.backend.host_compute else ids.to(device)

    async def to_host(manager: ResidencyManager, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the host, waiting for the device without blocking the loop."""
        if manager.backend.host_compute:
            return tensor
        backend = manager.backend
        event = backend.record_event(backend.current_stream(Location.parse(device)))
        await backend.wait(event)
        return tensor.cpu()

    def lookup(specs: dict[str, ModelSpec], name: str) -> ModelSpec:
        spec = specs.get(name)
        if spec is None:
            raise HTTPException(404, f"no model named {name!r} (serving: {', '.join(specs)})")
        return spec

    @app.post("/generate/{name}")
    async def generate(name: str, body: GenerateBody, request: Request) -> Response:
        manager, pool, specs = state(request)
        spec = lookup(specs, name)
        prompt = prompt_of(manager, spec, body.tokens, body.prompt_len)
        length = prompt.shape[1] + body.max_new_tokens + 1
        element = torch.empty((), dtype=request.app.state.dtype).element_size()
        reserve: ByteSize | None = body.reserve
        if reserve is not None:
            try:  # a bad size is the client's mistake (422), not the server's (500)
                reserve = parse_nbytes(reserve, "reserve")
            except (TypeError, ValueError) as error:
                raise HTTPException(422, str(error)) from None
        else:
            reserve = spec.kv_bytes(length, element) + config.workspace_per_token * length
        timeout = body.timeout if body.timeout is not None else config.timeout
        started = time.perf_counter()

        async def work() -> dict[str, Any]:
            async with use_loaded(pool, name, reserve=reserve, timeout=timeout) as model:
                admitted = time.perf_counter()
                # No grad-mode context around awaits (it would leak into other requests'
                # tasks): the models were built without autograd.
                new = await greedy_decode(model, model.module, prompt, body.max_new_tokens)
                new = await to_host(manager, new)
                return {
                    "model": name,
                    "mode": model.mode,
                    "tokens": new[0].tolist(),
                    "prompt_len": int(prompt.shape[1]),
                    "admission_wait_s": admitted - started,
                    "latency_s": time.perf_counter() - started,
                    "decision": str(model.decision),
                }

        result = await until_disconnected(request, work)
        if result is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(result)

    @app.post("/embed/{name}")
    async def embed(name: str, body: EmbedBody, request: Request) -> Response:
        manager, pool, specs = state(request)
        spec = lookup(specs, name)
        prompt = prompt_of(manager, spec, body.tokens, body.prompt_len)
        element = torch.empty((), dtype=request.app.state.dtype).element_size()
        reserve = spec.kv_bytes(prompt.shape[1], element) + config.workspace_per_token * int(
            prompt.shape[1]
        )

        async def work() -> dict[str, Any]:
            async with use_loaded(pool, name, reserve=reserve, timeout=config.timeout) as model:
                out = await model(prompt, output_hidden_states=True, use_cache=False)
                vector = await to_host(manager, out.hidden_states[-1].float().mean(dim=1))
                return {"model": name, "mode": model.mode, "embedding": vector[0].tolist()}

        result = await until_disconnected(request, work)
        if result is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(result)

    @app.get("/residency")
    async def residency(request: Request) -> dict[str, Any]:
        manager, _, _ = state(request)
        # Built in slices (the loop keeps serving), then turned into JSON-ready data in a
        # worker thread: the snapshot is immutable and holds no tensor.
        snapshot = await manager.snapshot_async()
        data: dict[str, Any] = await anyio.to_thread.run_sync(snapshot.to_dict)
        return data

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        _, pool, _ = state(request)
        return pool.stats()

    @app.get("/decisions")
    async def decisions(
        request: Request, limit: int = Query(20, ge=0, description="how many, latest last")
    ) -> list[dict[str, Any]]:
        _, pool, _ = state(request)
        latest = list(pool.decisions)
        return [d.summary() for d in latest[len(latest) - min(limit, len(latest)) :]]

    @app.exception_handler(ResidencyPlanError)
    async def never_fits(request: Request, error: ResidencyPlanError) -> JSONResponse:
        # 507 Insufficient Storage: the request could never fit the device budget.
        return JSONResponse({"error": str(error)}, status_code=507)

    @app.exception_handler(TimeoutError)
    async def not_admitted(request: Request, error: TimeoutError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=503)

    @app.exception_handler(LoadFailed)
    async def load_failed(request: Request, error: LoadFailed) -> JSONResponse:
        # 503: the next request for the model loads it again (a client may retry).
        return JSONResponse({"error": str(error)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(ShuttingDown)
    async def shutting_down(request: Request, error: ShuttingDown) -> JSONResponse:
        # 503 with Retry-After: a load balancer sends the request to another replica.
        return JSONResponse({"error": str(error)}, status_code=503, headers={"Retry-After": "1"})

    return app


#: ``uvicorn examples.server_app:app``: the default set-up.
app = create_app(ServerConfig(freeze_gc=True))
