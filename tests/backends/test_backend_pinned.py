"""Exactly-sized pinned memory (GPU) and byte views (CPU)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import pytest
import torch
from _registry import FakeRegistry

from aresidency.backends import pinned as pinned_module
from aresidency.backends.memory import as_bytes
from aresidency.backends.pinned import PAGE_BYTES, PinnedAllocator


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64])
def test_as_bytes_is_a_flat_uint8_view_without_copy(dtype: torch.dtype) -> None:
    t = torch.zeros(3, 5, dtype=dtype)
    raw = as_bytes(t)
    assert raw.dtype == torch.uint8
    assert raw.numel() == t.numel() * t.element_size()
    assert raw.data_ptr() == t.data_ptr()


@pytest.mark.cuda
@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, (3 << 20) + 5, 65 << 20])
def test_pinned_allocations_are_exactly_sized_page_aligned_and_unpinned_on_release(
    nbytes: int,
) -> None:
    alloc = PinnedAllocator()
    assert alloc.exact, "cudaHostRegister is available through torch.cuda.cudart()"
    t = alloc.empty((nbytes,), torch.uint8)
    assert t.untyped_storage().nbytes() == nbytes
    assert t.data_ptr() % PAGE_BYTES == 0
    assert t.is_pinned()
    assert alloc.pinned_bytes == nbytes
    t.fill_(3)
    assert alloc.release(t)
    assert not t.is_pinned()
    assert alloc.pinned_bytes == 0
    assert bool((t == 3).all()), "still readable as pageable memory"


@pytest.mark.cuda
def test_a_tensor_dropped_without_release_is_unregistered() -> None:
    alloc = PinnedAllocator()
    t = alloc.empty((1000,), torch.float32)
    assert alloc.pinned_bytes == 4000
    del t
    gc.collect()
    assert alloc.pinned_bytes == 0


@pytest.mark.cuda
def test_release_of_a_foreign_tensor_is_refused_quietly() -> None:
    alloc = PinnedAllocator()
    assert not alloc.release(torch.ones(10))
    assert not alloc.release(torch.ones(10, pin_memory=True))


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> FakeRegistry:
    from aresidency.backends import pinned

    fake = FakeRegistry()
    monkeypatch.setattr(pinned, "_register", fake.register)
    monkeypatch.setattr(pinned, "_unregister", fake.unregister)
    monkeypatch.setattr(pinned, "register_available", lambda: True)
    return fake


def test_allocator_lifecycle_never_leaves_a_dead_range_registered(registry: FakeRegistry) -> None:
    alloc = PinnedAllocator(cache_bytes=10_000)
    for _ in range(3):
        a = alloc.empty((1000,), torch.float32)  # 4000 B: cacheable
        b = alloc.empty((5000,), torch.float32)  # 20000 B: larger than the cache
        ptr = a.data_ptr()
        assert len(registry.ranges) == 2 and alloc.pinned_bytes == 24_000
        assert alloc.release(a) and alloc.release(b)
        assert b.data_ptr() not in registry.ranges, "released at once"
        view = a[10:20]
        del a
        gc.collect()
        assert ptr in registry.ranges, "a view keeps the tensor alive"
        del view, b
        gc.collect()
        assert list(registry.ranges) == [ptr], "cached, still registered"
        again = alloc.empty((1000,), torch.float32)
        assert again.data_ptr() == ptr
        del again
        gc.collect()
    assert alloc.cache_hits == 5  # "again" each round, "a" from the second round on
    alloc.trim()
    assert registry.ranges == {} and alloc.pinned_bytes == 0


def test_unpinned_allocation_is_pinned_later_exactly_once(registry: FakeRegistry) -> None:
    alloc = PinnedAllocator()
    t = alloc.empty((3, 7), torch.int16, pin=False)
    assert registry.ranges == {} and not alloc.is_pinned_by_us(t)
    alloc.pin(t)
    alloc.pin(t)
    assert registry.ranges == {t.data_ptr(): 42} and alloc.is_pinned_by_us(t)
    del t
    gc.collect()
    assert registry.ranges == {} and alloc.pinned_bytes == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_calls_cuda_to_unregister(monkeypatch: pytest.MonkeyPatch) -> None:
    # A DataLoader worker forked after CUDA was initialized drops its copies of pinned
    # mappings; a CUDA call there aborts the child ("CUDA error: initialization error").
    calls: list[int] = []

    class Runtime:
        def cudaHostUnregister(self, ptr: int) -> int:
            calls.append(ptr)
            if os.getpid() != parent:
                os._exit(3)  # the child reached CUDA
            return 0

    parent = os.getpid()
    monkeypatch.setattr(pinned_module, "_cudart", Runtime)
    pid = os.fork()
    if pid == 0:  # the child
        pinned_module._unregister(4096)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child called cudaHostUnregister"
    pinned_module._unregister(8192)  # the parent still unregisters
    assert calls == [8192]


def test_unpin_later_unlocks_off_the_calling_thread_and_keeps_the_range_mapped(
    registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cudaHostUnregister waits for the device to be idle and stalls every thread's CUDA calls
    meanwhile: the runtime's allocator hands it to the unpinner thread. The range must stay
    mapped until it is unlocked (a registered range is never unmapped)."""
    import threading
    import weakref

    from aresidency.backends import pinned

    seen: list[tuple[str, bool]] = []
    alloc = PinnedAllocator(unpin_later=True)
    t = alloc.empty((1000,), torch.float32)
    mapping = weakref.ref(alloc._mapping_of(t))  # type: ignore[arg-type]
    gate = threading.Event()

    def unregister(ptr: int) -> None:
        gate.wait(5)
        seen.append((threading.current_thread().name, mapping() is not None))
        registry.unregister(ptr)

    monkeypatch.setattr(pinned, "_unregister", unregister)
    ptr = t.data_ptr()
    del t  # the last tensor dies: unlocked later, on the unpinner thread
    gc.collect()
    assert alloc.pinned_bytes == 0, "counted as released at once"
    assert ptr in registry.ranges and mapping() is not None, "still locked, still mapped"
    gate.set()
    assert pinned.flush_unpins(5)
    assert seen == [("aresidency-unpin", True)]
    assert registry.ranges == {}
    gc.collect()
    assert mapping() is None, "unmapped once unlocked"


