"""CudaBackend on a real GPU: copies in every direction, staging, exact pinned memory, event
waiting, fault injection, no loop blocking. Marked ``cuda``; skipped without a GPU. Every test
leak-checks device memory."""

from __future__ import annotations

import gc
import itertools
import time

import anyio
import pytest
import torch

from aresidency.backends import (
    STRATEGIES,
    CopyRequest,
    CudaBackend,
    EventWaiter,
    Transfer,
    TransferCancelledError,
    hostfunc_available,
    is_poisoned,
)
from aresidency.backends.bridge import LoopBridge
from aresidency.backends.cuda import copy_streams, on_stream
from aresidency.backends.memory import as_bytes
from aresidency.backends.polling import EventNotes
from aresidency.core.locations import Location

pytestmark = [pytest.mark.anyio, pytest.mark.cuda]

CHUNK = 1 << 20  # small staging chunks: sizes below cross several chunks
HOST_AND_DEVICE = ["pageable-host", "pinned-host", "cuda:0"]
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: roughly 0.1 s on current GPUs


def _pattern(numel: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.arange(numel) % 3 == 0
    raw = (torch.arange(numel * torch.empty((), dtype=dtype).element_size()) * 7 + 3) % 251
    out = raw.to(torch.uint8).view(dtype)
    if out.is_floating_point():
        out = torch.nan_to_num(out, nan=1.5, posinf=2.5, neginf=-2.5)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def _allocated() -> list[int]:
    return [torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())]


@pytest.fixture
async def backend():
    gc.collect()
    torch.cuda.synchronize()
    before = _allocated()
    b = CudaBackend(staging_chunk_bytes=CHUNK, staging_buffers=2)
    b.start()
    yield b
    await b.aclose()
    gc.collect()
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)
    assert _allocated() == before, "device memory leaked"


def _loc(name: str) -> Location:
    return Location.parse(name)


async def _until(predicate, timeout: float = 2.0) -> None:
    deadline = time.perf_counter() + timeout
    while not predicate():
        assert time.perf_counter() < deadline, "condition not reached in time"
        await anyio.sleep(0.001)


@pytest.mark.parametrize(("src", "dst"), list(itertools.permutations(HOST_AND_DEVICE, 2)))
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 1000, CHUNK // 2 + 7, 3 * CHUNK // 2 + 123])
async def test_copies_in_every_direction_are_bit_exact(
    backend: CudaBackend, src: str, dst: str, dtype: torch.dtype, numel: int
) -> None:
    data = _pattern(numel, dtype)
    placed = backend.place(data, _loc(src))
    transfer = backend.copy(placed, _loc(src), _loc(dst))
    await transfer.wait()
    out = transfer.tensor
    assert _same_bits(out, data)
    assert _same_bits(placed, data), "the source is intact"
    if dst == "cuda:0":
        assert out.device == torch.device("cuda", 0)
    elif dst == "pinned-host":
        assert out.is_pinned()
        assert out.untyped_storage().nbytes() == data.numel() * data.element_size()
    else:
        assert out.device.type == "cpu"
    backend.free(out, _loc(dst))
    backend.free(placed, _loc(src))


async def test_large_pageable_copies_go_through_the_staging_pool(backend: CudaBackend) -> None:
    data = _pattern(5 * CHUNK + 3, torch.uint8)
    up = backend.copy(data, _loc("pageable-host"), _loc("cuda:0"))
    assert "staged" in repr(up)
    await up.wait()
    down = backend.copy(up.tensor, _loc("cuda:0"), _loc("pageable-host"))
    assert "staged" in repr(down)
    await down.wait()
    assert _same_bits(down.tensor, data)
    assert backend.pool.h2d.jobs_run == 1 and backend.pool.d2h.jobs_run == 1
    assert backend.staging_nbytes() == 2 * 2 * CHUNK


async def test_non_contiguous_sources_are_copied_by_value(backend: CudaBackend) -> None:
    base = _pattern(4 * CHUNK, torch.uint8).view(2048, -1)
    view = base.t()[3:]
    for src in HOST_AND_DEVICE:
        placed = backend.place(base, _loc(src))
        piece = placed.t()[3:]
        for dst in HOST_AND_DEVICE:
            if dst == src:
                continue
            transfer = backend.copy(piece, _loc(src), _loc(dst))
            await transfer.wait()
            assert torch.equal(transfer.tensor.cpu(), view), (src, dst)
            backend.free(transfer.tensor, _loc(dst))
        backend.free(placed, _loc(src))


