"""``DeviceLoader`` on a real GPU (marked ``cuda``; skipped without one): the ring's copies
from pageable and page-locked sources, its slots reused under a step's slow kernels, the budget
against what torch really allocated, the managed values beside it, and passes over shards
started while the device still runs the previous pass's steps."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from aresidency import ResidencyManager
from aresidency.loader import DeviceLoader, ShardSource

from ._support import MiB, assert_nothing_left

pytestmark = [pytest.mark.anyio, pytest.mark.cuda]

SLEEP_CYCLES = 20_000_000  # about 10 ms of a spinning kernel on an H200

Pair = namedtuple("Pair", ["empty", "flags"])


@dataclasses.dataclass
class Tagged:
    x: torch.Tensor
    tag: str


class Rows(Dataset[dict[str, torch.Tensor]]):
    """Deterministic batches: row ``i`` is ``i`` everywhere, plus a random-looking payload."""

    def __init__(self, count: int, numel: int) -> None:
        self.count = count
        self.numel = numel

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(i)
        return {
            "x": torch.randn(self.numel, generator=generator),
            "i": torch.tensor(i),
        }


def expected(i: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("pin", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_a_dataloader_feeds_the_gpu_bit_identical_in_order_within_budget(
    pin: bool, ring: bool
) -> None:
    numel = MiB // 4  # 1 MiB of float32 per row
    rows = Rows(24, numel)
    source = DataLoader(rows, batch_size=2, pin_memory=pin)
    budget = 12 * MiB
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    async with ResidencyManager(budgets={"cuda:0": budget}) as m:
        got = []
        async with DeviceLoader(m, source, "cuda:0", prefetch=3, ring=ring) as loader:
            assert loader.ring is ring
            async for batch in loader:
                assert batch["x"].device.type == "cuda"
                got.append({k: v.cpu() for k, v in batch.items()})  # kept off the GPU
        peak = torch.cuda.max_memory_allocated() - base
        assert m.snapshot().location("cuda:0").peak_bytes <= budget
        assert_nothing_left(m)
    # torch's own count: the loader's slots (or values) within the budget, plus at most the
    # step's one temporary copy of a batch on its way to the host
    assert peak <= budget + 2 * MiB
    for n, batch in enumerate(got):
        assert batch["i"].tolist() == [2 * n, 2 * n + 1]
        for j in range(2):
            assert torch.equal(batch["x"][j].cpu(), expected(2 * n + j, numel))
    torch.cuda.synchronize()


def odd_batches(pin: bool) -> list[Any]:
    """Batches as odd as a user's: one tensor twice, views at offsets of one storage, a strided
    view, a transposed one, empty and 0-d tensors, bool, complex, bfloat16 and float8 data,
    non-tensor leaves, namedtuples and dataclasses; page-locked when ``pin`` (a view keeps its
    storage's page-locking, a copy made contiguous does not)."""

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if pin else t

    base = host(torch.arange(64, dtype=torch.float32))
    twice = host(torch.arange(8.0))
    wide = host(torch.randn(48, 40, generator=torch.Generator().manual_seed(3)))
    return [
        {"same": twice, "again": twice},
        [base[:16], base[16:48], base[48:]],
        (base[::3],),
        Pair(host(torch.zeros(0)), host(torch.tensor([True, False, True]))),
        Tagged(wide.t(), "meta"),
        {"n": 5, "s": "text", "none": None, "nested": {"deep": [host(torch.tensor(7))]}},
        host(torch.tensor([1 + 2j, 3 - 1j, -0.5j])),
        host(torch.arange(6.0).to(torch.bfloat16)),
        host(torch.arange(5.0).to(torch.float8_e4m3fn)),
        wide[3:9, 5:30],
    ]


def leaves(batch: Any) -> list[Any]:
    """Every leaf of a batch, in order (tensors and the rest)."""
    if isinstance(batch, dict):
        return [x for v in batch.values() for x in leaves(v)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [x for f in dataclasses.fields(batch) for x in leaves(getattr(batch, f.name))]
    if isinstance(batch, (list, tuple)):
        return [x for v in batch for x in leaves(v)]
    return [batch]


@pytest.mark.parametrize("pin", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("ring", [True, False], ids=["ring", "values"])
async def test_odd_batches_reach_the_gpu_bit_identical_with_their_structure(
    pin: bool, ring: bool
) -> None:
    batches = odd_batches(pin)
    async with ResidencyManager(budgets={"cuda:0": 8 * MiB}) as m:
        n = 0
        async with DeviceLoader(m, batches, "cuda:0", prefetch=2, ring=ring) as loader:
            async for batch in loader:
                want = batches[n]
                assert type(batch) is type(want)
                for got, exp in zip(leaves(batch), leaves(want), strict=True):
                    if not isinstance(exp, torch.Tensor):
                        assert got == exp
                        continue
                    assert got.device == torch.device("cuda", 0)
                    assert (got.shape, got.dtype) == (exp.shape, exp.dtype)
                    host = got.cpu()
                    # bit for bit, float8 and complex included (no arithmetic on them)
                    assert torch.equal(
                        host.contiguous().view(-1).view(torch.uint8),
                        exp.contiguous().view(-1).view(torch.uint8),
                    ), f"batch {n}"
                n += 1
        assert n == len(batches)
        assert_nothing_left(m)
    torch.cuda.synchronize()


async def test_a_slot_is_refilled_only_after_the_step_that_read_it_ran() -> None:
    """prefetch=1: two slots, reused every other batch. Each step's kernel spins ~10 ms on the
    current stream before it reads its batch; the copy of the batch two ahead, into the same
    slot, is issued while that kernel still runs. Without the device-side wait on the step's
    event, the late read would see the newer batch."""
    numel = 1 << 18
    data = [torch.full((numel,), float(i)) for i in range(12)]
    reads = []
    async with ResidencyManager(budgets={"cuda:0": 8 * MiB}) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=1) as loader:
            assert loader.ring
            async for batch in loader:
                torch.cuda._sleep(SLEEP_CYCLES)
                reads.append(batch.sum())  # after the spin, on the same stream
        assert_nothing_left(m)
    values = [float(r.item()) for r in reads]
    assert values == [float(i) * numel for i in range(12)]


async def test_a_kept_batch_is_not_overwritten_while_the_pass_goes_on() -> None:
    numel = 1 << 16
    data = [torch.full((numel,), float(i)) for i in range(10)]
    async with ResidencyManager(budgets={"cuda:0": 8 * MiB}) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=2) as loader:
            kept = None
            async for batch in loader.batches():
                if batch.index == 1:
                    kept = batch
                    await batch.__aenter__()
            assert kept is not None
            assert float(kept.data.min().item()) == float(kept.data.max().item()) == 1.0
            await kept.__aexit__(None, None, None)
        assert_nothing_left(m)


async def test_a_twin_is_packed_again_only_after_its_last_copy_out_ran() -> None:
    """prefetch=0: one slot and its pinned twin, reused by every batch. Before it lets each
    batch go, the step holds up the copy stream with a spinning kernel, so the next batch's
    copy out of the twin runs ~10 ms late; the step reads that batch at once (a sum on its
    stream, after the copy) and lets it go. Packing the batch after it into the twin before
    the late copy ran would put the wrong bytes into the batch being summed."""
    from aresidency.backends.cuda import copy_streams

    numel = 1 << 18
    data = [torch.full((numel,), float(i)) for i in range(8)]
    reads = []
    async with ResidencyManager(budgets={"cuda:0": 8 * MiB}) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=0, pack_min_bytes=0) as loader:
            assert loader.ring
            async for batch in loader:
                reads.append(batch.sum())
                with torch.cuda.stream(copy_streams(0).h2d):
                    torch.cuda._sleep(SLEEP_CYCLES)  # ahead of the next batch's copy
            stats = loader.stats()
        assert_nothing_left(m)
    assert stats.packed_bytes == sum(t.numel() * t.element_size() for t in data)
    values = [float(r.item()) for r in reads]
    assert values == [float(i) * numel for i in range(8)]


