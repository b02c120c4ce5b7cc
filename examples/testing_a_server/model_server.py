"""A small async model server built on aresidency: the worked example of docs/testing.md.

:class:`ModelServer` keeps a model's weights registered with a ``ResidencyManager`` (in pinned
host memory) and serves requests. Each request enters a scope whose plan reserves room for the
request's activations on the device and brings every weight there; the weights stay on the
device between requests (as REPLICABLE replicas of their host copies), so only the first
request, or one after an eviction, pays for the copies. The model (a stack of ``tanh(x @ W)``
layers) runs on the device's stream, ordered after the copies on the device; the request's task
awaits its completion without blocking the event loop.

What the server promises, and what ``test_model_server.py`` checks on aresidency's simulated
backend (a simulation of CUDA devices in host memory) through the aresidency pytest plugin:

* a model that can never fit in the device's budget is refused at once with
  :class:`ModelDoesNotFit` (HTTP would say 507), leaving nothing reserved or copied;
* a failed copy (a transfer error, an allocation the device refuses) is retried once; a second
  failure is :class:`Unavailable` (503), and either way nothing is left behind;
* a client that goes away (its request's task is cancelled) leaves nothing behind either: no
  reservation, no lease, no copy in flight; the server goes on serving;
* concurrent requests wait for room, first come first served, instead of failing, and the
  device never holds more than its budget.

Runs on a GPU too (``python examples/testing_a_server/model_server.py``: backend ``auto``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import torch

from aresidency import (
    Location,
    Materialize,
    MemoryReservation,
    ReplicaMode,
    ResidencyManager,
    ResidencyPlan,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    ValueHandle,
)
from aresidency.core.sizes import ByteSize, parse_nbytes


class ModelDoesNotFit(Exception):
    """The model and one request's activations can never fit in the device's budget."""


class Unavailable(Exception):
    """Bringing the weights to the device failed, and so did the retry."""


@dataclass
class ServerStats:
    """What the server did so far: requests served, copies retried, requests refused."""

    served: int = 0
    retried: int = 0
    refused: int = 0


class ModelServer:
    """Serves ``infer`` requests for one model (see the module docstring).

    State: ``manager``, ``handles`` (one REPLICABLE value per layer, registered at ``host``),
    ``device``, ``activation_bytes`` (reserved per request while it runs), ``retries``,
    ``stats``. Invariant: between requests the server holds no lease, hold or reservation;
    only the weights' materializations remain (on the host, and on the device once used).
    """

    def __init__(
        self,
        manager: ResidencyManager,
        weights: Sequence[torch.Tensor],
        *,
        device: str = "cuda:0",
        host: str = "pinned-host",
        activation_bytes: ByteSize = "1MiB",
        retries: int = 1,
        admission_timeout: float | None = 30.0,
    ) -> None:
        if not weights:
            raise ValueError("a model needs at least one weight matrix")
        self.manager = manager
        self.device = device
        self.activation_bytes = parse_nbytes(activation_bytes, "activation_bytes")
        self.retries = retries
        self.admission_timeout = admission_timeout
        self.stats = ServerStats()
        self._ids = itertools.count(1)
        # Registered at start-up: copying into pinned memory blocks the host once, here.
        self.handles: list[ValueHandle] = [
            manager.register(
                weight, name=f"layer{i}", replica_mode=ReplicaMode.REPLICABLE, location=host
            )
            for i, weight in enumerate(weights)
        ]

    def _plan(self, request_id: int) -> ResidencyPlan:
        return ResidencyPlan(
            reserve=[
                MemoryReservation(f"activations-{request_id}", self.device, self.activation_bytes)
            ],
            enter=[Materialize(handle, self.device) for handle in self.handles],
        )

    async def infer(self, x: torch.Tensor) -> torch.Tensor:
        """Run the model on ``x`` (a host tensor) and return the result on the host.

        Waits (the task parks; the loop runs on) for room on the device while other requests
        hold it, for the copies of the weights, and for the model's work on the device.
        Raises :class:`ModelDoesNotFit` or :class:`Unavailable` (see the module docstring),
        ``TimeoutError`` if no room was found within ``admission_timeout`` seconds.
        """
        request_id = next(self._ids)
        for attempt in itertools.count():
            try:
                async with self.manager.scope(
                    self._plan(request_id), timeout=self.admission_timeout
                ):
                    result = await self._run(x)
            except ResidencyPlanError as error:  # admission: it could never fit
                self.stats.refused += 1
                raise ModelDoesNotFit(str(error)) from error
            except ResidencyPlanExecutionError as error:  # a copy failed (nothing kept of it)
                if attempt >= self.retries:
                    self.stats.refused += 1
                    raise Unavailable(f"the weights could not be brought in: {error}") from error
                self.stats.retried += 1
                continue
            self.stats.served += 1
            return result
        raise AssertionError("unreachable")  # itertools.count() never ends

    async def _run(self, x: torch.Tensor) -> torch.Tensor:
        """Enqueue the model on the device's stream after the weights' copies; await it."""
        backend = self.manager.backend
        stream = backend.current_stream(Location.parse(self.device))
        outcome: list[torch.Tensor | BaseException] = []
        async with contextlib.AsyncExitStack() as leases:
            weights = [
                (await leases.enter_async_context(self.manager.acquire(h, self.device))).tensor
                for h in self.handles
            ]
            # On a GPU this enqueues kernels now; on the simulation the stream's worker thread
            # runs it later, after the copies: either way the leases' reader events, recorded
            # on the stream as the leases end, keep the weights until it has read them.
            backend.run_in_stream_order(stream, functools.partial(_forward, x, weights, outcome))
            done = backend.record_event(stream)
            del weights  # no reference may outlive the leases
        await backend.wait(done)
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        return result.cpu()


def _forward(
    x: torch.Tensor, weights: list[torch.Tensor], outcome: list[torch.Tensor | BaseException]
) -> None:
    """The model: ``tanh(x @ W)`` per layer, on the device the weights are on."""
    try:
        h = x.to(weights[0].device)
        for weight in weights:
            h = torch.tanh(h @ weight)
        outcome.append(h)
    except BaseException as error:  # raised to the request's task, not lost on a stream
        outcome.append(error)


async def main() -> None:
    """Serve a few requests concurrently on a GPU, or on the simulation without one."""
    weights = [torch.randn(512, 512) / 512**0.5 for _ in range(4)]  # 1 MiB each
    budgets = {"cuda:0": "6MiB", "pinned-host": "64MiB"}
    async with ResidencyManager(budgets=budgets, backend="auto") as manager:
        server = ModelServer(manager, weights, activation_bytes="1MiB")
        results: list[torch.Tensor] = []

        async def client(seed: int) -> None:
            x = torch.randn(8, 512, generator=torch.Generator().manual_seed(seed))
            results.append(await server.infer(x))

        async with anyio.create_task_group() as clients:
            for seed in range(8):
                clients.start_soon(client, seed)
        peak = manager.snapshot().location("cuda:0")
        print(f"{server.stats}; cuda:0 after the requests: {peak!r}")


if __name__ == "__main__":
    anyio.run(main)