@pytest.fixture
async def no_arena():
    b = CudaBackend(staging_chunk_bytes=CHUNK, staging_buffers=2, pinned_arena_bytes=0)
    b.start()
    yield b
    await b.aclose()


async def test_pinned_destinations_are_exactly_sized_and_unpinned_on_free(
    no_arena: CudaBackend,
) -> None:
    backend = no_arena
    stats = getattr(torch.cuda, "host_memory_stats", None)
    host_before = stats().get("allocated_bytes.current") if stats else None
    for nbytes in (12_345, 3 * CHUNK + 5):  # pinned inline, pinned in a worker thread
        src = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda:0")
        pinned_before = backend.pinned.pinned_bytes
        transfer = backend.copy(src, _loc("cuda:0"), _loc("pinned-host"))
        await transfer.wait()
        out = transfer.tensor
        assert out.is_pinned()
        assert out.untyped_storage().nbytes() == nbytes
        assert backend.pinned.pinned_bytes - pinned_before == nbytes
        assert bool((out == 7).all())
        backend.free(out, _loc("pinned-host"))  # large ones are unlocked in a worker
        await _until(lambda out=out: not out.is_pinned())
        await _until(lambda before=pinned_before: backend.pinned.pinned_bytes == before)
    if stats:
        # Nothing went through torch's power-of-two pinned caching allocator.
        assert stats().get("allocated_bytes.current") == host_before


async def test_pinned_cache_reuses_exactly_sized_memory() -> None:
    b = CudaBackend(
        staging_chunk_bytes=CHUNK,
        staging_buffers=2,
        pinned_cache_bytes=8 << 20,
        pinned_arena_bytes=0,
    )
    b.start()
    try:
        assert b.staging_nbytes() == 4 * CHUNK + (8 << 20)
        src = torch.ones(3 * CHUNK, dtype=torch.uint8, device="cuda:0")
        first = b.copy(src, _loc("cuda:0"), _loc("pinned-host"))
        await first.wait()
        ptr = first.tensor.data_ptr()
        b.free(first.tensor, _loc("pinned-host"))
        del first
        gc.collect()
        await _until(lambda: b.pinned._cached_bytes == 3 * CHUNK)
        second = b.copy(src, _loc("cuda:0"), _loc("pinned-host"))
        await second.wait()
        assert second.tensor.data_ptr() == ptr and b.pinned.cache_hits == 1
        assert second.tensor.is_pinned() and bool((second.tensor == 1).all())
    finally:
        await b.aclose()


async def test_fresh_pinned_destinations_are_carved_from_the_arena_exactly_charged() -> None:
    b = CudaBackend(
        staging_chunk_bytes=CHUNK, pinned_arena_bytes=16 * CHUNK, arena_slab_bytes=4 * CHUNK
    )
    b.start()
    try:
        arena = b.arena
        assert arena is not None
        src = torch.arange(3 * CHUNK + 5, dtype=torch.uint8, device="cuda:0")  # own slab
        first = b.copy(src, _loc("cuda:0"), _loc("pinned-host"))
        await first.wait()
        assert first.route == "arena", "a miss got a new slab, registered in a worker"
        assert first.tensor.is_pinned() and torch.equal(first.tensor, src.cpu())
        assert arena.slabs_made >= 1 and arena.total_bytes >= 3 * CHUNK + 5
        del first
        gc.collect()  # its block returns to the slab
        await _until(lambda: not arena._growing and not arena.needs_growth())
        made = arena.slabs_made
        second = b.copy(src, _loc("cuda:0"), _loc("pinned-host"))
        await second.wait()
        out = second.tensor
        assert second.route == "arena" and arena.slabs_made == made, "carved, not registered"
        assert out.is_pinned() and out.untyped_storage().nbytes() == 3 * CHUNK + 5
        assert torch.equal(out, src.cpu())
        assert arena.value_bytes == 3 * CHUNK + 5
        assert b.pinned_overhead_bytes() == arena.total_bytes - (3 * CHUNK + 5)
        small = [b.copy(src[:1000], _loc("cuda:0"), _loc("pinned-host")) for _ in range(3)]
        for t in small:
            await t.wait()
        # The shared slab for small blocks comes from growth ahead too; every block is exact.
        assert all(t.tensor.untyped_storage().nbytes() == 1000 for t in small)
        assert all(torch.equal(t.tensor, src[:1000].cpu()) for t in small)
        b.free(out, _loc("pinned-host"))
        assert arena.value_bytes >= 3 * CHUNK + 5, "a block returns when its tensor dies"
        del out, second, small, t
        gc.collect()
        assert arena.value_bytes == 0, "every block came back"
        b.limit_pinned_overhead(0)  # the budget's headroom is gone: free slabs go
        await _until(lambda: arena.total_bytes == 0)
        b.limit_pinned_overhead(None)
        assert arena.limit_bytes == 16 * CHUNK
    finally:
        await b.aclose()
    assert arena.total_bytes == 0, "closing released every slab"