async def test_page_locked_batches_are_copied_without_a_twin() -> None:
    data = [torch.full((1 << 16,), float(i)).pin_memory() for i in range(6)]
    async with ResidencyManager(budgets={"cuda:0": 8 * MiB}) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=2, pack_min_bytes=0) as loader:
            sums = [batch.sum() async for batch in loader]
            stats = loader.stats()
        assert_nothing_left(m)
    assert stats.packed_bytes == 0 and stats.twin_peak_bytes == 0
    assert [float(s.item()) for s in sums] == [float(i) * (1 << 16) for i in range(6)]


async def test_passes_over_shards_back_to_back_under_slow_steps(tmp_path: Path) -> None:
    """Three passes over shards, each step spinning ~10 ms before it reads its batch: a new
    pass starts while the device still runs the old pass's steps (its slots are freed only
    once those ran, its staging buffers refilled only after their copies out), and every
    step reads its own batch."""
    rows, row = 24, 1 << 16  # 256 KiB float32 samples: batches of 4 = 1 MiB
    np.save(tmp_path / "x-0.npy", np.arange(rows, dtype=np.float32)[:, None].repeat(row, 1))
    reads = []
    with ShardSource([tmp_path / "x-0.npy"], batch_size=4, workers=2) as source:
        async with ResidencyManager(budgets={"cuda:0": 64 * MiB}) as m:
            async with DeviceLoader(m, source, "cuda:0", prefetch=1, staging_slots=3) as loader:
                assert loader.ring
                for _pass in range(3):
                    async for batch in loader:
                        torch.cuda._sleep(SLEEP_CYCLES)
                        reads.append(batch[:, 0].clone())  # after the spin, on its stream
            assert_nothing_left(m)
    got = [r.tolist() for r in reads]
    assert got == [[float(4 * b + k) for k in range(4)] for b in range(6)] * 3


