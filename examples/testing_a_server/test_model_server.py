"""The model server's promises, checked on aresidency's simulated backend (a simulation of CUDA
devices in host memory) through the aresidency pytest plugin: the ``residency_manager``
fixture, configured per test with ``@pytest.mark.residency(...)``, and the helpers of
``aresidency.testing`` that wait without sleeping and say what a test left behind.

Each test runs on asyncio and trio, under the loop-stall guard (see conftest.py).
"""

from __future__ import annotations

import threading

import anyio
import pytest
import torch
from model_server import ModelDoesNotFit, ModelServer, Unavailable

from aresidency import ResidencyManager
from aresidency.testing import (
    assert_quiet,
    assert_within_budgets,
    in_flight,
    settled,
    until,
)

pytestmark = pytest.mark.anyio

LAYERS, WIDTH = 4, 256  # four 256 x 256 float32 layers: 256 KiB each, 1 MiB in all


def make_weights(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5 for _ in range(LAYERS)]


def make_input(seed: int = 1) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(seed))


def reference(weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    for weight in weights:
        x = torch.tanh(x @ weight)
    return x


def assert_matches(result: torch.Tensor, expected: torch.Tensor) -> None:
    # torch.allclose, not torch.testing.assert_close: the latter's first call imports for half
    # a second, on the event loop, which the loop-stall guard would rightly report.
    assert result.shape == expected.shape
    assert torch.allclose(result, expected, rtol=1e-4, atol=1e-6), (result - expected).abs().max()


def on_device(manager: ResidencyManager, server: ModelServer) -> list[bool]:
    snapshot = manager.snapshot()
    return [
        any(str(loc) == server.device for loc in snapshot.value(h).locations)
        for h in server.handles
    ]


@pytest.mark.residency(budgets={"cuda:0": "2MiB", "pinned-host": "16MiB"})
async def test_a_request_is_answered_with_the_models_output(residency_manager):
    weights, x = make_weights(), make_input()
    server = ModelServer(residency_manager, weights, activation_bytes="256KiB")

    result = await server.infer(x)

    assert_matches(result, reference(weights, x))
    assert server.stats.served == 1
    assert on_device(residency_manager, server) == [True] * LAYERS  # kept for the next one
    await settled(residency_manager)
    assert_quiet(residency_manager)
    assert_within_budgets(residency_manager)


# 1 MiB of weights and 256 KiB of activations can never fit in 1 MiB.
@pytest.mark.residency(budgets={"cuda:0": "1MiB"})
async def test_a_model_that_can_never_fit_is_refused_at_once_and_leaves_nothing(
    residency_manager,
):
    server = ModelServer(residency_manager, make_weights(), activation_bytes="256KiB")

    with pytest.raises(ModelDoesNotFit, match="cuda:0"):
        await server.infer(make_input())

    assert server.stats.refused == 1
    assert residency_manager.snapshot().location("cuda:0").charged_bytes == 0
    assert_quiet(residency_manager)


@pytest.mark.residency(budgets={"cuda:0": "2MiB"}, fail_transfer_at=1)
async def test_a_failed_copy_is_retried_and_the_request_still_answered(residency_manager):
    weights, x = make_weights(), make_input()
    server = ModelServer(residency_manager, weights, activation_bytes="256KiB")

    result = await server.infer(x)

    assert_matches(result, reference(weights, x))
    assert (server.stats.retried, server.stats.served) == (1, 1)
    kinds = [t.kind for t in residency_manager.trace().transitions]
    assert "copy_abort" in kinds  # the injected failure happened, and was dropped
    await settled(residency_manager)
    assert_quiet(residency_manager)


@pytest.mark.residency(budgets={"cuda:0": "2MiB"})
async def test_a_device_that_refuses_memory_once_is_retried(residency_manager):
    weights, x = make_weights(), make_input()
    server = ModelServer(residency_manager, weights, activation_bytes="256KiB")
    # Armed here, not with the marker's oom_at_allocation: that counts from the manager's
    # start, and registering the weights into pinned memory allocates too.
    residency_manager.backend.faults.oom_at_allocation = 1

    result = await server.infer(x)

    assert_matches(result, reference(weights, x))
    assert server.stats.retried == 1
    await settled(residency_manager)
    assert_quiet(residency_manager)


@pytest.mark.residency(budgets={"cuda:0": "2MiB"}, fail_transfer_at=2)
async def test_a_copy_failing_beyond_the_retries_is_unavailable_and_leaves_nothing(
    residency_manager,
):
    weights, x = make_weights(), make_input()
    server = ModelServer(residency_manager, weights, activation_bytes="256KiB", retries=0)

    with pytest.raises(Unavailable, match="injected transfer failure"):
        await server.infer(x)

    await settled(residency_manager)
    assert_quiet(residency_manager)  # no reservation, no lease, no copy in flight
    assert on_device(residency_manager, server)[1] is False  # the second copy was dropped
    # The server goes on serving.
    assert_matches(await server.infer(x), reference(weights, x))


# Copies at 10 MB/s: each layer takes about 26 ms to arrive, long enough to leave mid-copy.
@pytest.mark.residency(budgets={"cuda:0": "2MiB"}, copy_gbps=0.01)
async def test_a_client_that_goes_away_mid_copy_leaves_nothing_behind(residency_manager):
    manager = residency_manager
    weights, x = make_weights(), make_input()
    server = ModelServer(manager, weights, activation_bytes="256KiB")

    async with anyio.create_task_group() as clients:
        clients.start_soon(server.infer, x)
        await until(manager, lambda: in_flight(manager), what="a copy in flight")
        clients.cancel_scope.cancel()  # the client hangs up

    await settled(manager)
    assert_quiet(manager)
    assert server.stats.served == 0
    assert manager.snapshot().location("cuda:0").reserved_bytes == 0
    assert_matches(await server.infer(x), reference(weights, x))


# Room on cuda:0 for the weights and one request's activations at a time.
@pytest.mark.residency(budgets={"cuda:0": "1280KiB"})
async def test_a_client_that_gives_up_while_waiting_for_room_leaves_the_queue(
    residency_manager,
):
    manager = residency_manager
    weights, x = make_weights(), make_input()
    server = ModelServer(manager, weights, activation_bytes="256KiB")
    await server.infer(x)  # the weights are on the device now
    # Hold the device's stream, so the first request keeps its room until we let it go.
    gate = threading.Event()
    stream = manager.backend.current_stream("cuda:0")
    manager.backend.run_in_stream_order(stream, lambda: gate.wait(30))
    first: list[torch.Tensor] = []
    second = anyio.CancelScope()

    async def first_client() -> None:
        first.append(await server.infer(x))

    async def second_client() -> None:
        with second:
            await server.infer(x)
        assert second.cancelled_caught

    async with anyio.create_task_group() as clients:
        clients.start_soon(first_client)
        await until(manager, lambda: manager.snapshot().location("cuda:0").reserved_bytes)
        clients.start_soon(second_client)  # waits for room behind the first
        # The admission queue is not residency state (joining it commits no transition, so
        # until() would not wake): wait until every task is blocked instead.
        await anyio.wait_all_tasks_blocked()
        assert manager.waiting == 1
        second.cancel()  # the second client hangs up
        await anyio.wait_all_tasks_blocked()
        assert manager.waiting == 0
        assert not first  # the first request still holds its room ...
        gate.set()  # ... until its work on the device runs
    assert_matches(first[0], reference(weights, x))
    await settled(manager)
    assert_quiet(manager)


# Room for the weights and two requests' activations: 1 MiB + 2 x 256 KiB.
@pytest.mark.residency(budgets={"cuda:0": "1536KiB"})
async def test_concurrent_requests_wait_for_room_and_stay_within_the_budget(residency_manager):
    manager = residency_manager
    weights = make_weights()
    server = ModelServer(manager, weights, activation_bytes="256KiB")
    results: dict[int, torch.Tensor] = {}

    async def client(seed: int) -> None:
        results[seed] = await server.infer(make_input(seed))

    async with anyio.create_task_group() as clients:
        for seed in range(6):
            clients.start_soon(client, seed)

    assert sorted(results) == list(range(6))
    for seed, result in results.items():
        assert_matches(result, reference(weights, make_input(seed)))
    assert_within_budgets(manager, {"cuda:0": "1536KiB"})
    await settled(manager)
    assert_quiet(manager)