async def test_a_burst_of_fresh_pinned_destinations_is_carved_the_next_time() -> None:
    b = CudaBackend(
        staging_chunk_bytes=CHUNK, pinned_arena_bytes=64 * CHUNK, arena_slab_bytes=4 * CHUNK
    )
    b.start()
    try:
        arena = b.arena
        assert arena is not None
        srcs = [torch.full((3 * CHUNK,), i, dtype=torch.uint8, device="cuda:0") for i in range(8)]
        for burst in range(3):
            misses = arena.misses
            transfers = [b.copy(s, _loc("cuda:0"), _loc("pinned-host")) for s in srcs]
            for t in transfers:
                await t.wait()
            assert all(t.route == "arena" for t in transfers)
            for t, s in zip(transfers, srcs, strict=True):
                assert t.tensor.is_pinned() and torch.equal(t.tensor, s.cpu())
            if burst:
                assert arena.misses == misses, "every destination found a registered hole"
            else:  # the empty arena: new slabs (and some grown ahead meanwhile)
                assert arena.misses > misses and arena.total_bytes >= 8 * 3 * CHUNK
            del transfers, t
            gc.collect()
            assert arena.value_bytes == 0
            await _until(lambda: not arena._growing and not arena.needs_growth())
        assert arena.total_bytes <= 64 * CHUNK
    finally:
        await b.aclose()
    assert arena.total_bytes == 0


async def test_an_arena_block_outlives_the_manager_while_its_tensor_does() -> None:
    b = CudaBackend(staging_chunk_bytes=CHUNK, arena_slab_bytes=4 * CHUNK)
    b.start()
    src = torch.full((5000,), 3, dtype=torch.uint8, device="cuda:0")
    arena = b.arena
    assert arena is not None
    while True:
        transfer = b.copy(src, _loc("cuda:0"), _loc("pinned-host"))
        await transfer.wait()
        if transfer.route == "arena":
            break
        await _until(lambda: arena.total_bytes > 0)
    kept = transfer.tensor
    await b.aclose()
    assert kept.is_pinned() and bool((kept == 3).all()), "still registered, still readable"
    assert arena.total_bytes > 0
    del kept, transfer
    gc.collect()
    assert arena.total_bytes == 0, "the last block released its slab"


@pytest.mark.parametrize(
    ("threads", "streaming"), [(1, True), (4, True), (4, False)], ids=["1", "4", "4-plain"]
)
async def test_device_to_pageable_staging_with_parallel_memcpy_and_mapped_destinations(
    threads: int, streaming: bool
) -> None:
    b = CudaBackend(
        staging_chunk_bytes=4 * CHUNK,
        staging_buffers=3,
        staging_memcpy_threads=threads,
        staging_streaming_stores=streaming,
        pageable_mmap_bytes=CHUNK,
    )
    b.start()
    try:
        for nbytes in (CHUNK - 1, 4 * CHUNK, 13 * CHUNK + 7):
            src = _pattern(nbytes, torch.uint8).to("cuda:0")
            transfer = b.copy(src, _loc("cuda:0"), _loc("pageable-host"))
            await transfer.wait()
            assert transfer.route == "staged"
            out = transfer.tensor
            assert not out.is_pinned() and out.is_contiguous()
            assert _same_bits(out, src)
    finally:
        await b.aclose()


