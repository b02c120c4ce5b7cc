"""The pageable cache (freed pageable destinations kept, faulted in, for the next destination of
the same size): on the CPU, since it is host memory only; the CUDA backend's use of it is
covered by the CUDA tests (tests/runtime/test_cuda_runtime.py)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from aresidency.backends.pageable import MAPPING_ROUND, PageableCache, default_host_keep_bytes

MiB = 1 << 20


def test_a_freed_destination_is_reused_by_the_next_of_its_rounded_size() -> None:
    cache = PageableCache(64 * MiB)
    a = cache.empty((3 * MiB // 4,), torch.float32)  # 3 MiB: a 4 MiB mapping
    assert a.shape == (3 * MiB // 4,) and a.untyped_storage().nbytes() == 3 * MiB
    a.fill_(1.5)
    ptr = a.data_ptr()
    assert cache.fresh == 1 and cache.cached_bytes == 0
    del a
    gc.collect()
    assert cache.cached_bytes == 4 * MiB, "the mapping came back, rounded to 2 MiB pages"
    b = cache.empty((4 * MiB,), torch.uint8)  # 4 MiB: the same rounded size
    assert b.data_ptr() == ptr and cache.reuses == 1 and cache.cached_bytes == 0
    b.fill_(7)
    assert bool((b == 7).all())
    c = cache.empty((2, MiB), torch.int16)  # another size: a fresh mapping
    assert c.data_ptr() != ptr and cache.fresh == 2
    assert c.shape == (2, MiB) and c.dtype == torch.int16


def test_a_mapping_comes_back_only_when_its_last_tensor_died() -> None:
    cache = PageableCache(64 * MiB)
    a = cache.empty((MiB,), torch.uint8)
    a.fill_(3)
    view = a[10:20]  # the user kept a piece of it
    del a
    gc.collect()
    assert cache.cached_bytes == 0, "a view still reads the mapping"
    other = cache.empty((MiB,), torch.uint8)
    other.fill_(9)
    assert bool((view == 3).all()), "the kept view still reads its own data"
    del view
    gc.collect()
    assert cache.cached_bytes == MAPPING_ROUND
    del other
    gc.collect()
    assert cache.cached_bytes == 2 * MAPPING_ROUND


def test_the_cache_never_keeps_more_than_its_limit() -> None:
    cache = PageableCache(5 * MiB)
    tensors = [cache.empty((2 * MiB,), torch.uint8) for _ in range(4)]
    del tensors
    gc.collect()
    assert cache.cached_bytes == 4 * MiB, "two 2 MiB mappings fit a 5 MiB limit, not three"
    none = PageableCache(0)
    t = none.empty((MiB,), torch.uint8)
    del t
    gc.collect()
    assert none.cached_bytes == 0, "a zero limit keeps nothing"


def test_lowering_the_limit_unmaps_the_largest_first_and_close_keeps_nothing() -> None:
    cache = PageableCache(64 * MiB)
    tensors = [cache.empty((n * MiB,), torch.uint8) for n in (2, 2, 8)]
    del tensors
    gc.collect()
    assert cache.cached_bytes == 12 * MiB
    cache.set_limit(5 * MiB)
    assert cache.cached_bytes == 4 * MiB, "the 8 MiB mapping went first"
    assert cache.empty((8 * MiB,), torch.uint8) is not None and cache.reuses == 0
    again = cache.empty((2 * MiB,), torch.uint8)
    assert cache.reuses == 1 and cache.cached_bytes == 2 * MiB
    assert cache.trim() == 2 * MiB and cache.cached_bytes == 0
    cache.close()
    del again
    gc.collect()
    assert cache.cached_bytes == 0, "a closed cache keeps nothing returned after it"
    assert "closed" in repr(cache)


def test_a_mapping_returned_from_another_thread_is_kept_and_reused() -> None:
    cache = PageableCache(64 * MiB)
    box = [cache.empty((MiB,), torch.uint8)]
    ptr = box[0].data_ptr()
    worker = threading.Thread(target=box.clear)  # the last reference dies in that thread
    worker.start()
    worker.join()
    gc.collect()
    assert cache.cached_bytes == MAPPING_ROUND
    assert cache.empty((MiB,), torch.uint8).data_ptr() == ptr


def test_bad_limits_are_refused_and_change_nothing() -> None:
    with pytest.raises(ValueError, match="limit_bytes must be >= 0, got -1"):
        PageableCache(-1)
    cache = PageableCache(8 * MiB)
    with pytest.raises(ValueError, match="limit_bytes must be >= 0"):
        cache.set_limit(-5)
    assert cache.limit_bytes == 8 * MiB


def test_the_default_keeps_an_eighth_of_memory_at_most_16_gib() -> None:
    import os

    eighth = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    assert default_host_keep_bytes() == min(eighth, 16 << 30)
    assert default_host_keep_bytes(at_least=4 << 30) == max(min(eighth, 16 << 30), 4 << 30)
