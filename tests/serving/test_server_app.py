"""The example server (``examples/server_app.py``) on the simulated backend, through
``httpx.ASGITransport`` with the app's lifespan entered explicitly (a simulation of CUDA
devices in host memory: its streams run on worker threads)."""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest

from aresidency import ResidencyManager
from aresidency.backends.sim import SimBackend
from aresidency.core.sizes import format_nbytes
from aresidency.serving import ModelPool

from ._models import assert_nothing_leaked, max_charge

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.anyio

BUDGET = 2560 << 10  # the example's default: two of its small models, or one streamed wide one


def load_example() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "examples" / "server_app.py"
    spec = importlib.util.spec_from_file_location("server_app_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the body models' annotations here
    spec.loader.exec_module(module)
    return module


example = load_example()


def make_app(backend: Any = "sim", **config: Any) -> Any:
    return example.create_app(
        example.ServerConfig(**config),
        manager_factory=lambda: ResidencyManager(
            budgets={"cuda:0": BUDGET}, backend=backend, trace_capacity=1 << 16
        ),
    )


class Served:
    """A running app: its client, manager and pool."""

    def __init__(self, app: Any, client: Any) -> None:
        self.app = app
        self.client = client
        self.manager: ResidencyManager = app.state.manager
        self.pool: ModelPool = app.state.pool


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[Served]:
    """The app's lifespan entered explicitly, and a client talking to it in-process."""
    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        app.router.lifespan_context(app),
    ):
        yield Served(app, client)


@pytest.fixture
async def server() -> AsyncIterator[Served]:
    async with served(make_app()) as running:
        yield running


async def eventually(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.wait_all_tasks_blocked()


async def test_generate_and_embed_answer_with_the_mode_each_request_got(server: Served) -> None:
    client = server.client
    answer = await client.post("/generate/llama-a", json={"prompt_len": 12, "max_new_tokens": 3})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["mode"] == "resident" and len(body["tokens"]) == 4 and body["prompt_len"] == 12
    assert "loaded" in body["decision"]
    # The same prompt again: the same tokens (greedy), and nothing to load.
    tokens = list(range(10))
    first = await client.post("/generate/llama-a", json={"tokens": tokens, "max_new_tokens": 2})
    again = await client.post("/generate/llama-a", json={"tokens": tokens, "max_new_tokens": 2})
    assert first.json()["tokens"] == again.json()["tokens"]
    assert "nothing to load" in again.json()["decision"]
    wide = await client.post("/generate/llama-wide", json={"prompt_len": 8, "max_new_tokens": 2})
    assert wide.status_code == 200 and wide.json()["mode"] == "streamed"
    embedded = await client.post("/embed/llama-b", json={"prompt_len": 6})
    assert embedded.status_code == 200 and len(embedded.json()["embedding"]) == 64
    stats = (await client.get("/stats")).json()
    assert stats["llama-a"]["requests"] == 3 and stats["llama-a"]["hits"] == 2
    assert stats["llama-wide"]["last_mode"] == "streamed"
    decisions = (await client.get("/decisions", params={"limit": 2})).json()
    assert [d["model"] for d in decisions] == ["llama-wide", "llama-b"]


async def test_residency_is_the_managers_snapshot_as_json(server: Served) -> None:
    await server.client.post("/generate/llama-a", json={"prompt_len": 4, "max_new_tokens": 0})
    answer = await server.client.get("/residency")
    assert answer.status_code == 200
    body = answer.json()
    assert body == json.loads(json.dumps(server.manager.snapshot().to_dict()))
    devices = [loc for loc in body["locations"] if loc["location"] == "cuda:0"]
    assert devices and devices[0]["budget_bytes"] == BUDGET
    names = {value["name"] for value in body["values"]}
    assert {"llama-a.block0", "llama-wide.resident"} <= names


async def test_concurrent_requests_all_succeed_and_never_exceed_the_budget(
    server: Served, caplog: pytest.LogCaptureFixture
) -> None:
    answers: list[Any] = []

    async def ask(name: str, i: int) -> None:
        path = "/embed/" if i % 4 == 3 else "/generate/"
        answers.append(await server.client.post(path + name, json={"prompt_len": 4 + i % 5}))

    async with anyio.create_task_group() as tasks:
        for i in range(16):
            tasks.start_soon(
                ask, ["llama-a", "llama-b", "llama-c", "llama-a", "llama-wide"][i % 5], i
            )
    assert [a.status_code for a in answers] == [200] * 16
    assert {a.json()["mode"] for a in answers} == {"resident", "streamed"}
    for name in server.pool.models:
        await server.pool.module(name).drain()
    assert max_charge(server.manager.trace()) <= BUDGET
    assert server.manager.snapshot().location("cuda:0").peak_bytes <= BUDGET
    assert_nothing_leaked(server.manager, server.pool)
    # No call left an error behind (a release that found its block evicted, say).
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_request_that_could_never_fit_is_507_with_the_arithmetic(server: Served) -> None:
    answer = await server.client.post("/generate/llama-a", json={"reserve": "3MiB"})
    assert answer.status_code == 507
    assert "can never fit cuda:0" in answer.json()["error"]
    assert format_nbytes(BUDGET) in answer.json()["error"]
    missing = await server.client.post("/generate/llama-z", json={})
    assert missing.status_code == 404 and "llama-a" in missing.json()["detail"]


async def test_a_cancelled_client_request_releases_its_reservation_and_holds() -> None:
    # Slow simulated copies: the streamed model's request is still in its body when the
    # client's task is cancelled (with ASGITransport the handler runs in that task).
    backend = SimBackend(copy_gbps=0.05)
    async with served(make_app(backend)) as running:
        scope = anyio.CancelScope()

        async def ask() -> None:
            with scope:
                await running.client.post(
                    "/generate/llama-wide", json={"prompt_len": 8, "max_new_tokens": 50}
                )
                pytest.fail("the request finished")

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ask)
            await eventually(lambda: running.pool.admitted == 1)
            assert running.manager.state.ledger("cuda:0").reserved_bytes > 0
            scope.cancel()
        backend.copy_gbps = None
        await running.pool.module("llama-wide").drain()
        assert_nothing_leaked(running.manager, running.pool)
        after = await running.client.post("/generate/llama-a", json={"prompt_len": 4})
        assert after.status_code == 200