async def test_small_copies_complete_whatever_path_sees_them(backend: CudaBackend) -> None:
    src = torch.ones(1024, device="cuda:0")
    for _ in range(5):
        transfer = backend.copy(src, _loc("cuda:0"), _loc("pinned-host"))
        await transfer.wait()
        assert bool((transfer.tensor == 1).all())


async def test_an_event_due_soon_is_seen_by_polling_on_the_loop(backend: CudaBackend) -> None:
    # A real event, pending when watched (a 2 ms kernel before it), that the backend expects
    # within the loop-polling window: the loop's own polls see it, no thread hop.
    waiter = backend.waiter
    waiter.loop_poll_s = 0.05
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(4_000_000)  # about 2 ms
    event = backend.record_event(stream)
    notes = EventNotes.of(event)
    assert notes is not None
    notes.expected_at = time.monotonic() + 0.02  # due well before the window closes
    hits = waiter.loop_hits
    outcome: list[BaseException | None] = []
    done = anyio.Event()

    def seen(error: BaseException | None) -> None:
        outcome.append(error)
        done.set()

    waiter.watch(event, LoopBridge(), seen)
    assert not outcome, "never called back inside watch()"
    with anyio.fail_after(10):
        await done.wait()
    assert outcome == [None]
    assert event.query()
    assert waiter.loop_hits == hits + 1, "seen by a poll on the loop"


async def test_copy_waits_for_the_source_devices_current_stream(backend: CudaBackend) -> None:
    for dst in ("pageable-host", "pinned-host", "cuda:0"):
        src = torch.zeros(2 * CHUNK + 1, dtype=torch.int32, device="cuda:0")
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        src.fill_(3)  # on the current stream, after the sleep
        transfer = backend.copy(src, _loc("cuda:0"), _loc(dst))
        await transfer.wait()
        assert bool((transfer.tensor == 3).all()), dst
        backend.free(transfer.tensor, _loc(dst))


