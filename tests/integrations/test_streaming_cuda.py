"""Weight streaming on a real GPU (marked ``cuda``; skipped without one).

Bit for bit against the same model run entirely on the GPU (the same kernels: the packed
tensors keep their strides and a 512-byte alignment), and device memory: the peak of
``torch.cuda.max_memory_allocated`` during a streamed call stays within the manager's budget
plus the activations, and every byte comes back afterwards."""

from __future__ import annotations

import copy
from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from aresidency import ResidencyManager
from aresidency.backends import CudaBackend, EventWaiter
from aresidency.integrations import stream_module

from ._models import Net

pytestmark = [pytest.mark.anyio, pytest.mark.cuda]


def linear_stack(d: int, n: int, dtype: torch.dtype = torch.bfloat16) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(d, d, dtype=dtype) for _ in range(n)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.mul_(d**-0.5 * 3)
    return nn.Sequential(*layers)


def gpu_reference(model: nn.Module, *args: object) -> tuple[torch.Tensor, int]:
    """The model's output run entirely on the GPU, and the activations' peak bytes."""
    on_gpu = copy.deepcopy(model).to("cuda:0")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = on_gpu(*args)
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - base
    del on_gpu
    torch.cuda.synchronize()
    assert isinstance(out, torch.Tensor)
    return out, activations


def describe_waits(waiter: EventWaiter) -> str:
    """What the event waiter still watches (for a call that never ended)."""
    lines = [repr(waiter)]
    with waiter._cond:
        pending = list(waiter._pending)
    for p in pending:
        lines.append(f"  thread: key={p.key} seq={p.seq} armed={p.armed} done={p.event.query()}")
    for poller in waiter._loop_timers.values():
        if poller is not None:
            lines.append(f"  {poller!r} armed_for={poller.armed_for}")
            for w in poller.entries:
                lines.append(
                    f"    key={w.key} notified={w.notified} done={w.event.query()} "
                    f"poll_from={w.poll_from:.4f} deadline={w.deadline:.4f}"
                )
    return "\n".join(lines)


@pytest.mark.parametrize("loop_timer", [False, True], ids=["thread polls", "loop timer"])
@pytest.mark.parametrize("host", ["pinned-host", "pageable-host"])
async def test_sequential_is_bit_identical_and_within_budget_on_the_gpu(
    host: str, loop_timer: bool
) -> None:
    d, n = 2048, 12
    model = linear_stack(d, n)
    x = torch.randn(512, d, dtype=torch.bfloat16, device="cuda:0")
    expected, activations = gpu_reference(model, x)
    block = d * d * 2 + 512 * ((d * 2 + 511) // 512)
    budget = 3 * block
    before = torch.cuda.memory_allocated()
    waiter = EventWaiter("hybrid", loop_timer=loop_timer)
    backend = CudaBackend(waiter=waiter)
    async with ResidencyManager(budgets={"cuda:0": budget}, backend=backend) as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=2, host=host)  # type: ignore[arg-type]
        assert streamed.block_bytes == [block] * n
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.no_grad():
                # A call takes well under a second: one that does not end is a lost wake-up,
                # reported with what the waiter still watches.
                with anyio.move_on_after(30.0) as late:
                    y = await streamed(x)
                assert not late.cancelled_caught, describe_waits(waiter)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            assert torch.equal(y, expected)
            assert peak <= budget + activations, (peak, budget, activations)
            await streamed.drain()
        snap = m.snapshot()
        assert snap.location("cuda:0").peak_bytes <= budget
        assert snap.location("cuda:0").used_bytes == 0
        await streamed.aclose()
        del y
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


async def test_module_list_model_is_bit_identical_on_the_gpu() -> None:
    model = Net(d=256, n=6)
    x = torch.randn(64, 16, device="cuda:0")
    expected, activations = gpu_reference(model, x)
    async with ResidencyManager(backend="cuda") as m:
        probe = stream_module(m, copy.deepcopy(model), prefetch=0)
        budget = probe.resident_bytes + 2 * max(probe.block_bytes)
        await probe.aclose()
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="cuda") as m:
        streamed = stream_module(m, model, prefetch=2)
        # A first call runs the model in its worker thread, whose first matmul creates that
        # thread's cuBLAS handle and workspace (about 32 MiB, kept for the process's life, not
        # residency memory): warm it up, then measure the next call.
        with torch.no_grad():
            await streamed(x)
        await streamed.drain()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            y = await streamed(x)
        torch.cuda.synchronize()
        assert torch.equal(y, expected)
        assert torch.cuda.max_memory_allocated() - base <= budget + activations
        await streamed.drain()
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        await streamed.aclose()


async def test_checkpoint_source_is_bit_identical_on_the_gpu(tmp_path: Path) -> None:
    d, n = 1024, 8
    model = linear_stack(d, n)
    x = torch.randn(256, d, dtype=torch.bfloat16, device="cuda:0")
    expected, activations = gpu_reference(model, x)
    path = tmp_path / "stack.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with torch.device("meta"):
        skeleton = linear_stack(d, n)
    block = d * d * 2 + 2048
    budget = 3 * block
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="cuda") as m:
        streamed = stream_module(m, skeleton, prefetch=2, checkpoint=path)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            y = await streamed(x)
        torch.cuda.synchronize()
        assert torch.equal(y, expected)
        assert torch.cuda.max_memory_allocated() - base <= budget + activations
        await streamed.drain()
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        await streamed.aclose()


async def test_streaming_on_a_side_stream_orders_the_result_on_it() -> None:
    d, n = 1024, 6
    model = linear_stack(d, n)
    x = torch.randn(128, d, dtype=torch.bfloat16, device="cuda:0")
    expected, _ = gpu_reference(model, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    async with ResidencyManager(backend="cuda") as m:
        streamed = stream_module(m, model, prefetch=1, stream=side)
        with torch.no_grad():
            y = await streamed(x)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(y, expected)
        await streamed.aclose()
