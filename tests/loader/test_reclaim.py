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
    """libc, noting what each descriptor pointed to after ``dup2`` replaced it."""

    def __init__(self, libc: Any) -> None:
        self.libc = libc
        self.before: list[str] = []
        self.after: list[str] = []

    def mmap(self, *args: Any) -> Any:
        return self.libc.mmap(*args)

    def dup2(self, old: int, new: int) -> int:
        self.before.append(target_of(new))
        result = int(self.libc.dup2(old, new))
        self.after.append(target_of(new))
        return result


@linux_only
def test_a_batch_only_the_list_holds_is_given_back_and_its_shared_file_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    libc = RecordingLibc(reclaim._LIBC)
    monkeypatch.setattr(reclaim, "_LIBC", libc)
    batch = from_a_worker(1)[0]
    parts = [batch]
    del batch
    assert release_shared(parts) == (1 << 16) * 4
    assert parts == [None]
    # During the call, the shared file's descriptor (the last reference to it: its pages are
    # freed there) was replaced by /dev/null's, which torch closed afterwards.
    assert len(libc.before) == 1 and "/dev/shm/" in libc.before[0], libc.before
    assert libc.after == ["/dev/null"]


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


@linux_only
@pytest.mark.anyio
async def test_a_loader_over_worker_processes_gives_their_memory_back_and_right_data() -> None:
    """The ring's thread gives each copied batch's shared memory back; every batch the
    consumer gets is the source's."""
    source = DataLoader(Rows(12), batch_size=None, num_workers=2)
    async with ResidencyManager(backend=SimBackend()) as m:
        async with DeviceLoader(m, source, "cuda:0", prefetch=2) as loader:
            assert loader.ring
            got = [batch.clone() async for batch in loader]
            stats = loader.stats()
        assert_nothing_left(m)
    assert [float(b[0]) for b in got] == [float(i) for i in range(12)]
    assert all(torch.equal(b, torch.full((1 << 16,), float(i))) for i, b in enumerate(got))
    assert stats.released_shared_bytes > 0
    assert "shared memory given back" in str(stats)