async def test_copy_waits_for_wait_events_and_consumers_wait_on_wait_issued(
    backend: CudaBackend,
) -> None:
    writer = torch.cuda.Stream()
    src = torch.empty(CHUNK, dtype=torch.float32, device="cuda:0")
    with torch.cuda.stream(writer):
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        src.fill_(2.0)
    written = backend.record_event(writer)
    transfer = backend.copy(src, _loc("cuda:0"), _loc("pinned-host"), wait_events=[written])
    back = backend.copy(
        transfer.tensor,
        _loc("pinned-host"),
        _loc("cuda:0"),
        wait_events=[await transfer.wait_issued()],
    )
    consumer = torch.cuda.Stream()
    backend.stream_wait(consumer, await back.wait_issued())
    with torch.cuda.stream(consumer):
        total = back.tensor.sum()
    reader = backend.record_event(consumer)
    await backend.wait_event(reader)
    assert total.item() == 2.0 * CHUNK
    await back.wait()
    src.record_stream(writer)


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_waiting_for_an_event_parks_the_task_without_blocking_the_loop(
    strategy: str,
) -> None:
    if strategy in ("hybrid", "hostfunc") and not hostfunc_available():
        pytest.skip("cuLaunchHostFunc is unavailable")
    b = CudaBackend(waiter=strategy, staging_chunk_bytes=CHUNK, staging_buffers=1)
    b.start()
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.sleep(0.002)

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ticker)
            try:
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(SLEEP_CYCLES)
                event = b.record_event(stream)
                assert not event.query()
                with anyio.fail_after(10.0):
                    await b.wait_event(event)
                assert event.query()
                # An event recorded by the caller rather than the backend is awaited as well.
                foreign = torch.cuda.Event()
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(SLEEP_CYCLES // 4)
                foreign.record(stream)
                with anyio.fail_after(10.0):
                    await b.wait_event(foreign)
                assert foreign.query()
                assert b.waiter.strategy == strategy and b.waiter.degraded is None
            finally:
                done = True
    finally:
        await b.aclose()
    assert ticks >= 10, "the loop kept running while the task waited"


@pytest.mark.parametrize("loop_timer", [False, True], ids=["thread polls", "loop timer"])
async def test_hybrid_catches_regular_waits_by_polling_near_their_predicted_end(
    loop_timer: bool,
) -> None:
    """Back-to-back waits of a few ms on one stream: after the first, the hybrid waiter
    predicts their end, polls there and enqueues no notification for the waits it catches:
    the thread's polls, or with ``loop_timer`` the loop's own (the thread's see none)."""
    if not hostfunc_available():
        pytest.skip("cuLaunchHostFunc is unavailable")
    b = CudaBackend(
        waiter=EventWaiter("hybrid", loop_timer=loop_timer),
        staging_chunk_bytes=CHUNK,
        staging_buffers=1,
    )
    b.start()
    try:
        stream = torch.cuda.Stream()
        for _ in range(12):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES // 50)
            event = b.record_event(stream)
            with anyio.fail_after(10.0):
                await b.wait_event(event)
            assert event.query()
        waiter = b.waiter
        if loop_timer:
            assert waiter.timer_hits >= 6, (waiter.timer_hits, waiter.predictor)
            assert waiter.poll_hits == 0
        else:
            assert waiter.poll_hits >= 6, (waiter.poll_hits, waiter.predictor)
            assert waiter.timer_hits == 0
        assert waiter.degraded is None
    finally:
        await b.aclose()


async def test_many_concurrent_waits_on_several_streams_all_resolve(backend: CudaBackend) -> None:
    streams = [torch.cuda.Stream() for _ in range(4)]
    events = []
    for _ in range(5):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                torch.cuda._sleep(SLEEP_CYCLES // (50 * (i + 1)))
            events.append(backend.record_event(s))
    # Awaited in reverse record order: later events must not hide earlier ones.
    with anyio.fail_after(10.0):
        async with anyio.create_task_group() as waits:
            for e in reversed(events):
                waits.start_soon(backend.wait_event, e)
    assert all(e.query() for e in events)


@pytest.mark.parametrize(
    ("src", "dst", "numel"),
    [
        ("pinned-host", "cuda:0", 1000),
        ("pageable-host", "cuda:0", 3 * CHUNK),
        ("cuda:0", "pinned-host", 1000),
        ("cuda:0", "pinned-host", 3 * CHUNK),
        ("cuda:0", "pageable-host", 3 * CHUNK),
        ("cuda:0", "cuda:0", 1000),
        ("pageable-host", "pinned-host", 1000),
    ],
)
async def test_injected_transfer_failure_poisons_the_destination_and_keeps_the_source(
    backend: CudaBackend, src: str, dst: str, numel: int
) -> None:
    data = torch.arange(numel, dtype=torch.float32)
    placed = backend.place(data, _loc(src))
    backend.faults.fail_transfer_at = 1
    transfer = backend.copy(placed, _loc(src), _loc(dst))
    with pytest.raises(RuntimeError, match="injected transfer failure"):
        await transfer.wait()
    assert bool(is_poisoned(transfer.tensor).all())
    assert torch.equal(placed.cpu(), data)
    again = backend.copy(placed, _loc(src), _loc(dst))
    await again.wait()
    assert torch.equal(again.tensor.cpu(), data)
    for t, loc in ((transfer.tensor, dst), (again.tensor, dst), (placed, src)):
        backend.free(t, _loc(loc))


async def test_injected_oom_is_raised_synchronously(backend: CudaBackend) -> None:
    src = torch.ones(100, device="cuda:0")
    backend.faults.oom_at_allocation = 1
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        backend.copy(src, _loc("cuda:0"), _loc("pinned-host"))
    ok = backend.copy(src, _loc("cuda:0"), _loc("pinned-host"))
    await ok.wait()
    backend.free(ok.tensor, _loc("pinned-host"))


async def test_cancel_stops_a_staged_copy(backend: CudaBackend) -> None:
    data = torch.ones(64 * CHUNK, dtype=torch.uint8)
    transfer = backend.copy(data, _loc("pageable-host"), _loc("cuda:0"))
    transfer.cancel()
    with pytest.raises(TransferCancelledError):
        await transfer.wait()
    event = await transfer.wait_issued()
    assert event.query(), "enqueued chunks completed before wait returned"


async def test_large_copies_do_not_block_the_loop() -> None:
    b = CudaBackend()  # default 32 MiB chunks
    b.start()
    n = 256 << 20
    host = torch.ones(n, dtype=torch.uint8)
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await anyio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    gc.collect()
    gc.disable()  # a full collection would stall the loop by itself
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ticker)
            try:
                await anyio.sleep(0.01)  # the ticker has ticked a few times
                start = time.perf_counter()
                up = b.copy(host, _loc("pageable-host"), _loc("cuda:0"))
                issue_s = time.perf_counter() - start
                await up.wait()
                down = b.copy(up.tensor, _loc("cuda:0"), _loc("pageable-host"))
                pinned = b.copy(up.tensor, _loc("cuda:0"), _loc("pinned-host"))
                async with anyio.create_task_group() as copies:
                    copies.start_soon(down.wait)
                    copies.start_soon(pinned.wait)
            finally:
                done = True
    finally:
        gc.enable()
    try:
        assert bool((down.tensor == 1).all()) and bool((pinned.tensor == 1).all())
        b.free(pinned.tensor, _loc("pinned-host"))
    finally:
        await b.aclose()
    # Generous bounds: they catch a copy done on the loop (tens to hundreds of ms), not speed.
    assert issue_s < 0.05
    assert max(gaps) < 0.05, f"the loop stalled for {max(gaps) * 1e3:.1f} ms"


async def test_both_directions_at_once_are_correct(backend: CudaBackend) -> None:
    up_data = _pattern(6 * CHUNK + 5, torch.uint8)
    dev = backend.place(_pattern(5 * CHUNK + 9, torch.uint8), _loc("cuda:0"))
    up = backend.copy(up_data, _loc("pageable-host"), _loc("cuda:0"))
    down = backend.copy(dev, _loc("cuda:0"), _loc("pageable-host"))
    async with anyio.create_task_group() as copies:
        copies.start_soon(up.wait)
        copies.start_soon(down.wait)
    assert _same_bits(up.tensor, up_data)
    assert _same_bits(down.tensor, dev)


async def test_aclose_fails_pending_waits() -> None:
    b = CudaBackend(staging_chunk_bytes=CHUNK, staging_buffers=1)
    b.start()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    event = b.record_event(stream)
    waiting, finished = anyio.Event(), anyio.Event()

    async def wait_for_the_event() -> None:
        try:
            waiting.set()  # the wait below is registered before this task first yields
            with pytest.raises(RuntimeError, match="closed"):
                await b.wait_event(event)
        finally:
            finished.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait_for_the_event)
        await waiting.wait()
        await b.aclose()
        with anyio.fail_after(5.0):
            await finished.wait()
    stream.synchronize()