async def test_passes_straight_out_of_page_locked_files_under_slow_steps(tmp_path: Path) -> None:
    """pin_source: the files are page-locked (read-only) in place, each batch is one DMA out
    of them into a slot; three passes under ~10 ms steps read every batch right, no staging
    buffer is made, and the lock and its reservation end with the loader."""
    rows, row = 24, 1 << 16
    for number in range(2):  # batches of 4 straddle the two files (12 rows each)
        first = number * rows // 2
        data = np.arange(first, first + rows // 2, dtype=np.float32)[:, None].repeat(row, 1)
        np.save(tmp_path / f"x-{number}.npy", data)
    reads = []
    paths = [tmp_path / "x-0.npy", tmp_path / "x-1.npy"]
    with ShardSource(paths, batch_size=5, drop_last=True) as source:
        async with ResidencyManager(budgets={"cuda:0": 64 * MiB}) as m:
            async with DeviceLoader(m, source, "cuda:0", prefetch=2, pin_source=True) as loader:
                for _pass in range(3):
                    async for batch in loader:
                        files = loader.pinned_files
                        assert files is not None and files.locked
                        assert files.view(source.files()[0], 0, 4096).is_pinned()
                        torch.cuda._sleep(SLEEP_CYCLES)
                        reads.append(batch[:, 0].clone())
                assert loader.staging is None
                stats = loader.stats()
            reserved = m.snapshot().location("pinned-host").reservations
            assert not [name for name, _ in reserved if name.endswith(".pinned-files")]
            assert files.status == "closed" and not files.locked
            assert_nothing_left(m)
    got = [r.tolist() for r in reads]
    assert got == [[float(5 * b + k) for k in range(5)] for b in range(4)] * 3
    assert stats.direct_bytes == stats.bytes == 3 * 20 * row * 4
    assert stats.locked_file_bytes >= 24 * row * 4


async def test_a_consumer_ahead_of_the_gpu_is_parked_run_ahead_steps_ahead() -> None:
    """Steps of ~10 ms kernels launched as fast as the host can: whenever a batch is handed
    out, at most ``run_ahead`` of the steps before it are still to run on the GPU (the
    consumer was parked on the loop, not blocked in a launch), and every batch is right."""
    data = [torch.full((1 << 16,), float(i)) for i in range(10)]
    steps: list[torch.cuda.Event] = []
    behind: list[int] = []
    sums = []
    async with ResidencyManager(budgets={"cuda:0": 64 * MiB}) as m:
        async with DeviceLoader(m, data, "cuda:0", prefetch=3, run_ahead=2) as loader:
            async for batch in loader:
                behind.append(sum(not e.query() for e in steps))
                torch.cuda._sleep(SLEEP_CYCLES)
                sums.append(batch.sum())
                event = torch.cuda.Event()
                event.record()
                steps.append(event)
            assert loader.stats().device_wait_s > 0
        assert_nothing_left(m)
    assert max(behind) <= 2, behind
    assert [float(s) for s in sums] == [float(i) * (1 << 16) for i in range(10)]


@pytest.mark.parametrize("twins", [False, True], ids=["driver", "twins"])
async def test_worker_processes_batches_arrive_bit_identical_and_their_memory_goes_back(
    twins: bool,
) -> None:
    """A DataLoader with worker processes (batches in shared memory): each batch is copied
    (through the driver's staging, or packed into a pinned twin), then its shared memory is
    given back without the interpreter lock; every batch on the device is still the source's."""
    numel = MiB // 4
    source = DataLoader(
        Rows(24, numel),
        batch_size=2,
        num_workers=2,
        multiprocessing_context="forkserver",  # workers forked after CUDA started would crash
    )
    async with ResidencyManager(budgets={"cuda:0": 16 * MiB}) as m:
        got = []
        async with DeviceLoader(
            m, source, "cuda:0", prefetch=2, pack_min_bytes=MiB if twins else None
        ) as loader:
            assert loader.ring
            async for batch in loader:
                got.append(batch["x"].cpu())
            stats = loader.stats()
        assert_nothing_left(m)
    assert stats.released_shared_bytes > 0
    for n, batch in enumerate(got):
        for j in range(2):
            assert torch.equal(batch[j], expected(2 * n + j, numel))


async def test_a_tensor_kept_past_its_release_on_the_gpu_is_warned_about_and_counted() -> None:
    """Through the ring on CUDA nothing is written at a release, so a kept tensor silently
    takes a later batch's bytes once its slot is reused: the loader warns (once) and counts
    every kept batch, and a consumer that clones what it keeps gets the data it was given."""
    rows = Rows(12, 1024)
    async with ResidencyManager(budgets={"cuda:0": 64 * MiB}) as m:
        async with DeviceLoader(m, DataLoader(rows, batch_size=2), "cuda:0", prefetch=2) as loader:
            kept, cloned = [], []
            with pytest.warns(RuntimeWarning, match="still referenced two requests after"):
                async for batch in loader:
                    kept.append(batch["i"])
                    cloned.append(batch["i"].clone())
            assert loader.stats().kept_after_release == 4  # batches 0..3 looked at, of 6
            torch.cuda.synchronize()
            assert [c.tolist() for c in cloned] == [[2 * b, 2 * b + 1] for b in range(6)]
        assert_nothing_left(m)
