"""The pinned arena's carving, on the CPU with a fake registry (the driver's rules), and on the
GPU with cudaHostRegister (marked cuda)."""

from __future__ import annotations

import gc
import itertools
import random

import pytest
import torch
from _registry import FakeRegistry

from aresidency.backends.arena import ALIGN, PinnedArena

SLAB = 1 << 20


def _arena(registry: FakeRegistry, **kwargs: object) -> PinnedArena:
    return PinnedArena(registry.register, registry.unregister, slab_bytes=SLAB, **kwargs)  # type: ignore[arg-type]


def _check_tiling(arena: PinnedArena) -> None:
    """Free lists tile each slab with the live blocks: free + carved == total."""
    free = sum(length for slab in arena._slabs for _, length in slab.free)
    assert free + arena.carved_bytes == arena.total_bytes
    for slab in arena._slabs:
        ends = [(o, o + n) for o, n in slab.free]
        assert ends == sorted(ends)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(ends)), "merged"


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((), torch.float64), ((0, 4), torch.float32), ((7,), torch.uint8), ((2, 3, 5), torch.int16)],
)
def test_a_carved_tensor_has_the_shape_dtype_and_bytes_asked_for(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    arena = _arena(FakeRegistry())
    t = arena.carve(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    nbytes = t.numel() * t.element_size()
    assert arena.value_bytes == nbytes
    if nbytes:
        t.fill_(3)
        assert bool((t == 3).all())
    del t
    gc.collect()
    assert arena.value_bytes == 0


def test_blocks_are_exact_aligned_and_reused_after_their_tensor_dies() -> None:
    registry = FakeRegistry()
    arena = _arena(registry)
    assert arena.try_carve((100,), torch.float32) is None, "an empty arena registers nothing"
    a = arena.carve((100,), torch.float32)
    assert a.shape == (100,) and a.untyped_storage().nbytes() == 400
    assert a.data_ptr() % ALIGN == 0
    assert len(registry.ranges) == 1 and arena.total_bytes == SLAB
    assert arena.value_bytes == 400 and arena.free_bytes() == SLAB - 400
    b = arena.try_carve((3, 5), torch.bfloat16)
    assert b is not None and b.data_ptr() == a.data_ptr() + 2 * ALIGN, (
        "packed after a (400 B -> 512)"
    )
    a.fill_(1.5)
    b.fill_(2)
    assert bool((a == 1.5).all()) and bool((b == 2).all()), "blocks do not overlap"
    ptr = a.data_ptr()
    view = a[10:20]
    del a
    gc.collect()
    assert arena.value_bytes == 400 + 30, "a view keeps the block"
    del view
    gc.collect()
    assert arena.value_bytes == 30
    again = arena.try_carve((100,), torch.float32)
    assert again is not None and again.data_ptr() == ptr, "best fit reuses the hole"
    _check_tiling(arena)
    del again, b
    gc.collect()
    assert arena.value_bytes == 0 and arena.carved_bytes == 0
    assert arena.trim() == SLAB and registry.ranges == {}


def test_large_requests_get_their_own_slab_and_growth_respects_the_limit() -> None:
    registry = FakeRegistry()
    arena = _arena(registry, limit_bytes=3 * SLAB)
    big = arena.carve((SLAB,), torch.uint8)  # half a slab or more: a slab of its own
    assert arena.total_bytes == 2 << 20, "rounded up to 2 MiB"
    assert arena.needs_growth() is False, "a second 2 MiB slab would pass the 3 MiB limit"
    with pytest.raises(torch.OutOfMemoryError, match="limit"):
        arena.carve((2 * SLAB,), torch.uint8)
    assert arena.total_bytes == 2 << 20, "the refused carve changed nothing"
    small = arena.carve((1000,), torch.uint8)  # fits the 1 MiB hole of the big slab
    assert arena.total_bytes == 2 << 20 and small.data_ptr() == big.data_ptr() + SLAB
    del big, small
    gc.collect()
    arena.set_limit(0)
    assert arena.total_bytes == 0 and registry.ranges == {}, "free slabs past the limit go"


def test_grow_ahead_keeps_a_hole_for_the_largest_recent_request() -> None:
    registry = FakeRegistry()
    arena = _arena(registry, limit_bytes=8 * SLAB)
    first = arena.carve((3 * SLAB,), torch.uint8)
    assert arena.needs_growth(), "no hole holds another 3 MiB"
    assert arena.grow_ahead()
    assert not arena.needs_growth()
    made = arena.slabs_made
    second = arena.try_carve((3 * SLAB,), torch.uint8)
    assert second is not None and arena.slabs_made == made, "carved, not registered"
    del first, second
    gc.collect()
    assert arena.value_bytes == 0
    arena.close()
    assert registry.ranges == {}


def test_one_growth_covers_a_whole_burst_of_misses() -> None:
    """Twelve concurrent requests of a slab each found no hole (they were registered on their
    own); one growth adds room for all of them, so the next burst is carved entirely, small
    misses sharing slabs."""
    registry = FakeRegistry()
    arena = _arena(registry, limit_bytes=64 * SLAB)
    burst = [arena.try_carve((SLAB,), torch.uint8) for _ in range(12)]
    small = [arena.try_carve((SLAB // 4,), torch.uint8) for _ in range(6)]
    assert burst == [None] * 12 and small == [None] * 6 and arena.misses == 18
    assert arena.needs_growth()
    assert arena.grow_ahead()
    # twelve 2 MiB slabs of their own, then 6 x 256 KiB in two shared 1 MiB slabs
    assert arena.slabs_made == 14 and arena.total_bytes == 12 * (2 << 20) + 2 * SLAB
    assert not arena.needs_growth()
    made = arena.slabs_made
    again = [arena.try_carve((SLAB,), torch.uint8) for _ in range(12)]
    again_small = [arena.try_carve((SLAB // 4,), torch.uint8) for _ in range(6)]
    assert all(t is not None for t in again + again_small) and arena.slabs_made == made
    _check_tiling(arena)
    del again, again_small
    gc.collect()
    arena.close()
    assert registry.ranges == {}


def test_growth_releases_free_smaller_slabs_to_stay_within_the_limit() -> None:
    """At the limit, growth for a larger size gives back slabs that are entirely free and
    smaller; never a slab in use, and nothing when even that would not make room."""
    registry = FakeRegistry()
    arena = _arena(registry, limit_bytes=6 * SLAB)
    smalls = [arena.carve((SLAB // 2 - 1000,), torch.uint8) for _ in range(4)]  # 2 slabs
    held = arena.carve((SLAB // 2 - 1000,), torch.uint8)  # a third slab, kept in use
    del smalls
    gc.collect()
    assert arena.total_bytes == 3 * SLAB and arena.value_bytes == held.numel()
    assert arena.try_carve((4 * SLAB,), torch.uint8) is None  # 4 MiB: 3 + 4 > 6
    assert arena.needs_growth(), "free 1 MiB slabs can go"
    assert arena.grow_ahead()
    # one free slab went (as many as needed), the held one stays registered
    assert arena.total_bytes == 2 * SLAB + 4 * SLAB and len(registry.ranges) == 3
    assert any(start <= held.data_ptr() < start + n for start, n in registry.ranges.items())
    assert arena.try_carve((4 * SLAB,), torch.uint8) is not None
    # 8 MiB more cannot fit even with every free slab gone: nothing is released for it
    assert arena.try_carve((8 * SLAB,), torch.uint8) is None
    before = dict(registry.ranges)
    assert not arena.needs_growth() and not arena.grow_ahead()
    assert registry.ranges == before
    _check_tiling(arena)
    del held
    gc.collect()
    arena.close()
    assert registry.ranges == {}


def test_a_miss_too_large_for_the_limit_does_not_stop_growth_for_the_others() -> None:
    registry = FakeRegistry()
    arena = _arena(registry, limit_bytes=8 * SLAB)
    assert arena.try_carve((16 * SLAB,), torch.uint8) is None  # never fits the 8 MiB limit
    assert arena.try_carve((3 * SLAB,), torch.uint8) is None
    assert arena.needs_growth() and arena.grow_ahead()
    assert arena.total_bytes == 4 * SLAB, "room for the 3 MiB miss (4 MiB slab), not 16 MiB"
    assert arena.try_carve((3 * SLAB,), torch.uint8) is not None
    # the misses were taken: the arena does not keep trying for the 16 MiB one
    assert not arena.needs_growth() and arena.slabs_made == 1
    arena.close()


def test_close_releases_busy_slabs_when_their_last_block_dies() -> None:
    registry = FakeRegistry()
    arena = _arena(registry)
    t = arena.carve((10,), torch.float64)
    arena.close()
    assert len(registry.ranges) == 1, "still read by a tensor"
    assert arena.try_carve((10,), torch.float64) is None, "a closed arena carves nothing"
    del t
    gc.collect()
    assert registry.ranges == {}


def test_random_carves_and_releases_keep_the_slabs_tiled() -> None:
    registry = FakeRegistry()
    arena = _arena(registry, limit_bytes=64 * SLAB)
    rng = random.Random(7)
    live: list[torch.Tensor] = []
    for step in range(600):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live)))
        else:
            n = rng.choice([1, 7, 300, 4096, 70_000, SLAB // 3, SLAB])
            t = arena.carve((n,), torch.uint8)
            t.fill_(step % 251)
            live.append(t)
            del t
        if step % 25 == 0:
            gc.collect(0)  # a dropped tensor returns its block at once (reference counting)
            _check_tiling(arena)
            assert arena.value_bytes == sum(x.numel() for x in live)
    assert all(bool((t == t[0]).all()) for t in live), "no block was handed out twice"
    del live
    gc.collect()
    assert arena.value_bytes == 0 and arena.carved_bytes == 0
    arena.trim()
    assert registry.ranges == {}


def test_bad_arguments_are_refused() -> None:
    registry = FakeRegistry()
    with pytest.raises(ValueError, match="slab_bytes"):
        PinnedArena(registry.register, registry.unregister, slab_bytes=1000)
    with pytest.raises(ValueError, match="limit_bytes"):
        PinnedArena(registry.register, registry.unregister, limit_bytes=-1)


def test_a_slab_grown_while_the_limit_dropped_is_released_again() -> None:
    registry = FakeRegistry()
    arena = _arena(registry, limit_bytes=8 * SLAB)
    first = arena.carve((3 * SLAB,), torch.uint8)

    def register_then_shrink(ptr: int, nbytes: int) -> None:
        registry.register(ptr, nbytes)
        arena.limit_bytes = arena.total_bytes  # the budget's headroom went meanwhile

    arena._register = register_then_shrink
    assert arena.needs_growth()
    assert not arena.grow_ahead()
    assert arena.total_bytes == 4 << 20 and len(registry.ranges) == 1, "released again"
    del first
    gc.collect()
    arena.close()
    assert registry.ranges == {}


def test_a_miss_carved_from_a_new_slab_registers_it_once_and_later_requests_reuse_it() -> None:
    registry = FakeRegistry()
    arena = _arena(registry, limit_bytes=8 * SLAB)
    n = 3 * SLAB // 2  # at least half a slab: a slab of its own (2 MiB)
    assert arena.try_carve((n,), torch.uint8, note_miss=False) is None
    assert not arena._missed, "a miss the caller serves itself is not remembered for growth"
    made = arena.carve_new((n,), torch.uint8)
    assert made is not None
    tensor, register = made
    assert tensor.untyped_storage().nbytes() == n and not registry.ranges, "not registered yet"
    assert arena.total_bytes == 2 * SLAB and arena.value_bytes == n, "counted at once"
    assert arena.try_carve((SLAB // 4,), torch.uint8) is None, "nothing is carved from it yet"
    register()
    assert registry.ranges == {arena._slabs[0].ptr: 2 * SLAB}
    tensor.fill_(5)
    ptr = tensor.data_ptr()
    del tensor, made
    gc.collect()
    assert arena.value_bytes == 0 and arena.total_bytes == 2 * SLAB, "the slab stays"
    again = arena.try_carve((n,), torch.uint8)
    assert again is not None and again.data_ptr() == ptr, "the next request carves it"
    assert len(registry.ranges) == 1, "registered once"
    _check_tiling(arena)


def test_a_new_slab_past_the_limit_is_refused_and_a_failed_registration_leaves_the_arena() -> None:
    registry = FakeRegistry()
    arena = _arena(registry, limit_bytes=3 * SLAB)
    first = arena.carve_new((2 * SLAB,), torch.uint8)
    assert first is not None
    assert arena.carve_new((2 * SLAB,), torch.uint8) is None, "a second slab passes the limit"

    def refuse(ptr: int, nbytes: int) -> None:
        raise torch.OutOfMemoryError("no more page-locked memory")

    arena._register = refuse
    tensor, register = first
    with pytest.raises(torch.OutOfMemoryError, match="no more page-locked memory"):
        register()
    assert arena.total_bytes == 0 and arena.value_bytes == 0 and not arena._slabs
    assert arena.carves == 0
    tensor.fill_(1)  # still ordinary memory: the caller sees the error, nothing crashes
    del tensor, first
    gc.collect()
    assert arena.total_bytes == 0 and arena.carved_bytes == 0 and not registry.ranges
    arena._register = registry.register
    assert arena.carve_new((2 * SLAB,), torch.uint8) is not None, "its room came back"


def test_a_new_slab_registered_after_close_is_released_with_its_block() -> None:
    registry = FakeRegistry()
    arena = _arena(registry)
    made = arena.carve_new((SLAB,), torch.uint8)
    assert made is not None
    tensor, register = made
    arena.close()
    assert arena.carve_new((SLAB,), torch.uint8) is None, "a closed arena makes no slab"
    register()
    assert len(registry.ranges) == 1
    del tensor, made
    gc.collect()
    assert not registry.ranges and arena.total_bytes == 0


def test_a_block_returned_by_a_collection_inside_the_arenas_own_lock_does_not_deadlock() -> None:
    """A tensor's last reference can go in the middle of the arena's own locked section (a
    garbage collection that runs there, as seen on the H200 inside ``needs_growth``): its
    finalizer returns the block on the thread that holds the lock. The block is taken back
    as the section ends, instead of the thread waiting on its own lock forever."""
    import threading

    registry = FakeRegistry()
    arena = _arena(registry)
    block = arena.carve((100,), torch.float32)
    assert arena.value_bytes == 400
    held = [block]
    del block

    def section() -> None:
        with arena._locked():  # as needs_growth holds it
            held.clear()  # the last reference goes: the finalizer runs here, in the section
            assert arena.value_bytes == 400  # taken back only as the section ends
        assert arena.value_bytes == 0

    worker = threading.Thread(target=section, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the thread waits on its own lock"
    assert arena.value_bytes == 0 and arena.carved_bytes == 0
    _check_tiling(arena)
