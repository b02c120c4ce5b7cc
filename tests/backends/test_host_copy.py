"""host_copy and host_fill: large host copies and fills in a few threads of our own (not torch's
intra-op pool, not the calling thread once split), byte for byte."""

from __future__ import annotations

import threading

import pytest
import torch

from aresidency.backends import memory
from aresidency.backends.memory import as_bytes, host_copy, host_fill


@pytest.fixture
def three_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Split across three threads whatever the machine's cores; the threads that copied."""
    monkeypatch.setattr(memory, "HOST_THREADS", 3)
    used: list[int] = []
    real_move, real_set = memory.ctypes.memmove, memory.ctypes.memset
    monkeypatch.setattr(
        memory.ctypes,
        "memmove",
        lambda d, s, n: used.append(threading.get_ident()) or real_move(d, s, n),
    )
    monkeypatch.setattr(
        memory.ctypes,
        "memset",
        lambda a, b, n: used.append(threading.get_ident()) or real_set(a, b, n),
    )
    return used


@pytest.mark.parametrize("nbytes", [0, 1, 4095, memory.HOST_SPLIT_BYTES + 12345])
def test_host_copy_copies_every_span_exactly(three_threads: list[int], nbytes: int) -> None:
    g = torch.Generator().manual_seed(nbytes)
    sources = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(2)]
    # destinations with a guard byte on each side: nothing outside the spans is written
    padded = [torch.full((nbytes + 2,), 7, dtype=torch.uint8) for _ in range(2)]
    host_copy([(d.data_ptr() + 1, s.data_ptr(), nbytes) for d, s in zip(padded, sources)])
    for d, s in zip(padded, sources, strict=True):
        assert torch.equal(d[1:-1], s) and d[0] == 7 and d[-1] == 7
    split = nbytes >= memory.HOST_SPLIT_BYTES
    assert (threading.get_ident() not in three_threads) == split or not three_threads
    if split:
        assert len(three_threads) >= 3  # the spans' bytes shared among the three threads


def test_host_fill_sets_exactly_the_bytes_asked(three_threads: list[int]) -> None:
    nbytes = 3 * memory.HOST_SPLIT_BYTES + 5
    tensor = torch.full((nbytes + 2,), 9, dtype=torch.uint8)
    host_fill(tensor.data_ptr() + 1, nbytes, 0xA5)
    assert bool((tensor[1:-1] == 0xA5).all()) and tensor[0] == 9 and tensor[-1] == 9
    assert len(three_threads) == 3 and threading.get_ident() not in three_threads
    small = torch.ones(100, dtype=torch.float32)
    host_fill(small.data_ptr(), 40)  # below the split: the calling thread
    assert torch.equal(as_bytes(small[:10]), torch.zeros(40, dtype=torch.uint8))
    assert bool((small[10:] == 1).all())
