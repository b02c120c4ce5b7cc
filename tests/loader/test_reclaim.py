"""Giving back a DataLoader batch's shared memory without the interpreter lock
(:mod:`aresidency.loader.reclaim`): only tensors nobody else holds, whole shared storages; the
shared file is closed (its pages freed) by the call, and the data handed out stays right."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from aresidency import ResidencyManager
from aresidency.backends.sim import SimBackend
from aresidency.loader import DeviceLoader, reclaim
from aresidency.loader.reclaim import release_shared

from ._support import assert_nothing_left

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="shared memory by descriptor: Linux"
)


class Rows(Dataset[torch.Tensor]):
    def __init__(self, count: int, numel: int = 1 << 16) -> None:
        self.count = count
        self.numel = numel

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.numel,), float(i))


def from_a_worker(count: int = 2) -> list[torch.Tensor]:
    """Batches received from a DataLoader worker process (in shared memory)."""
    return list(DataLoader(Rows(count), batch_size=None, num_workers=1))


def target_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


class RecordingLibc:
    """libc, noting the ranges given to ``madvise`` and what each descriptor closed pointed to,
    and whether torch's own descriptor ``theirs`` was closed by then."""

    def __init__(self, libc: Any, theirs: int) -> None:
        self.libc = libc
        self.theirs = theirs
        self.advised: list[tuple[int, int, int]] = []
        self.closed: list[tuple[str, bool]] = []

    def madvise(self, address: int, length: int, advice: int) -> int:
        self.advised.append((address, length, advice))
        return int(self.libc.madvise(address, length, advice))

    def close(self, fd: int) -> int:
        self.closed.append((target_of(fd), not os.path.exists(f"/proc/self/fd/{self.theirs}")))
        return int(self.libc.close(fd))


@linux_only
def test_a_batch_only_the_list_holds_is_given_back_by_its_last_descriptor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = from_a_worker(1)[0]
    storage = batch.untyped_storage()
    theirs = storage._share_fd_cpu_()[0]
    address, nbytes = storage.data_ptr(), storage.nbytes()
    del storage
    libc = RecordingLibc(reclaim._LIBC, theirs)
    monkeypatch.setattr(reclaim, "_LIBC", libc)
    parts = [batch]
    del batch
    assert release_shared(parts) == nbytes == (1 << 16) * 4
    assert parts == [None]
    # The page-table entries were dropped over the whole mapping, and the descriptor this
    # call closed, the shared file's, was its last one here: torch had closed its own.
    assert libc.advised == [(address, nbytes, 4)]
    assert len(libc.closed) == 1
    where, torch_closed_first = libc.closed[0]
    assert "/dev/shm/" in where and torch_closed_first, libc.closed


@linux_only
def test_the_memory_stays_readable_for_a_reference_taken_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Torch hands a storage received again to whoever asks (it caches them by file): one
    picked up while the memory is given back still reads the batch's data."""
    taken: list[torch.Tensor] = []
    real = reclaim._drop_page_tables

    def unmap_then_take(tensor: torch.Tensor) -> tuple[int | None, int]:
        result = real(tensor)
        taken.append(tensor.view(-1)[:])  # another reference, after the page tables went
        return result

    monkeypatch.setattr(reclaim, "_drop_page_tables", unmap_then_take)
    parts = [from_a_worker(1)[0]]
    assert release_shared(parts) == (1 << 16) * 4
    assert torch.equal(taken[0], torch.zeros(1 << 16))


@linux_only
def test_a_batch_someone_else_holds_is_only_dropped_from_the_list() -> None:
    kept = from_a_worker(1)[0]
    parts = [kept]
    assert release_shared(parts) == 0
    assert parts == [None]
    assert torch.equal(kept, torch.full((1 << 16,), 0.0))  # untouched, still readable


@linux_only
def test_views_plain_memory_and_other_objects_are_left_alone() -> None:
    shared = from_a_worker(1)[0]
    view = shared[16:]
    plain = torch.ones(1 << 16)
    parts: list[object] = [view, plain, "not a tensor", None]
    del view
    assert release_shared(parts) == 0
    assert parts == [None] * 4
    assert torch.equal(shared, torch.zeros(1 << 16))


class DriverStagedSim(SimBackend):
    """The simulation, with a pageable source's bytes taken when ``copy_into`` returns, as the
    CUDA driver's own staging takes them: the simulated stream then holds no reference to the
    source, and whether the ring gives a batch's shared memory back does not depend on how
    soon the stream's thread ran (under load it may not have run yet)."""

    def copy_into(self, src: torch.Tensor, dst: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.owned_location(src) is None:  # not the simulation's memory: pageable
            src = src.clone()
        return super().copy_into(src, dst, *args, **kwargs)


@linux_only
@pytest.mark.anyio
# Forking the DataLoader's workers holds the interpreter lock (tens of ms each under load):
# that stall is the DataLoader's, so this test allows the loop a second of it.
@pytest.mark.allow_loop_stall(1.0)
@pytest.mark.parametrize("pack", [None, 64 << 10], ids=["copied", "packed"])
async def test_a_loader_over_worker_processes_gives_their_memory_back_and_right_data(
    pack: int | None,
) -> None:
    """The ring's thread gives each batch's shared memory back once its bytes are on their
    way (copied, or packed into the slot's twin); every batch the consumer gets is the
    source's."""
    source = DataLoader(Rows(12), batch_size=None, num_workers=2)
    async with ResidencyManager(backend=DriverStagedSim()) as m:
        async with DeviceLoader(m, source, "cuda:0", prefetch=2, pack_min_bytes=pack) as loader:
            assert loader.ring
            got = [batch.clone() async for batch in loader]
            stats = loader.stats()
        assert_nothing_left(m)
    assert [float(b[0]) for b in got] == [float(i) for i in range(12)]
    assert all(torch.equal(b, torch.full((1 << 16,), float(i))) for i, b in enumerate(got))
    assert stats.released_shared_bytes > 0
    assert "shared memory given back" in str(stats)
    assert (stats.packed_bytes > 0) == (pack is not None)