def test_check_location_and_host_streams() -> None:
    b = CudaBackend(staging_chunk_bytes=CHUNK, staging_buffers=1)
    n = torch.cuda.device_count()
    b.check_location(_loc(f"cuda:{n - 1}"))
    with pytest.raises(ValueError, match=f"cuda:{n}"):
        b.check_location(_loc(f"cuda:{n}"))
    assert b.current_stream(_loc("pageable-host")) is None
    assert b.record_event(None).query()
    assert b.name == "cuda" and not b.simulated


def test_on_stream_sets_and_restores_the_threads_stream_and_device() -> None:
    """The backend's cheap replacement for ``torch.cuda.device`` + ``torch.cuda.stream``:
    kernels inside go to the stream, and the thread's stream and device come back after the
    block, after an error too."""
    stream = copy_streams(0).h2d
    before = torch.cuda.current_stream(0)
    with on_stream(stream):
        assert torch.cuda.current_stream(0) == stream
        assert torch.cuda.current_device() == 0
        torch.cuda._sleep(SLEEP_CYCLES)  # goes to our stream, not the default one
    assert not stream.query() and before.query()
    stream.synchronize()
    assert torch.cuda.current_stream(0) == before
    with pytest.raises(KeyError), on_stream(stream):
        raise KeyError("inside")
    assert torch.cuda.current_stream(0) == before
    # A user's stream current before the block is the one current after it.
    mine = torch.cuda.Stream(0)
    with torch.cuda.stream(mine):
        with on_stream(stream):
            assert torch.cuda.current_stream(0) == stream
        assert torch.cuda.current_stream(0) == mine
    assert torch.cuda.current_stream(0) == before


@pytest.mark.cuda2
def test_on_stream_of_another_device_restores_the_current_device() -> None:
    torch.cuda.set_device(0)
    before = [torch.cuda.current_stream(i) for i in (0, 1)]
    s0, s1 = copy_streams(0).peer, copy_streams(1).peer
    with on_stream(s0), on_stream(s1):
        assert torch.cuda.current_device() == 1
        assert torch.cuda.current_stream(0) == s0 and torch.cuda.current_stream(1) == s1
    assert torch.cuda.current_device() == 0
    assert [torch.cuda.current_stream(i) for i in (0, 1)] == before


