"""SimBackend: the SIMULATED devices keep the CUDA backend's semantics on a CPU."""

from __future__ import annotations

import ctypes
import gc
import itertools
import threading
import time

import anyio
import pytest
import torch

from aresidency.backends import (
    FaultInjector,
    SimBackend,
    SimStream,
    TransferCancelledError,
    is_poisoned,
)
from aresidency.backends.memory import as_bytes
from aresidency.core.locations import Location

pytestmark = pytest.mark.anyio

LOCATIONS = ["pageable-host", "pinned-host", "cuda:0", "cuda:1"]


def _pattern(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A deterministic tensor whose every byte matters (bit-exact comparisons)."""
    if dtype == torch.bool:
        return torch.arange(numel) % 3 == 0
    raw = (torch.arange(numel * torch.empty((), dtype=dtype).element_size()) * 7 + 3) % 251
    out = raw.to(torch.uint8).view(dtype)
    if out.is_floating_point():
        out = torch.nan_to_num(out, nan=1.5, posinf=2.5, neginf=-2.5)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(as_bytes(a.contiguous()), as_bytes(b.contiguous()))


@pytest.fixture
async def sim():
    backend = SimBackend(num_devices=2, chunk_bytes=1000)
    backend.start()
    yield backend
    await backend.aclose()


def test_sim_is_named_a_simulation() -> None:
    backend = SimBackend()
    assert backend.name == "sim"
    assert backend.simulated is True
    assert "SIMULATION" in repr(backend)
    assert "simulated" in repr(backend.device_streams(0).compute)
    assert "simulated" in (SimBackend.__doc__ or "").lower()


def test_check_location_rejects_a_missing_device() -> None:
    backend = SimBackend(num_devices=2)
    backend.check_location(Location.parse("cuda:1"))
    backend.check_location(Location.parse("pinned-host"))
    with pytest.raises(ValueError, match="cuda:2"):
        backend.check_location(Location.parse("cuda:2"))
    assert backend.device_count() == 2


def test_staging_nbytes_is_configurable_and_zero_by_default() -> None:
    assert SimBackend().staging_nbytes() == 0
    assert SimBackend(staging_nbytes=64 << 20).staging_nbytes() == 64 << 20


@pytest.mark.parametrize(("src", "dst"), list(itertools.permutations(LOCATIONS, 2)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
async def test_copies_in_every_direction_are_bit_exact(
    sim: SimBackend, src: str, dst: str, dtype: torch.dtype
) -> None:
    # 3001 elements: several 1000-byte chunks plus a remainder for every dtype.
    data = _pattern(3001, dtype).reshape(3001)
    placed = sim.place(data, Location.parse(src))
    transfer = sim.copy(placed, Location.parse(src), Location.parse(dst))
    await transfer.wait()
    assert _same_bits(transfer.tensor, data)
    assert transfer.nbytes == data.numel() * data.element_size()
    assert _same_bits(placed, data), "the source is intact"
    if dst != "pageable-host":
        assert sim.owned_location(transfer.tensor) == Location.parse(dst)


async def test_non_contiguous_source_is_copied_by_value(sim: SimBackend) -> None:
    base = sim.place(_pattern(64, torch.float32).reshape(8, 8), Location.parse("cuda:0"))
    view = base.t()[2:6]
    transfer = sim.copy(view, Location.parse("cuda:0"), Location.parse("pageable-host"))
    await transfer.wait()
    assert torch.equal(transfer.tensor, view)
    assert transfer.tensor.is_contiguous()


async def test_destination_is_poisoned_until_the_copy_completes(sim: SimBackend) -> None:
    h2d = sim.device_streams(0).h2d
    h2d.sleep(0.1)
    src = torch.ones(100)
    transfer = sim.copy(src, Location.parse("pageable-host"), Location.parse("cuda:0"))
    assert bool(is_poisoned(transfer.tensor).all())
    await transfer.wait()
    assert torch.equal(transfer.tensor, src)


async def test_copy_waits_for_the_source_device_compute_stream(sim: SimBackend) -> None:
    src = sim.allocate((256,), torch.int32, "cuda:0")
    compute = sim.device_streams(0).compute
    compute.sleep(0.05)
    compute.submit(lambda: src.fill_(7))
    transfer = sim.copy(src, Location.parse("cuda:0"), Location.parse("pinned-host"))
    await transfer.wait()
    assert bool((transfer.tensor == 7).all())


async def test_copy_waits_for_wait_events(sim: SimBackend) -> None:
    src = sim.allocate((256,), torch.float32, "cuda:1")
    writer = sim.new_stream("cuda:1")
    writer.sleep(0.05)
    writer.submit(lambda: src.fill_(2.0))
    written = sim.record_event(writer)
    transfer = sim.copy(
        src, Location.parse("cuda:1"), Location.parse("cuda:0"), wait_events=[written]
    )
    await transfer.wait()
    assert bool((transfer.tensor == 2.0).all())


async def test_event_completes_only_when_its_stream_reaches_it(sim: SimBackend) -> None:
    stream = sim.current_stream(Location.parse("cuda:0"))
    assert isinstance(stream, SimStream)
    stream.sleep(0.1)
    start = time.perf_counter()
    event = sim.record_event(stream)
    assert not event.query()
    await sim.wait_event(event)
    assert event.query()
    assert time.perf_counter() - start >= 0.09


async def test_waiting_for_an_event_does_not_block_the_loop(sim: SimBackend) -> None:
    stream = sim.device_streams(1).compute
    stream.sleep(0.2)
    event = sim.record_event(stream)
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(ticker)
        await sim.wait_event(event)
        done = True
    assert ticks >= 10


async def test_stream_wait_orders_one_stream_after_another(sim: SimBackend) -> None:
    box = sim.allocate((4,), torch.float32, "cuda:0")
    first = sim.new_stream("cuda:0")
    second = sim.new_stream("cuda:0")
    first.sleep(0.05)
    first.submit(lambda: box.fill_(5.0))
    sim.stream_wait(second, sim.record_event(first))
    seen: list[torch.Tensor] = []
    second.submit(lambda: seen.append(box.clone()))
    await sim.wait_event(sim.record_event(second))
    assert torch.equal(seen[0], torch.full((4,), 5.0))


def test_host_locations_have_no_stream_and_complete_events() -> None:
    backend = SimBackend()
    assert backend.current_stream(Location.parse("pinned-host")) is None
    assert backend.record_event(None).query()
    with pytest.raises(TypeError):
        backend.stream_wait(None, backend.record_event(None))


async def test_free_poisons_storage_nan_for_floats_a5_otherwise(sim: SimBackend) -> None:
    floats = sim.place(torch.ones(10), Location.parse("cuda:0"))
    ints = sim.place(torch.ones(10, dtype=torch.int16), Location.parse("pinned-host"))
    sim.free(floats[2:4], Location.parse("cuda:0"))  # a view poisons the whole storage
    sim.free(ints, Location.parse("pinned-host"))
    assert bool(torch.isnan(floats).all())
    assert bool((as_bytes(ints) == 0xA5).all())
    assert bool(is_poisoned(ints).all())
    assert sim.owned_location(floats) is None


def test_free_leaves_a_users_own_pageable_tensor_alone() -> None:
    backend = SimBackend()
    mine = torch.ones(10)
    assert backend.place(mine, Location.parse("pageable-host")) is mine
    backend.free(mine, Location.parse("pageable-host"))
    assert torch.equal(mine, torch.ones(10))


@pytest.mark.parametrize("where", ["cuda:0", "pinned-host"])
def test_memory_dropped_without_free_is_forgotten_when_its_storage_dies(where: str) -> None:
    """A buffer dropped without ``free`` (its last reference gone) stops being this
    simulation's memory: the allocator gives its address to new host tensors, and a user's
    tensor there must read as the pageable host memory it is (else the runtime would hand it
    out uncopied as a cuda:0 tensor, and poison it on release). The memory is forgotten only
    once every tensor sharing its storage is gone, not when the first one is."""
    backend = SimBackend()
    loc = Location.parse(where)
    before = backend.memory_allocated("cuda:0")
    buffer = backend.allocate((4096,), torch.uint8, loc)
    alias = buffer.view(torch.float32)  # not a view with a ``_base``: shares the storage only
    ptr = buffer.data_ptr()
    del buffer
    gc.collect()
    assert backend.owned_location(alias) == loc  # the memory still lives
    assert backend.memory_allocated("cuda:0") == before + (4096 if loc.is_cuda else 0)
    del alias
    gc.collect()
    assert backend.memory_allocated("cuda:0") == before
    # The allocator may hand the address to the next host tensor (whether it does depends on
    # its free lists): stand for that tensor with one at the same address, never read.
    there = torch.frombuffer((ctypes.c_char * 4096).from_address(ptr), dtype=torch.uint8)
    assert there.data_ptr() == ptr
    assert backend.owned_location(there) is None
    assert backend.location_of(there) == Location.parse("pageable-host")


async def test_read_after_release_without_the_reader_event_sees_poison(sim: SimBackend) -> None:
    compute = sim.device_streams(0).compute
    loc = Location.parse("cuda:0")

    async def read_then_release(wait_for_reader: bool) -> torch.Tensor:
        tensor = sim.place(torch.full((8,), 3.0), loc)
        out: list[torch.Tensor] = []
        compute.sleep(0.05)
        compute.submit(lambda: out.append(tensor.clone()))
        reader = sim.record_event(compute)
        if wait_for_reader:
            await sim.wait_event(reader)
        sim.free(tensor, loc)
        await sim.wait_event(sim.record_event(compute))
        return out[0]

    assert bool(torch.isnan(await read_then_release(False)).all())
    assert torch.equal(await read_then_release(True), torch.full((8,), 3.0))


async def test_injected_transfer_failure_raises_from_wait_and_poisons_the_destination() -> None:
    faults = FaultInjector()
    faults.fail_transfer_at = 2
    sim = SimBackend(faults=faults)
    sim.start()
    try:
        src = sim.place(torch.arange(100, dtype=torch.float32), Location.parse("cuda:0"))
        ok = sim.copy(src, Location.parse("cuda:0"), Location.parse("pinned-host"))
        bad = sim.copy(src, Location.parse("cuda:0"), Location.parse("pageable-host"))
        await ok.wait()
        with pytest.raises(RuntimeError, match="injected transfer failure"):
            await bad.wait()
        assert bool(torch.isnan(bad.tensor).all())
        assert torch.equal(src, torch.arange(100, dtype=torch.float32)), "source intact"
        assert bad.event.query(), "its device work ran"
    finally:
        await sim.aclose()


async def test_injected_oom_is_raised_synchronously_by_copy() -> None:
    faults = FaultInjector()
    sim = SimBackend(faults=faults)
    sim.start()
    try:
        src = sim.place(torch.ones(10), Location.parse("cuda:0"))
        faults.oom_at_allocation = 1  # counted from now: the next allocation
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            sim.copy(src, Location.parse("cuda:0"), Location.parse("cuda:1"))
        again = sim.copy(src, Location.parse("cuda:0"), Location.parse("cuda:1"))
        await again.wait()
        assert torch.equal(again.tensor, torch.ones(10))
    finally:
        await sim.aclose()


async def test_cancel_stops_issuing_chunks_and_wait_raises_cancelled() -> None:
    sim = SimBackend(copy_gbps=0.001, chunk_bytes=1000)  # 1 us per byte: 1 ms per chunk
    sim.start()
    try:
        src = torch.ones(100_000, dtype=torch.uint8)  # 100 chunks, ~100 ms
        transfer = sim.copy(src, Location.parse("pageable-host"), Location.parse("cuda:0"))
        with anyio.fail_after(5):
            # Until the first chunk arrived (nothing signals a chunk: look at the destination).
            while bool(is_poisoned(transfer.tensor).all()):  # noqa: ASYNC110
                await anyio.sleep(0.001)
        transfer.cancel()
        start = time.perf_counter()
        with pytest.raises(TransferCancelledError):
            await transfer.wait()
        assert time.perf_counter() - start < 0.09
        assert bool(is_poisoned(transfer.tensor).any()), "chunks after the cancel never ran"
    finally:
        await sim.aclose()


async def test_aclose_fails_pending_waits_with_runtime_error() -> None:
    sim = SimBackend()
    sim.start()
    stream = sim.device_streams(0).compute
    stream.sleep(5.0)
    event = sim.record_event(stream)
    waiting, finished = anyio.Event(), anyio.Event()

    async def wait_for_the_event() -> None:
        try:
            waiting.set()  # the wait below is registered before this task first yields
            with pytest.raises(RuntimeError, match="closed"):
                await sim.wait_event(event)
        finally:
            finished.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait_for_the_event)
        await waiting.wait()
        await sim.aclose()
        with anyio.fail_after(1.0):
            await finished.wait()
    with pytest.raises(RuntimeError):
        sim.copy(torch.ones(1), Location.parse("pageable-host"), Location.parse("cuda:0"))


async def test_throttled_copies_in_both_directions_overlap() -> None:
    # 5 MB at 0.05 GB/s is ~100 ms per copy; h2d and d2h run on different streams.
    sim = SimBackend(copy_gbps=0.05, chunk_bytes=1 << 20)
    sim.start()
    try:
        host = torch.ones(5_000_000, dtype=torch.uint8)
        dev = sim.place(host, Location.parse("cuda:0"))

        async def up() -> None:
            await sim.copy(host, Location.parse("pageable-host"), Location.parse("cuda:0")).wait()

        async def down() -> None:
            await sim.copy(dev, Location.parse("cuda:0"), Location.parse("pageable-host")).wait()

        gc.collect()  # a full collection inside the timed part would take ~0.1 s here
        gc.disable()
        start = time.perf_counter()
        await up()
        await down()
        one_after_the_other = time.perf_counter() - start
        start = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(up)
            tasks.start_soon(down)
        both = time.perf_counter() - start
        assert both < 0.8 * one_after_the_other
    finally:
        gc.enable()
        await sim.aclose()


def test_place_returns_a_tensor_already_there_and_copies_otherwise() -> None:
    sim = SimBackend()
    user = torch.arange(6.0)
    on_dev = sim.place(user, Location.parse("cuda:1"))
    assert on_dev is not user and torch.equal(on_dev, user)
    assert sim.owned_location(on_dev) == Location.parse("cuda:1")
    assert sim.place(on_dev, Location.parse("cuda:1")) is on_dev
    assert sim.owned_location(user) is None
    back = sim.place(on_dev, Location.parse("pageable-host"))
    assert back is not on_dev and torch.equal(back, user)


def test_stream_work_runs_in_order_on_one_thread() -> None:
    stream = SimBackend().new_stream("cuda:0")
    seen: list[tuple[int, str]] = []
    for i in range(20):
        stream.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    stream.synchronize(timeout=5)
    assert [i for i, _ in seen] == list(range(20))
    assert len({name for _, name in seen}) == 1
    stream.close()


def test_an_idle_stream_keeps_no_reference_to_its_last_work_item() -> None:
    import gc
    import threading
    import time
    import weakref

    from aresidency.backends.sim import SimStream

    stream = SimStream("sim", 0, "test")
    try:
        tensor = torch.ones(16)
        ref = weakref.ref(tensor)
        ran = threading.Event()

        def work(t: torch.Tensor = tensor) -> None:
            t.add_(1)
            ran.set()

        stream.submit(work)
        del work, tensor
        assert ran.wait(5)
        deadline = time.monotonic() + 5
        while stream.queued and time.monotonic() < deadline:
            time.sleep(0.001)  # the worker finishes the item and goes idle
        gc.collect()
        assert ref() is None  # the idle worker holds nothing of the last item
    finally:
        stream.close()


def test_closing_a_stream_ends_the_simulated_kernel_it_is_running() -> None:
    """A stream closed while its worker runs a long simulated kernel (``sleep``) stops at
    once: the kernel ends, the work queued after it is dropped (its event never completes),
    and the worker has exited when ``close`` returns."""
    stream = SimStream("t", 0, "compute")
    stream.sleep(60.0)
    event = stream.record_event()
    started = time.monotonic()
    while not stream.queued or not stream._running:  # the worker is inside the sleep
        assert time.monotonic() - started < 10
        time.sleep(0.001)
    stream.close(join_timeout=30.0)
    assert stream._thread is not None and not stream._thread.is_alive()
    assert not event.query()
