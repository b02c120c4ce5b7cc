"""``DeviceLoader(..., pin_source=True)`` over a ``ShardSource``, on the simulated backend (a
simulation of CUDA devices in host memory, where the files are mapped but nothing is
page-locked): batches copied straight out of the files, bit-identical and in order, across
shard boundaries and passes, without staging buffers; the files charged to ``pinned-host`` as one
reservation of their whole pages until the loader closes; a shuffled source still staged;
refusals that name what was wrong and leave nothing behind. The CUDA tests (the files really
page-locked) are in test_loader_cuda.py."""

from __future__ import annotations

import mmap
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from aresidency import ResidencyBudgetError, ResidencyManager
from aresidency.backends.sim import SimBackend
from aresidency.loader import DeviceLoader, ShardSource
from aresidency.loader import pinnedfiles as pinnedfiles_module
from aresidency.runtime.signal import ManagerClosedError

from ._support import KiB, assert_nothing_left, batches

pytestmark = pytest.mark.anyio

ROWS = (5, 7, 4)  # batches of 4 straddle the shard boundaries


def write_npy(directory: Path) -> tuple[list[Path], torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    paths, parts = [], []
    for number, rows in enumerate(ROWS):
        x = torch.randn(rows, 6, 5, generator=generator)
        path = directory / f"x-{number}.npy"
        np.save(path, x.numpy())
        paths.append(path)
        parts.append(x)
    return paths, torch.cat(parts)


def pages(paths: list[Path]) -> int:
    page = mmap.PAGESIZE
    return sum(-(-p.stat().st_size // page) * page for p in paths)


async def test_batches_come_straight_out_of_the_files_bit_identical_over_passes(
    tmp_path: Path,
) -> None:
    paths, x = write_npy(tmp_path)
    with ShardSource(paths, batch_size=4, workers=2) as source:
        assert source.reads_direct
        async with ResidencyManager(budgets={"cuda:0": 4 * KiB}, backend=SimBackend()) as m:
            passes = []
            async with DeviceLoader(m, source, "cuda:0", prefetch=2, pin_source=True) as loader:
                for _ in range(3):
                    got = []
                    async for batch in loader:
                        got.append(batch.clone())
                        pinned = m.snapshot().location("pinned-host")
                        # The files' whole pages are one reservation; no staging buffers.
                        own = ((f"{loader.name}.pinned-files", pages(paths)),)
                        assert pinned.reservations == own
                        assert loader.staging is None and loader.pinned_bytes == 0
                    passes.append(torch.cat(got))
                stats = loader.stats()
            assert_nothing_left(m)
    for got in passes:
        assert torch.equal(got, x)
    assert stats.locked_file_bytes == pages(paths)
    assert stats.direct_bytes == stats.copy_bytes == stats.bytes == 3 * x.numel() * 4
    assert stats.source_busy_s == 0.0  # the host read nothing
    assert stats.pinned_bytes == 0


async def test_dict_batches_of_safetensors_come_out_of_the_files_too(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    paths, xs, ys = [], [], []
    for number, rows in enumerate(ROWS):
        x, y = torch.randn(rows, 3, 8, generator=generator), torch.arange(rows) + 100 * number
        path = tmp_path / f"part-{number}.safetensors"
        save_file({"x": x, "y": y}, str(path))
        paths.append(path)
        xs.append(x)
        ys.append(y)
    with ShardSource(paths, batch_size=4, drop_last=True) as source:
        async with ResidencyManager(backend=SimBackend()) as m:
            async with DeviceLoader(m, source, "cuda:0", pin_source=True) as loader:
                got = [(b["x"].clone(), b["y"].clone()) async for b in loader]
                assert loader.stats().direct_bytes > 0
            assert_nothing_left(m)
    assert torch.equal(torch.cat([g[0] for g in got]), torch.cat(xs)[:16])
    assert torch.equal(torch.cat([g[1] for g in got]), torch.cat(ys)[:16])


async def test_a_shuffled_source_is_still_staged_with_its_files_locked(tmp_path: Path) -> None:
    paths, x = write_npy(tmp_path)
    with ShardSource(paths, batch_size=4, shuffle=True, seed=1) as source:
        assert not source.reads_direct
        with pytest.raises(ValueError, match="shuffled batches gather"):
            source.direct_reads(source.plan_epoch()[0])
        async with ResidencyManager(backend=SimBackend()) as m:
            async with DeviceLoader(m, source, "cuda:0", pin_source=True) as loader:
                got = torch.cat([b.clone() async for b in loader])
                assert loader.staging is not None
                assert loader.stats().direct_bytes == 0
            assert_nothing_left(m)
    assert sorted(got.reshape(len(got), -1)[:, 0].tolist()) == sorted(x[:, 0, 0].tolist())


async def test_files_that_do_not_fit_pinned_host_are_refused_with_what_to_do(
    tmp_path: Path,
) -> None:
    paths, _x = write_npy(tmp_path)
    with ShardSource(paths, batch_size=4) as source:
        budget = pages(paths) - 1
        async with ResidencyManager(budgets={"pinned-host": budget}, backend=SimBackend()) as m:
            async with DeviceLoader(m, source, "cuda:0", pin_source=True) as loader:
                with pytest.raises(ResidencyBudgetError) as info:
                    await anext(aiter(loader))
                assert loader.pinned_files is None
            notes = "".join(getattr(info.value, "__notes__", []))
            assert "pin_source page-locks the source's 3 files" in notes
            assert "leave pin_source off" in notes
            assert_nothing_left(m)


async def test_a_file_replaced_before_it_is_locked_is_refused_and_nothing_stays_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths, _x = write_npy(tmp_path)
    unmapped: list[int] = []
    real = pinnedfiles_module._libc

    def counting_libc() -> object:
        libc = real()

        class Libc:
            mmap = libc.mmap

            @staticmethod
            def munmap(address: int, nbytes: int) -> int:
                unmapped.append(address)
                return int(libc.munmap(address, nbytes))

        return Libc()

    monkeypatch.setattr(pinnedfiles_module, "_libc", counting_libc)
    with ShardSource(paths, batch_size=4) as source:
        replaced = tmp_path / "other.npy"
        np.save(replaced, np.zeros((ROWS[2], 6, 5), dtype=np.float32))
        replaced.replace(paths[2])  # a new inode under the third shard's name
        async with ResidencyManager(backend=SimBackend()) as m:
            async with DeviceLoader(m, source, "cuda:0", pin_source=True) as loader:
                with pytest.raises(OSError, match=r"x-2\.npy was replaced"):
                    await anext(aiter(loader))
            assert_nothing_left(m)
    assert len(unmapped) == 2  # the two files mapped before the third failed


async def test_pin_source_is_refused_for_sources_without_files_and_without_the_ring(
    tmp_path: Path,
) -> None:
    paths, _x = write_npy(tmp_path)
    async with ResidencyManager(backend=SimBackend()) as m:
        with pytest.raises(ValueError, match="list has no files to lock"):
            DeviceLoader(m, batches(2), "cuda:0", pin_source=True)
        with ShardSource(paths, batch_size=4) as source:
            with pytest.raises(ValueError, match="needs ring=True"):
                DeviceLoader(m, source, "cuda:0", ring=False, pin_source=True)
            with pytest.raises(TypeError, match="pin_source must be True or False"):
                DeviceLoader(m, source, "cuda:0", pin_source=1)  # type: ignore[arg-type]
        assert_nothing_left(m)


async def test_cancelled_while_the_files_are_locked_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled at the await where the loader maps and locks the files (a worker thread):
    the mapping finishes, then everything is released."""
    paths, _x = write_npy(tmp_path)
    entered = anyio.Event()
    real = pinnedfiles_module.PinnedFiles._map_all
    token = None

    def slow_map(self: pinnedfiles_module.PinnedFiles) -> None:
        anyio.from_thread.run_sync(entered.set, token=token)
        real(self)

    monkeypatch.setattr(pinnedfiles_module.PinnedFiles, "_map_all", slow_map)
    with ShardSource(paths, batch_size=4) as source:
        async with ResidencyManager(backend=SimBackend()) as m:
            token = anyio.lowlevel.current_token()
            async with DeviceLoader(m, source, "cuda:0", pin_source=True) as loader:
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tasks:

                        async def first() -> None:
                            await anext(aiter(loader))

                        tasks.start_soon(first)
                        await entered.wait()
                        scope.cancel()
                assert scope.cancelled_caught
            assert_nothing_left(m)


async def test_the_manager_closing_under_a_pinned_pass_releases_the_files(
    tmp_path: Path,
) -> None:
    paths, _x = write_npy(tmp_path)
    with ShardSource(paths, batch_size=4) as source:
        m = ResidencyManager(backend=SimBackend())
        async with m:
            loader = DeviceLoader(m, source, "cuda:0", pin_source=True)
            it = aiter(loader)
            await anext(it)
            files = loader.pinned_files
            assert files is not None and files.status == "open"
        with pytest.raises(ManagerClosedError):
            await anext(it)
        await loader.aclose()
        assert files.status == "closed"


async def test_a_system_without_posix_mmap_is_refused_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths, _x = write_npy(tmp_path)
    monkeypatch.setattr(pinnedfiles_module, "POSIX", False)
    with ShardSource(paths, batch_size=4) as source:
        async with ResidencyManager(backend=SimBackend()) as m:
            async with DeviceLoader(m, source, "cuda:0", pin_source=True) as loader:
                with pytest.raises(OSError, match="needs a POSIX system; leave pin_source off"):
                    await anext(aiter(loader))
            assert_nothing_left(m)