def test_an_arena_slab_released_later_is_unmapped_only_after_it_is_unlocked(
    registry: FakeRegistry,
) -> None:
    from aresidency.backends.arena import PinnedArena

    order: list[str] = []

    def later(ptr: int, keep: object, then: Callable[[], None]) -> None:
        order.append("queued")
        registry.unregister(ptr)
        order.append("unlocked")
        then()
        order.append("unmapped" if keep.closed else "still mapped")  # type: ignore[attr-defined]

    arena = PinnedArena(
        registry.register, registry.unregister, slab_bytes=1 << 20, unregister_later=later
    )
    block = arena.carve((100,), torch.float32)
    del block
    arena.close()
    assert order == ["queued", "unlocked", "unmapped"]
    assert registry.ranges == {} and arena.total_bytes == 0


_EXIT_SCRIPT = """
import threading, time, torch
from aresidency.backends import pinned

a = torch.randn(1500, 1500)
started = threading.Event()

def unregister(ptr):
    started.set()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        torch.mm(a, a)  # a C++ call that releases the GIL, as cudaHostUnregister's binding does

pinned._unregister = unregister
pinned.unpin_later(4096, None, lambda: print("unlocked", flush=True))
started.wait(10)
"""


def test_the_interpreter_exits_cleanly_while_the_unpinner_is_inside_a_torch_call() -> None:
    """A daemon thread still inside torch's C++ when the interpreter finalizes is ended as it
    takes the GIL back, which aborts the process ("terminate called without an active
    exception"); seen at the end of every CUDA example. The unpinner finishes at exit."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert "terminate called" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["unlocked"]


@pytest.mark.cuda
@pytest.mark.parametrize("example", ["02_register_and_move.py", "03_acquire_with_streams.py"])
def test_a_cuda_program_that_unpins_at_its_end_exits_cleanly(example: str) -> None:
    """The examples free pinned values as their manager closes, just before the interpreter
    exits: they aborted on the H200 until the unpinner finished at exit."""
    import pathlib
    import subprocess
    import sys

    path = pathlib.Path(__file__).parents[2] / "examples" / example
    for _ in range(3):  # a race: the unpinner must be inside its CUDA call at the exit
        done = subprocess.run(
            [sys.executable, str(path)], capture_output=True, text=True, timeout=120
        )
        assert "terminate called" not in done.stderr, done.stderr[-2000:]
        assert done.returncode == 0, done.stderr[-2000:]
        assert "backend: cuda" in done.stdout