@pytest.mark.cuda2
async def test_peer_copies_are_bit_exact_and_ordered(backend: CudaBackend) -> None:
    for i, j in ((0, 1), (1, 0)):
        src = torch.zeros(3 * CHUNK + 1, dtype=torch.int32, device=f"cuda:{i}")
        with torch.cuda.device(i):
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            src.fill_(5 + i)
        transfer = backend.copy(src, _loc(f"cuda:{i}"), _loc(f"cuda:{j}"))
        assert transfer.tensor.device == torch.device("cuda", j)
        await transfer.wait()
        assert bool((transfer.tensor == 5 + i).all())
        data = _pattern(2 * CHUNK + 3, torch.bfloat16)
        a = backend.place(data, _loc(f"cuda:{i}"))
        b = backend.copy(a, _loc(f"cuda:{i}"), _loc(f"cuda:{j}"))
        await b.wait()
        assert _same_bits(b.tensor, data)


async def test_copy_into_waits_on_the_device_for_the_previous_reader(backend: CudaBackend) -> None:
    """copy_into (the streaming ring's copy): into memory the caller owns, on the copy stream,
    after the events given, without the host waiting. A reader that still runs (a 0.1 s
    kernel) must see the old data: the new copy waits for its event on the device."""
    device = Location.parse("cuda:0")
    old = _pattern(1 << 20, torch.uint8).pin_memory()
    new = (old + 1).pin_memory()
    dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
    first = backend.copy_into(old, dst, device)
    reader = torch.cuda.Stream()
    reader.wait_event(first)
    with torch.cuda.stream(reader):
        torch.cuda._sleep(SLEEP_CYCLES)
        seen = dst.clone()  # reads the old data, after the sleep
    read = backend.device_event(reader)
    start = time.perf_counter()
    second = backend.copy_into(new, dst, device, wait_events=[read])
    assert time.perf_counter() - start < 0.05  # the host did not wait for the reader
    assert not second.query()  # still behind the reader's kernel
    await backend.wait_event(second)
    assert _same_bits(seen, old)
    assert _same_bits(dst, new)
    backend.faults.fail_transfer_at = 1  # the next transfer
    with pytest.raises(RuntimeError, match="injected"):
        backend.copy_into(new, dst, device)
    with pytest.raises(ValueError, match="host memory to a device"):
        backend.copy_into(dst[:16].clone(), dst[:16], device)
    # A pageable source (the loader's ring): also after the reader, on the device; the call
    # returns once the driver took the bytes, so the source may change at once.
    with torch.cuda.stream(reader):
        torch.cuda._sleep(SLEEP_CYCLES)
        seen = dst.clone()
    read = backend.device_event(reader)
    pageable = _pattern(1 << 20, torch.uint8) + 7
    expected = pageable.clone()
    assert not pageable.is_pinned()
    third = backend.copy_into(pageable, dst, device, wait_events=[read])
    pageable.zero_()
    await backend.wait_event(third)
    assert _same_bits(seen, new)
    assert _same_bits(dst, expected)
    del seen, dst
    torch.cuda.synchronize()


async def test_copy_many_issues_pinned_copies_together_and_each_fails_alone(
    backend: CudaBackend,
) -> None:
    """Consecutive pinned-to-device copies share one event; a pageable one in between takes
    its own route; an injected allocation failure and an injected transfer failure each
    fail their own request only; every other destination holds its source exactly."""
    pinned = [
        backend.place(_pattern(4096 + i, torch.float32), _loc("pinned-host")) for i in range(6)
    ]
    pageable = _pattern(3 * CHUNK + 5, torch.uint8)
    requests = [CopyRequest(t, _loc("pinned-host"), _loc("cuda:0")) for t in pinned[:3]]
    requests.append(CopyRequest(pageable, _loc("pageable-host"), _loc("cuda:0")))
    requests += [CopyRequest(t, _loc("pinned-host"), _loc("cuda:0")) for t in pinned[3:]]
    backend.faults.oom_at_allocation = 2  # the second request's destination
    backend.faults.fail_transfer_at = 4  # the fourth transfer made: request 4
    out = backend.copy_many(requests)
    assert isinstance(out[1], torch.OutOfMemoryError)
    transfers = [t for t in out if isinstance(t, Transfer)]
    assert len(transfers) == 6
    assert out[0].event is out[2].event, "the first group shares one event"  # type: ignore[union-attr]
    assert out[4].event is out[5].event is out[6].event  # type: ignore[union-attr]
    assert out[3].route == "staged"  # type: ignore[union-attr]
    for i, request in enumerate(requests):
        result = out[i]
        if not isinstance(result, Transfer):
            continue
        if i == 4:
            with pytest.raises(RuntimeError, match="injected transfer failure"):
                await result.wait()
            continue
        await result.wait()
        assert _same_bits(result.tensor.cpu(), request.src)
        backend.free(result.tensor, _loc("cuda:0"))


