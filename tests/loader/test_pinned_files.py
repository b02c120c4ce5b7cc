"""``DeviceLoader(..., pin_source=True)`` over a ``ShardSource``, on the simulated backend (a
simulation of CUDA devices in host memory, where the files are mapped but nothing is
page-locked): batches copied straight out of the files, bit-identical and in order, across
shard boundaries and passes, without staging buffers; the files charged to ``pinned-host`` as one
reservation of their whole pages until the loader closes; a shuffled source still staged;
refusals that name what was wrong and leave nothing behind. The CUDA tests (the files really
page-locked) are in test_loader_cuda.py."""

from __future__ import annotations

import asyncio
import mmap
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from _native import on_asyncio
from safetensors.torch import save_file

from aresidency import ResidencyBudgetError, ResidencyManager
from aresidency.backends.sim import SimBackend
from aresidency.loader import DeviceLoader, ShardSource
from aresidency.loader import pinnedfiles as pinnedfiles_module
from aresidency.loader.lifetime import HostWaits
from aresidency.runtime.signal import ManagerClosedError

from ._support import KiB, assert_nothing_left, batches
from .test_loader_ring import until

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


class CountingLibc:
    """Patches ``pinnedfiles._libc``: counts the mappings made and ended; an unmapping while
    ``hold`` is set is recorded in ``early`` and not done (a copy still to run reads it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: threading.Event | None = None):
        self.mapped: list[int] = []
        self.unmapped: list[int] = []
        self.early: list[int] = []
        real = pinnedfiles_module._libc
        outer = self

        def libc() -> object:
            inner = real()

            class Libc:
                @staticmethod
                def mmap(*args: Any) -> Any:
                    address = inner.mmap(*args)
                    outer.mapped.append(address)
                    return address

                @staticmethod
                def munmap(address: int, nbytes: int) -> int:
                    if hold is not None and not hold.is_set():
                        outer.early.append(address)
                        return 0
                    outer.unmapped.append(address)
                    return int(inner.munmap(address, nbytes))

            return Libc()

        monkeypatch.setattr(pinnedfiles_module, "_libc", libc)


async def test_cancelled_natively_while_the_files_are_mapped_leaves_nothing_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``task.cancel()`` (asyncio) goes through an anyio shield: the first ``anext``, cancelled
    while the worker thread maps the files, used to end the reservation at once while the
    thread went on mapping every file, which then stayed mapped (page-locked, on a GPU) for
    the life of the process. The cancellation is raised once the mapping finished and was
    undone. (On trio, through a cancel scope.)"""
    paths, x = write_npy(tmp_path)
    libc = CountingLibc(monkeypatch)
    entered, go, done = threading.Event(), threading.Event(), threading.Event()
    real = pinnedfiles_module.PinnedFiles._map_all

    def held_map(self: pinnedfiles_module.PinnedFiles) -> None:
        entered.set()
        try:
            go.wait(10)
            real(self)
        finally:
            done.set()

    monkeypatch.setattr(pinnedfiles_module.PinnedFiles, "_map_all", held_map)
    with ShardSource(paths, batch_size=4) as source:
        async with ResidencyManager(backend=SimBackend()) as m:
            async with DeviceLoader(m, source, "cuda:0", pin_source=True) as loader:

                async def first() -> None:
                    await anext(aiter(loader))

                if on_asyncio():
                    task = asyncio.get_running_loop().create_task(first())
                    await anyio.to_thread.run_sync(entered.wait)
                    task.cancel()
                    await asyncio.sleep(0)
                    go.set()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                else:
                    with anyio.CancelScope() as scope:
                        async with anyio.create_task_group() as tasks:
                            tasks.start_soon(first)
                            await anyio.to_thread.run_sync(entered.wait)
                            scope.cancel()
                            go.set()
                    assert scope.cancelled_caught
                await anyio.to_thread.run_sync(done.wait)  # the mapping thread ended
                # Cancelled before the mapping was kept (asyncio: the cancellation is raised
                # once it finished) or after (trio: at the next checkpoint): the files are
                # mapped exactly while the reservation stands.
                kept = loader.pinned_files is not None
                assert len(libc.mapped) == 3
                assert len(libc.unmapped) == (0 if kept else 3)
                pinned = m.snapshot().location("pinned-host")
                assert pinned.reserved_bytes == (pages(paths) if kept else 0)
                # The next pass maps them again and reads every batch.
                got = torch.cat([b.clone() async for b in loader])
            assert_nothing_left(m)
    assert torch.equal(got, x)
    assert sorted(libc.unmapped) == sorted(libc.mapped)


