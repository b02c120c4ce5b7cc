"""The runtime on the simulated backend (a simulation of CUDA devices in host memory) with its
device events awaited through the CUDA backend's event waiter: ``SimBackend(waiter=...)``, whose
notifications a simulated driver (``SimNotifyDriver``) posts. So the waiter's strategies,
predictions, the loop's timed polls and the thread run under the randomized workload and weight
streaming, on CPU: every task ends, nothing is left behind, nothing waits forever."""

from __future__ import annotations

import anyio
import pytest
import torch
from _chaos import Chaos

from aresidency import ResidencyManager
from aresidency.backends import SimBackend
from aresidency.backends.cudadriver import CudaDriver, load_libc
from aresidency.backends.simdriver import SimNotifyDriver
from aresidency.backends.waiter import EventWaiter
from aresidency.integrations import stream_module

pytestmark = pytest.mark.anyio

BUDGETS = {"cuda:0": 6 * 8192 + 8192, "cuda:1": 4 * 8192, "pinned-host": 12 * 8192}
WAITERS = pytest.mark.parametrize("loop_timer", [True, False], ids=["loop timer", "thread polls"])


def sim(loop_timer: bool, **kwargs: object) -> tuple[SimBackend, EventWaiter, SimNotifyDriver]:
    driver = SimNotifyDriver()
    # A short safety sweep would hide a lost wake-up as a delay: make it long, so that a wait
    # nothing wakes shows as a test that does not end.
    waiter = EventWaiter("hybrid", loop_timer=loop_timer, driver=driver, safety_timeout_s=30.0)
    return SimBackend(waiter=waiter, **kwargs), waiter, driver  # type: ignore[arg-type]


def resolve(got: object) -> float:
    assert isinstance(got, list) and len(got) == 1, got
    return float(got[0])


@WAITERS
# 0.05 GB/s: copies as slow as the backend's estimate of them says; None: as fast as the host
# copies, which the estimate (20 GB/s) gets wrong, either way.
@pytest.mark.parametrize("gbps", [0.05, None], ids=["estimated", "misestimated"])
@pytest.mark.parametrize("seed", range(3))
async def test_random_tasks_through_the_waiter_end_and_leave_nothing_behind(
    seed: int, gbps: float | None, loop_timer: bool
) -> None:
    backend, waiter, _driver = sim(loop_timer, copy_gbps=gbps, chunk_bytes=2048)
    with anyio.fail_after(120):
        async with ResidencyManager(budgets=BUDGETS, backend=backend) as m:
            chaos = Chaos(m, 200 + seed)
            await chaos.run()
            await chaos.settle()
            for stream in (backend.current_stream("cuda:0"), backend.current_stream("cuda:1")):
                await backend.wait(backend.record_event(stream))
            assert not chaos.unexpected, chaos.describe_unexpected()
            assert chaos.verify_reads(resolve) > 0
            await chaos.verify_final()
            assert chaos.outcomes.get("done", 0) > 0
    # The waits went through the waiter: seen by its polls or its notifications.
    assert waiter.timer_hits + waiter.poll_hits + waiter.loop_hits + waiter.wakeups > 0
    assert (waiter.timer_hits > 0) == loop_timer
    assert backend.issued_late > 0  # pageable copies issued by a worker, watched from there
    assert waiter.pending_count() == 0


@WAITERS
@pytest.mark.parametrize("host", ["pinned-host", "pageable-host"])
async def test_streaming_through_the_waiter_is_bit_identical(host: str, loop_timer: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
    backend, waiter, _driver = sim(loop_timer, copy_gbps=0.2)
    with anyio.fail_after(120):
        async with ResidencyManager(budgets={"cuda:0": 3 * 20_000}, backend=backend) as m:
            streamed = stream_module(m, model, host=host)  # type: ignore[arg-type]
            for _ in range(3):
                with torch.no_grad():
                    assert torch.equal(await streamed(x), expected)
            await streamed.drain()
            await streamed.aclose()
            assert m.snapshot().location("cuda:0").used_bytes == 0
    assert (backend.issued_late > 0) == (host == "pageable-host")
    assert waiter.pending_count() == 0


class OtherDriver:
    """A driver that is not the simulated one (as the CUDA driver would be)."""

    def __init__(self) -> None:
        self.libc = load_libc()

    new_semaphore = CudaDriver.new_semaphore


def test_the_simulation_refuses_a_waiter_it_cannot_serve() -> None:
    with pytest.raises(TypeError, match="EventWaiter"):
        SimBackend(waiter="hybrid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be synchronized"):
        SimBackend(waiter=EventWaiter("blocking"))
    with pytest.raises(ValueError, match="SimNotifyDriver"):
        SimBackend(waiter=EventWaiter("hostfunc", driver=OtherDriver()))
    polling = EventWaiter("poll")
    assert SimBackend(waiter=polling).waiter is polling  # a polling waiter needs no driver


@pytest.mark.parametrize(
    "bad",
    [{"timer_poll_s": 0.0}, {"timer_poll_s": float("nan")}, {"timer_lead_s": -1e-6}],
)
def test_the_waiter_refuses_bad_timer_settings(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        EventWaiter("poll", **bad)  # type: ignore[arg-type]


async def test_the_default_waiter_polls_on_the_loop() -> None:
    """Without ``loop_timer``, waits begun on the loop are polled by the loop's own timer (the
    default since the CUDA suite passed with it); the thread polls only what it is given."""
    waiter = EventWaiter("hybrid", driver=SimNotifyDriver(), safety_timeout_s=30.0)
    backend = SimBackend(waiter=waiter, copy_gbps=0.05)
    with anyio.fail_after(60):
        async with ResidencyManager(backend=backend) as m:
            handles = [m.register(torch.arange(2048.0) + i, name=f"v{i}") for i in range(8)]
            for h in handles:
                await m.materialize(h, "cuda:0")
            stream = backend.current_stream("cuda:0")
            for _ in range(4):
                await backend.wait(backend.record_event(stream))
    assert waiter.timer_hits > 0
    assert waiter.pending_count() == 0