async def test_a_client_that_disconnects_has_its_request_cancelled() -> None:
    # The ASGI conversation a server has with a client that goes away mid-request: the body,
    # then (while the handler runs) 'http.disconnect'. Starlette does not cancel a plain
    # endpoint for that; the example's until_disconnected does.
    backend = SimBackend(copy_gbps=0.05)
    app = make_app(backend)
    async with served(app) as running:
        gone = anyio.Event()
        sent: list[dict[str, Any]] = []
        body = json.dumps({"prompt_len": 8, "max_new_tokens": 50}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/generate/llama-wide",
            "raw_path": b"/generate/llama-wide",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "client": ("127.0.0.1", 1),
            "server": ("test", 80),
            "state": {},
        }
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(app, scope, receive, send)
            await eventually(lambda: running.pool.admitted == 1)
            gone.set()
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
        backend.copy_gbps = None
        await running.pool.module("llama-wide").drain()
        assert_nothing_leaked(running.manager, running.pool)


async def test_shutdown_finishes_the_requests_in_flight() -> None:
    # Slow simulated copies and many decode steps: the request is surely still in its body
    # when it is seen admitted (a short one could end between two looks); then the copies
    # are sped up, so that the shutdown has a request in flight to finish, and finishes it.
    backend = SimBackend(copy_gbps=0.05)
    app = make_app(backend)
    answers: list[Any] = []
    async with anyio.create_task_group() as tasks:
        async with served(app) as running:
            pool = running.pool

            async def ask() -> None:
                answers.append(
                    await running.client.post(
                        "/generate/llama-wide", json={"prompt_len": 8, "max_new_tokens": 20}
                    )
                )

            tasks.start_soon(ask)
            await eventually(lambda: pool.admitted == 1)
            backend.copy_gbps = None
            # Leaving the lifespan closes the pool: it waits for the request in flight.
        assert not answers or answers[0].status_code == 200  # still in flight, or just done
        assert not pool.models  # the pool closed after the request ended
    assert [a.status_code for a in answers] == [200]
    assert len(answers[0].json()["tokens"]) == 21


@pytest.mark.allow_loop_stall  # the start-up's full collection, and gc.get_objects, on purpose
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the collector's, not the loop's
async def test_freeze_gc_freezes_what_start_up_made_and_unfreezes_at_shutdown(
    anyio_backend: str,
) -> None:
    # The example's own app (uvicorn's) freezes; a made one does not unless asked.
    assert example.app is not None
    gc.unfreeze()
    async with served(make_app()) as running:
        assert gc.get_freeze_count() == 0
        assert (await running.client.post("/embed/llama-a", json={"prompt_len": 4})).is_success
    async with served(make_app(freeze_gc=True)) as running:
        # The models were built before the freeze: they are in the frozen set, which the
        # collector (and gc.get_objects) leaves out.
        assert gc.get_freeze_count() > 0
        module = running.pool.module("llama-a").module
        assert not any(obj is module for obj in gc.get_objects())
        assert (await running.client.post("/embed/llama-a", json={"prompt_len": 4})).is_success
    assert gc.get_freeze_count() == 0