async def test_copy_many_fails_each_copy_of_a_group_whose_event_cannot_be_recorded(
    backend: CudaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording the group's event fails (a driver error): every copy of the group completes
    with that error, and the backend goes on."""
    pinned = [backend.place(_pattern(1024, torch.float32), _loc("pinned-host")) for _ in range(3)]
    requests = [CopyRequest(t, _loc("pinned-host"), _loc("cuda:0")) for t in pinned]

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("event record failed")

    with monkeypatch.context() as patch:
        patch.setattr(backend, "_record", broken)
        out = backend.copy_many(requests)
    for transfer in out:
        assert isinstance(transfer, Transfer)
        with pytest.raises(RuntimeError, match="event record failed"):
            await transfer.wait()
    torch.cuda.synchronize()  # the copies themselves were enqueued: let them finish
    again = backend.copy_many(requests[:1])[0]
    assert isinstance(again, Transfer)
    await again.wait()
    assert _same_bits(again.tensor.cpu(), pinned[0])


async def test_copies_note_the_bytes_queued_before_them_and_each_wait_is_estimated_again(
    backend: CudaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each copy's event carries the bytes enqueued on its copy stream up to it (the copies of
    one ``copy_many`` group share the group's), and a wait that begins once most of the queue
    is done expects only what remains, not what the whole queue would take at the assumed
    rate. (The rate is set to a tenth of the link's here, so that the two differ by
    milliseconds; the last copy waits behind a kernel so that it is still pending.)"""
    from aresidency.backends import cuda as cuda_module

    rate = 5e9
    monkeypatch.setattr(cuda_module, "_LINK_BYTES_PER_S", rate)
    size = 4 << 20
    sources = [
        backend.place(_pattern(size // 4, torch.float32), _loc("pinned-host")) for _ in range(12)
    ]
    singles = [backend.copy(s, _loc("pinned-host"), _loc("cuda:0")) for s in sources[:7]]
    with on_stream(copy_streams(0).h2d):
        torch.cuda._sleep(SLEEP_CYCLES)  # the last copy stays pending behind it
    last = backend.copy(sources[7], _loc("pinned-host"), _loc("cuda:0"))
    group = backend.copy_many(
        [CopyRequest(s, _loc("pinned-host"), _loc("cuda:0")) for s in sources[8:]]
    )
    notes = [EventNotes.of(t.event) for t in (*singles, last)]  # type: ignore[union-attr]
    queued = [n.queued for n in notes if n is not None]
    assert [b - a for a, b in itertools.pairwise(queued)] == [size] * 7
    shared = EventNotes.of(group[0].event)  # type: ignore[union-attr]
    assert shared is not None and shared.queued == queued[-1] + 4 * size
    assert all(t.event is group[0].event for t in group)  # type: ignore[union-attr]
    issued_at = notes[-1].expected_at  # type: ignore[union-attr]
    singles[-1].event.synchronize()  # type: ignore[union-attr]
    assert not last.event.query()  # type: ignore[union-attr]
    before = time.monotonic()
    await last.wait()
    expected = notes[-1].expected_at  # type: ignore[union-attr]
    assert expected is not None and issued_at is not None
    assert expected <= before + size / rate + 1e-3, "only the last copy's bytes remained"
    assert issued_at - expected > 2e-3, "the estimate at issue counted the whole queue"
    for t in (*singles, last, *group):
        await t.wait()  # type: ignore[union-attr]
        backend.free(t.tensor, _loc("cuda:0"))  # type: ignore[union-attr]