async def test_a_close_while_another_task_maps_the_files_releases_them_and_starts_no_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One task's first ``anext`` maps the files; another closes the loader meanwhile. The
    close used to find nothing to release: the first task then kept the files (and their
    pinned-host reservation) for good and started a pass on the closed loader. Now the close
    waits for the mapping, releases the files, and the first task is told the loader closed."""
    paths, _x = write_npy(tmp_path)
    libc = CountingLibc(monkeypatch)
    entered, go = threading.Event(), threading.Event()
    real = pinnedfiles_module.PinnedFiles._map_all

    def held_map(self: pinnedfiles_module.PinnedFiles) -> None:
        entered.set()
        go.wait(10)
        real(self)

    monkeypatch.setattr(pinnedfiles_module.PinnedFiles, "_map_all", held_map)
    with ShardSource(paths, batch_size=4) as source:
        async with ResidencyManager(backend=SimBackend()) as m:
            loader = DeviceLoader(m, source, "cuda:0", pin_source=True)
            errors: list[BaseException] = []
            closed = anyio.Event()

            async def first() -> None:
                try:
                    await anext(aiter(loader))
                except RuntimeError as error:
                    errors.append(error)

            async def close() -> None:
                await loader.aclose()
                closed.set()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(first)
                await anyio.to_thread.run_sync(entered.wait)
                tasks.start_soon(close)
                await anyio.wait_all_tasks_blocked()
                assert not closed.is_set()  # it waits for the mapping
                go.set()
            assert [str(e) for e in errors] == [f"{loader.name} is closed"]
            assert loader._epoch is None  # no pass started
            files = loader.pinned_files
            assert files is not None and files.status == "closed"
            assert len(libc.mapped) == 3 and sorted(libc.unmapped) == sorted(libc.mapped)
            assert_nothing_left(m)


async def test_a_batch_whose_copy_fails_half_issued_keeps_its_slot_and_files_until_the_rest_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dict batch is copied out of the files one tensor at a time: when the second copy
    fails (here an injected failure) the first is still queued on the device. The pass's end
    used to free the slot (its reservation ended) and the loader's close to unmap the files
    at once, under that copy (on the simulation it would read unmapped memory). Both now wait
    for it."""
    paths = []
    for number, rows in enumerate((5, 7)):
        path = tmp_path / f"part-{number}.safetensors"
        save_file({"x": torch.randn(rows, 8), "y": torch.arange(rows)}, str(path))
        paths.append(path)
    gate = threading.Event()
    libc = CountingLibc(monkeypatch, hold=gate)
    # Tells when the pass's end waits, in its thread, for device work not done yet.
    waiting = threading.Event()
    real_wait_all = HostWaits.wait_all

    def wait_all(self: HostWaits, events: Any) -> bool:
        events = list(events)
        if any(not event.query() for event in events):
            waiting.set()
        return real_wait_all(self, events)

    monkeypatch.setattr(HostWaits, "wait_all", wait_all)
    with ShardSource(paths, batch_size=4) as source:
        async with ResidencyManager(backend=SimBackend()) as m:
            # The copy stream holds every copy until the gate opens.
            m.backend.run_in_stream_order(m.backend.device_streams(0).h2d, lambda: gate.wait(10))
            m.backend.faults.fail_transfer_at = 2  # batch 0's "y"; its "x" is queued
            errors: list[BaseException] = []
            try:
                async with DeviceLoader(m, source, "cuda:0", prefetch=0, pin_source=True) as loader:

                    async def first() -> None:
                        try:
                            await anext(aiter(loader))
                        except RuntimeError as error:
                            errors.append(error)

                    async with anyio.create_task_group() as tasks:
                        tasks.start_soon(first)
                        # The failed batch raised (it used to, at once), or its pass's end
                        # waits for the copy still queued (it does now).
                        await until(lambda: bool(errors) or waiting.is_set())
                        slots = [
                            name
                            for name, _n in m.snapshot().location("cuda:0").reservations
                            if " ring " in name
                        ]
                        assert len(slots) == 1, "the slot was freed under a queued copy"
                        gate.set()
                    assert [str(e) for e in errors] == ["injected transfer failure"]
            finally:
                gate.set()
            assert_nothing_left(m)
    assert libc.early == []
    assert len(libc.mapped) == 2 and sorted(libc.unmapped) == sorted(libc.mapped)


class _FilelessSource:
    """A staged source that can say where a batch lies (``direct_reads``) but has no files to
    lock (no ``files()``, no ``reads_direct``)."""

    workers = 1
    max_batch_nbytes = 16

    def plan_epoch(self) -> list[int]:
        return [0]

    def read_into(self, plan: Any, out: torch.Tensor) -> Any:
        raise AssertionError("never read")

    def direct_reads(self, plan: Any) -> Any:
        raise AssertionError("never read")


async def test_pin_source_over_a_staged_source_without_files_is_refused_when_made() -> None:
    """It used to be accepted, and the first ``anext`` then failed with an AttributeError
    about ``files``."""
    async with ResidencyManager(backend=SimBackend()) as m:
        with pytest.raises(
            ValueError, match=r"_FilelessSource has no files to lock \(it needs files\(\)"
        ):
            DeviceLoader(m, _FilelessSource(), "cuda:0", pin_source=True)
        DeviceLoader(m, _FilelessSource(), "cuda:0")  # without pin_source: staged as ever
        assert_nothing_left(m)