async def test_a_bad_reserve_or_limit_is_422_naming_it_and_admits_nothing(server: Served) -> None:
    # A size the pool refuses is the client's mistake: 422 with the pool's sentence naming
    # 'reserve', never a 500; nothing was asked of the pool.
    for reserve in ["lots", "-5", -1]:
        answer = await server.client.post("/generate/llama-a", json={"reserve": reserve})
        assert answer.status_code == 422, (reserve, answer.text)
        assert "reserve must be a byte count" in answer.json()["detail"]
    # JSON true is no size either (pydantic took it for the int 1: a one-byte reserve, 200).
    for reserve in [True, [1]]:
        answer = await server.client.post("/generate/llama-a", json={"reserve": reserve})
        assert answer.status_code == 422 and "reserve" in answer.text, (reserve, answer.text)
    assert server.pool.stats()["llama-a"]["requests"] == 0
    ok = await server.client.post("/generate/llama-a", json={"reserve": "64KiB"})
    assert ok.status_code == 200, ok.text
    await server.client.post("/embed/llama-b", json={"prompt_len": 4})
    # limit=0 is none of them (a slice [-0:] would be all), a negative limit is refused.
    answer = await server.client.get("/decisions", params={"limit": 0})
    assert answer.status_code == 200 and answer.json() == []
    answer = await server.client.get("/decisions", params={"limit": 1})
    assert [d["model"] for d in answer.json()] == ["llama-b"]
    answer = await server.client.get("/decisions", params={"limit": 50})
    assert [d["model"] for d in answer.json()] == ["llama-a", "llama-b"]
    answer = await server.client.get("/decisions", params={"limit": -1})
    assert answer.status_code == 422 and "limit" in answer.text
    assert_nothing_leaked(server.manager, server.pool)


async def test_a_request_that_arrives_while_the_server_shuts_down_is_503_not_500() -> None:
    # The lifespan's shutdown closes the pool and waits for the request in flight; a request
    # that arrives meanwhile was refused by pool.use with a RuntimeError: a 500 (raised out
    # of the app). It is a 503 with Retry-After now, and the one in flight is served.
    backend = SimBackend(copy_gbps=0.05)
    app = make_app(backend)
    answers: list[Any] = []
    async with anyio.create_task_group() as tasks, served(app) as running:
        pool = running.pool

        async def ask() -> None:
            answers.append(
                await running.client.post(
                    "/generate/llama-wide", json={"prompt_len": 8, "max_new_tokens": 20}
                )
            )

        tasks.start_soon(ask)
        await eventually(lambda: pool.admitted == 1)
        assert not pool.closed

        async def late() -> None:
            await eventually(lambda: pool.closed)  # the shutdown began
            for path in ("/generate/llama-a", "/embed/llama-b"):
                answers.append(await running.client.post(path, json={"prompt_len": 4}))
            backend.copy_gbps = None  # then let the request in flight finish

        tasks.start_soon(late)
        # Leaving the lifespan closes the pool: it waits for the request in flight.
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200, 503, 503]
    refused = [a for a in answers if a.status_code == 503]
    assert all("shutting down" in a.json()["error"] for a in refused)
    assert all(a.headers["retry-after"] == "1" for a in refused)


@pytest.mark.parametrize("fault", ["fail_transfer_at", "oom_at_allocation"])
async def test_a_model_that_fails_to_load_is_503_saying_why_and_the_next_request_loads_it(
    server: Served, fault: str
) -> None:
    # A failed copy, or an allocation the device refused, was a bare 500 ("Internal Server
    # Error", the exception raised out of the app). It is a 503 naming the model and the
    # error, with Retry-After: the next request for the model loads it again.
    setattr(server.manager.backend.faults, fault, 1)  # the next one fails
    body = {"prompt_len": 4, "max_new_tokens": 1}
    answer = await server.client.post("/generate/llama-a", json=body)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error.startswith("model 'llama-a' could not be loaded: "), error
    assert "while loading model 'llama-a'" in error and answer.headers["retry-after"] == "1"
    assert (await server.client.post("/generate/llama-a", json=body)).status_code == 200
    assert_nothing_leaked(server.manager, server.pool)
