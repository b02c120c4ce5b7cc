"""``ShardSource`` (memory-mapped safetensors and ``.npy`` shards) alone and behind a
``DeviceLoader`` on the simulated backend (a simulation of CUDA devices in host memory): batches
bit-identical to the files, across shard boundaries and shuffled; the staging buffers charged to
``pinned-host`` as one reservation while the loader runs, and nothing left after."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from aresidency import ResidencyBudgetError, ResidencyManager
from aresidency.backends.sim import SimBackend
from aresidency.loader import DeviceLoader, ShardSource, TensorSpec, shardfiles
from aresidency.loader import shards as shards_module

from ._support import KiB, assert_nothing_left, max_charge, until

pytestmark = pytest.mark.anyio

ROWS = (5, 7, 4)  # three shards of unequal length: batches of 4 straddle the boundaries


def write_safetensors(directory: Path) -> tuple[list[Path], torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    paths, xs, ys = [], [], []
    for number, rows in enumerate(ROWS):
        x = torch.randn(rows, 3, 8, generator=generator)
        y = torch.randint(0, 1000, (rows,), generator=generator)
        path = directory / f"part-{number}.safetensors"
        save_file({"x": x, "y": y}, str(path))
        paths.append(path)
        xs.append(x)
        ys.append(y)
    return paths, torch.cat(xs), torch.cat(ys)


def sim() -> SimBackend:
    return SimBackend()


def test_iterated_alone_it_yields_the_files_samples_in_order(tmp_path: Path) -> None:
    paths, x, y = write_safetensors(tmp_path)
    with ShardSource(paths, batch_size=4) as source:
        got = list(source)
    assert len(got) == 4  # 16 samples
    assert torch.equal(torch.cat([b["x"] for b in got]), x)
    assert torch.equal(torch.cat([b["y"] for b in got]), y)


def test_npy_shards_by_key_and_a_directory_of_them_read_the_same(tmp_path: Path) -> None:
    generator = np.random.default_rng(2)
    arrays = [generator.standard_normal((rows, 6)).astype(np.float32) for rows in ROWS]
    files = []
    for number, array in enumerate(arrays):
        path = tmp_path / f"x-{number}.npy"
        np.save(path, array)
        files.append(path)
    expected = torch.from_numpy(np.concatenate(arrays))
    with ShardSource(tmp_path, batch_size=3) as by_directory:
        assert torch.equal(torch.cat(list(by_directory)), expected)
    with ShardSource({"x": files}, batch_size=3) as by_key:
        assert torch.equal(torch.cat([b["x"] for b in by_key]), expected)


@pytest.mark.parametrize("kind", ["npy", "safetensors"])
def test_runs_of_samples_are_read_from_the_file_not_copied_from_the_mapping(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contiguous runs go through pread (no page fault per page of the mapping, no torch
    thread pool); the data is the same as the mapping's, and the mapping path stays right."""
    if kind == "npy":
        arrays = [
            np.arange(rows * 6, dtype=np.float32).reshape(rows, 6) + 100 * i
            for i, rows in enumerate(ROWS)
        ]
        for number, array in enumerate(arrays):
            np.save(tmp_path / f"x-{number}.npy", array)
        expected = {"x": torch.from_numpy(np.concatenate(arrays))}
        paths: Any = tmp_path
    else:
        paths, x, y = write_safetensors(tmp_path)
        expected = {"x": x, "y": y}

    def read_all(source: ShardSource) -> dict[str, torch.Tensor]:
        batches = list(source)
        if source.tensor_batches:
            return {"x": torch.cat(batches)}
        return {k: torch.cat([b[k] for b in batches]) for k in expected}

    reads: list[int] = []
    real = shards_module.pread_into
    monkeypatch.setattr(
        shards_module,
        "pread_into",
        lambda file, off, *rest: (reads.append(off), real(file, off, *rest)),
    )
    with ShardSource(paths, batch_size=4) as source:
        got = read_all(source)
    assert reads, "no run was read with pread"
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    monkeypatch.setattr(shards_module, "PREAD", False)
    reads.clear()
    with ShardSource(paths, batch_size=4) as source:
        got = read_all(source)
    assert not reads
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_shard_cut_short_after_opening_is_an_error_naming_the_missing_bytes(
    tmp_path: Path,
) -> None:
    """A file truncated under the source: pread says so (a read from the mapping would kill
    the process with SIGBUS)."""
    path = tmp_path / "x-0.npy"
    np.save(path, np.ones((64, 256), dtype=np.float32))
    with ShardSource([path], batch_size=16) as source:
        plans = source.plan_epoch()
        with open(path, "r+b") as file:
            file.truncate(path.stat().st_size - 20 * 1024)
        buffer = torch.zeros(source.max_batch_nbytes, dtype=torch.uint8)
        source.read_into(plans[0], buffer)  # still in the file
        with pytest.raises(OSError, match=r"ended early: \d+ B missing"):
            source.read_into(plans[3], buffer)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"seed": 1.5}, "seed must be an int"),
        ({"seed": "7"}, "seed must be an int"),
        ({"seed": True}, "seed must be an int"),
        ({"shuffle": "no"}, "shuffle must be True or False"),
        ({"drop_last": 1}, "drop_last must be True or False"),
        ({"batch_size": "4"}, "batch_size must be an int >= 1, got '4' \\(str\\)"),
        ({"workers": 2.0}, "workers must be an int >= 1, got 2.0 \\(float\\)"),
        ({"align": "256"}, "align must be a power of two"),
        # A string was iterated into characters: keys="image" asked for tensors 'i', 'm'...
        ({"keys": "x"}, r"keys must be a list of tensor names, got 'x' \(for one tensor: keys="),
    ],
)
def test_shard_source_options_of_the_wrong_type_are_refused(
    tmp_path: Path, option: dict[str, Any], message: str
) -> None:
    """Rather than read as something else (``shuffle="no"`` was true, ``seed=1.5`` was 1)."""
    np.save(tmp_path / "x-0.npy", np.ones((8, 4), dtype=np.float32))
    with pytest.raises(TypeError, match=message):
        ShardSource([tmp_path / "x-0.npy"], **{"batch_size": 4, **option})
    with ShardSource([tmp_path / "x-0.npy"], batch_size=4, seed=np.int64(3)) as source:
        assert source.seed == 3 and type(source.seed) is int  # a numpy integer is an int


def test_a_key_without_shards_or_keys_naming_nothing_are_refused_saying_so(
    tmp_path: Path,
) -> None:
    """A mapping whose key has no .npy file was an IndexError from inside the source, and
    ``keys=[]`` said the file "holds no tensor"."""
    np.save(tmp_path / "x-0.npy", np.ones((8, 4), dtype=np.float32))
    with pytest.raises(ValueError, match=r"no \.npy shard given for key 'y'"):
        ShardSource({"x": [tmp_path / "x-0.npy"], "y": []}, batch_size=4)
    save_file({"x": torch.ones(8, 4)}, str(tmp_path / "p.safetensors"))
    with pytest.raises(ValueError, match="keys= names no tensor"):
        ShardSource([tmp_path / "p.safetensors"], batch_size=4, keys=[])


@pytest.mark.parametrize(
    ("second", "held"),
    [
        (np.ones((6, 4), dtype=np.float64), "float64 samples of shape (4,)"),
        (np.ones((6, 3), dtype=np.float32), "float32 samples of shape (3,)"),
    ],
    ids=["dtype", "sample shape"],
)
def test_shards_that_disagree_are_refused_naming_both_files_and_what_each_holds(
    tmp_path: Path, second: np.ndarray, held: str
) -> None:
    np.save(tmp_path / "a.npy", np.ones((8, 4), dtype=np.float32))
    np.save(tmp_path / "b.npy", second)
    with pytest.raises(ValueError) as info:
        ShardSource([tmp_path / "a.npy", tmp_path / "b.npy"], batch_size=4)
    message = str(info.value)
    assert f"shard 1 ({tmp_path / 'b.npy'}) holds {held}" in message
    assert f"the first shard ({tmp_path / 'a.npy'}) holds float32 samples of shape (4,)" in message


@pytest.mark.parametrize("width", [33, 300], ids=["132 B rows", "1200 B rows"])
@pytest.mark.parametrize("reader", ["kernel", "torch"])
def test_shuffled_batches_are_the_files_rows_whichever_reads_them(
    tmp_path: Path, reader: str, width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shuffled batches are gathered out of the mapping by the kernel (``process_vm_readv``,
    up to 1024 rows a call: these batches take several calls) for rows of 1 KiB and more, or
    by torch (smaller rows, or where the call is refused): the same bytes either way, every
    row once."""
    calls = []
    if reader == "torch":
        monkeypatch.setattr(shardfiles, "_self_read", None)
    elif shardfiles._self_read is None:
        pytest.skip("no process_vm_readv here")
    else:
        real = shardfiles._self_read
        monkeypatch.setattr(
            shardfiles, "_self_read", lambda *args: (calls.append(args[4]), real(*args))[1]
        )
    rows = np.random.default_rng(5).standard_normal((3000, width)).astype("f4")
    np.save(tmp_path / "x-0.npy", rows[:1900])
    np.save(tmp_path / "x-1.npy", rows[1900:])
    with ShardSource(sorted(tmp_path.glob("*.npy")), batch_size=2500, shuffle=True) as source:
        got = torch.cat(list(source))
    assert got.shape == (3000, width)
    weights = torch.arange(1.0, width + 1.0, dtype=torch.float64)
    order = torch.from_numpy(rows).double() @ weights
    seen = got.double() @ weights
    assert torch.equal(seen.sort().values, order.sort().values)  # every row once, unchanged
    kernel_rows = reader == "kernel" and width * 4 >= shardfiles.KERNEL_ROW_MIN
    assert (sum(calls) == 3000) if kernel_rows else not calls, calls


@pytest.mark.parametrize("reader", ["kernel", "torch"])
def test_a_shard_cut_short_is_an_error_for_shuffled_batches_too(
    tmp_path: Path, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shuffled batches are gathered from the mapping, where a page past the end of a file cut
    short would kill the process with SIGBUS: the file is checked first."""
    if reader == "torch":
        monkeypatch.setattr(shardfiles, "_self_read", None)
    path = tmp_path / "x-0.npy"
    np.save(path, np.ones((64, 1024), dtype=np.float32))
    with ShardSource([path], batch_size=16, shuffle=True, seed=1) as source:
        batches = iter(source)
        next(batches)
        with open(path, "r+b") as file:
            file.truncate(4096)
        with pytest.raises(OSError, match=r"x-0\.npy ended early: \d+ B missing"):
            next(batches)


CUT_WHILE_READ = """
import sys
import numpy as np
from aresidency.loader import ShardSource, shardfiles
if shardfiles._self_read is None:
    print("skip")
    sys.exit(0)
path = sys.argv[1]
np.save(path, np.ones((64, 1024), dtype=np.float32))
checks = []
real = shardfiles._check_holds
def check(file, needed):
    if not checks:  # the file is cut just after the check passes
        checks.append(needed)
        with open(path, "r+b") as f:
            f.truncate(4096)
        return
    real(file, needed)
shardfiles._check_holds = check
with ShardSource([path], batch_size=64, shuffle=True) as source:
    try:
        next(iter(source))
    except OSError as error:
        print("OSError", error)
"""


def test_a_shard_cut_short_while_its_rows_are_read_is_an_error_not_a_crash(
    tmp_path: Path,
) -> None:
    """The file is cut between the check and the copy (forced here): the kernel's copy stops
    short instead of raising SIGBUS, and the error names the file. A subprocess, since a
    regression would kill the process."""
    done = subprocess.run(
        [sys.executable, "-c", CUT_WHILE_READ, str(tmp_path / "x-0.npy")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.stdout.strip() == "skip":
        pytest.skip("no process_vm_readv here")
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "OSError" in done.stdout and "x-0.npy ended early" in done.stdout, done.stdout


def test_a_shard_replaced_after_opening_is_an_error_naming_it(tmp_path: Path) -> None:
    """The file is opened for each read, so a file replaced under the source (a new inode at
    its path) is refused with its name rather than read as other data."""
    path = tmp_path / "x-0.npy"
    np.save(path, np.zeros((64, 256), dtype=np.float32))
    with ShardSource([path], batch_size=16) as source:
        plan = source.plan_epoch()[0]
        buffer = torch.zeros(source.max_batch_nbytes, dtype=torch.uint8)
        source.read_into(plan, buffer)
        replacement = tmp_path / "new.npy"
        np.save(replacement, np.ones((64, 256), dtype=np.float32))
        replacement.replace(path)
        with pytest.raises(OSError, match=r"x-0\.npy was replaced since the ShardSource"):
            source.read_into(plan, buffer)


def test_reading_keeps_no_descriptor_open_per_shard(tmp_path: Path) -> None:
    """Reads open and close their file: a source of many shards holds no more descriptors
    after reading every batch than before (the mappings hold theirs from construction)."""
    fds = Path("/proc/self/fd")
    if not fds.exists():
        pytest.skip("needs /proc/self/fd")
    paths = []
    for number in range(40):
        paths.append(tmp_path / f"x-{number:03d}.npy")
        np.save(paths[-1], np.full((8, 16), number, dtype=np.float32))
    with ShardSource(paths, batch_size=4) as source:
        opened = len(list(fds.iterdir()))
        batches = list(source)
        assert len(list(fds.iterdir())) == opened
    assert [int(b[0, 0]) for b in batches[::2]] == list(range(40))


def test_read_into_lays_each_key_out_aligned_in_one_buffer(tmp_path: Path) -> None:
    paths, x, y = write_safetensors(tmp_path)
    with ShardSource(paths, batch_size=4, align=256) as source:
        plan = source.plan_epoch()[1]
        buffer = torch.zeros(source.max_batch_nbytes, dtype=torch.uint8)
        layout = source.read_into(plan, buffer)
    assert isinstance(layout["x"], TensorSpec) and layout["x"].offset == 0
    assert layout["y"].offset % 256 == 0
    assert torch.equal(layout["x"].view(buffer), x[4:8])
    assert torch.equal(layout["y"].view(buffer), y[4:8])


async def test_a_loader_over_shards_hands_out_the_files_bit_identical(
    tmp_path: Path, ring: bool | None
) -> None:
    paths, x, y = write_safetensors(tmp_path)
    budget = 4 * KiB
    with ShardSource(paths, batch_size=4, workers=2) as source:
        async with ResidencyManager(budgets={"cuda:0": budget}, backend=sim()) as m:
            got_x, got_y = [], []
            async with DeviceLoader(
                m, source, "cuda:0", prefetch=2, staging_slots=3, ring=ring
            ) as loader:
                async for batch in loader:
                    assert batch["x"].device == x.device  # the simulation's cuda is host memory
                    got_x.append(batch["x"].clone())
                    got_y.append(batch["y"].clone())
                    # The staging buffers are one pinned-host reservation while the loader runs.
                    pinned = m.snapshot().location("pinned-host")
                    assert pinned.reserved_bytes == loader.pinned_bytes > 0
                    assert loader.staging is not None
                    assert loader.pinned_bytes == 3 * loader.staging.nbytes
                stats = loader.stats()
            assert max_charge(m.trace()) <= budget
            assert_nothing_left(m)
    assert torch.equal(torch.cat(got_x), x)
    assert torch.equal(torch.cat(got_y), y)
    assert stats.batches == stats.source_batches == 4
    # A staged batch's bytes are its buffer's filled part: the tensors, each key aligned.
    assert stats.source_bytes == stats.bytes >= x.numel() * 4 + y.numel() * 8
    assert stats.pinned_bytes == loader.pinned_bytes


async def test_npy_shards_whose_samples_hold_no_bytes_are_read_like_safetensors_ones(
    tmp_path: Path, ring: bool | None
) -> None:
    """A key whose samples hold no bytes (an array of shape (rows, 0), say a modality absent
    from this dataset) beside one that does: the ``.npy`` shard was refused at construction
    with torch's "both buffer length (128) and count (0) must not be 0", naming no file,
    while the same shard as safetensors was read."""
    rows = (5, 3)
    ys = [np.arange(n, dtype=np.int64) + 10 * i for i, n in enumerate(rows)]
    files: dict[str, list[Path]] = {"empty": [], "y": []}
    for number, (n, y) in enumerate(zip(rows, ys, strict=True)):
        for key, array in (("empty", np.zeros((n, 0), np.float32)), ("y", y)):
            path = tmp_path / f"{key}-{number}.npy"
            np.save(path, array)
            files[key].append(path)
    with ShardSource(files, batch_size=3, workers=2) as source:
        alone = list(source)
        async with ResidencyManager(backend=sim()) as m:
            async with DeviceLoader(m, source, "cuda:0", prefetch=1, ring=ring) as loader:
                got = [
                    {key: tensor.clone() for key, tensor in batch.items()} async for batch in loader
                ]
            assert_nothing_left(m)
    for batches_ in (alone, got):
        assert [b["empty"].shape for b in batches_] == [(3, 0), (3, 0), (2, 0)]
        assert torch.equal(
            torch.cat([b["y"] for b in batches_]), torch.from_numpy(np.concatenate(ys))
        )


async def test_shuffled_shards_give_every_sample_once_in_a_new_order_each_epoch(
    tmp_path: Path, ring: bool | None
) -> None:
    paths, _x, y = write_safetensors(tmp_path)
    orders = []
    with ShardSource(paths, batch_size=5, shuffle=True, seed=3, keys=["y"]) as source:
        async with (
            ResidencyManager(backend=sim()) as m,
            DeviceLoader(m, source, "cuda:0", prefetch=2, ring=ring) as loader,
        ):
            for _epoch in range(2):
                seen = [batch["y"].clone() async for batch in loader]
                orders.append(torch.cat(seen))
    for order in orders:
        assert sorted(order.tolist()) == sorted(y.tolist())
    assert not torch.equal(orders[0], orders[1])


class FailingSource:
    """A staged source whose read of batch ``bad`` raises."""

    workers = 2
    max_batch_nbytes = 64

    def __init__(self, count: int, bad: int) -> None:
        self.count = count
        self.bad = bad

    def plan_epoch(self) -> Sequence[Any]:
        return list(range(self.count))

    def read_into(self, plan: Any, out: torch.Tensor) -> Any:
        if plan == self.bad:
            raise OSError(f"shard for batch {plan} is unreadable")
        spec = TensorSpec(0, torch.int64, (4,))
        spec.view(out).copy_(torch.arange(4) + 4 * plan)
        return spec


async def test_a_failed_read_reaches_the_consumer_after_the_batches_before_it(
    ring: bool | None,
) -> None:
    got = []
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(
            m, FailingSource(6, bad=3), "cuda:0", prefetch=2, ring=ring
        ) as loader:
            with pytest.raises(OSError, match="batch 3 is unreadable"):
                async for batch in loader:
                    got.append(batch.clone())
        assert_nothing_left(m)
    assert [b.tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


async def test_breaking_out_of_a_shard_loader_gives_back_the_staging_buffers(
    tmp_path: Path, ring: bool | None
) -> None:
    paths, x, _y = write_safetensors(tmp_path)
    with ShardSource(paths, batch_size=2, keys=["x"]) as source:
        async with ResidencyManager(backend=sim()) as m:
            with anyio.fail_after(10):
                async with DeviceLoader(m, source, "cuda:0", prefetch=3, ring=ring) as loader:
                    async for batch in loader:
                        assert torch.equal(batch["x"], x[:2])
                        break
            assert_nothing_left(m)


async def test_staging_that_does_not_fit_pinned_host_is_refused_with_what_to_do(
    tmp_path: Path, ring: bool | None
) -> None:
    paths, _x, _y = write_safetensors(tmp_path)
    with ShardSource(paths, batch_size=4) as source:
        async with ResidencyManager(budgets={"pinned-host": 1 * KiB}, backend=sim()) as m:
            async with DeviceLoader(m, source, "cuda:0", ring=ring) as loader:
                with pytest.raises(ResidencyBudgetError) as info:
                    await anext(aiter(loader))
            assert "lower staging_slots" in "".join(getattr(info.value, "__notes__", []))
            assert_nothing_left(m)


class SlowFirstPassSource:
    """A staged source whose read of batch 2 in the first pass is slow: it waits (at most
    half a second) for a read of a later pass to start, and notes whether one did, that is
    whether a later pass read while it still wrote into a staging buffer."""

    workers = 3
    max_batch_nbytes = 64

    def __init__(self) -> None:
        self.passes = 0
        self.slow_in_flight = threading.Event()
        self.later_read_started = threading.Event()
        self.overlapped = False

    def plan_epoch(self) -> Sequence[Any]:
        self.passes += 1
        return [(self.passes, i) for i in range(4)]

    def read_into(self, plan: Any, out: torch.Tensor) -> Any:
        number, index = plan
        if number > 1:
            if self.slow_in_flight.is_set():
                self.overlapped = True
            self.later_read_started.set()
        elif index == 2:
            self.slow_in_flight.set()
            self.later_read_started.wait(0.5)
            self.slow_in_flight.clear()
        spec = TensorSpec(0, torch.int64, (4,))
        spec.view(out).copy_(torch.arange(4) + 4 * index + 100 * number)
        return spec


async def test_a_pass_ends_only_after_the_reads_it_started(ring: bool | None) -> None:
    """Breaking out of a pass while a read is in flight (batch 2's, while the pass waits to
    copy batch 1: no prefetch): the next pass reads into the staging buffers only after that
    read ended (it would otherwise write into a buffer the next pass filled), and hands out
    its own data."""
    source = SlowFirstPassSource()
    async with ResidencyManager(backend=sim()) as m:
        async with DeviceLoader(
            m, source, "cuda:0", prefetch=0, staging_slots=3, ring=ring
        ) as loader:
            async for _batch in loader:
                with anyio.fail_after(5):
                    await anyio.to_thread.run_sync(source.slow_in_flight.wait)
                break
            got = [batch.clone() async for batch in loader]
        assert_nothing_left(m)
    assert not source.overlapped
    assert [b.tolist() for b in got] == [[200 + 4 * i + k for k in range(4)] for i in range(4)]


async def test_a_pass_after_breaking_out_of_one_gets_every_staging_buffer_back(
    tmp_path: Path, ring: bool | None
) -> None:
    paths, x, _y = write_safetensors(tmp_path)
    with ShardSource(paths, batch_size=2, keys=["x"], workers=2) as source:
        async with ResidencyManager(backend=sim()) as m:
            with anyio.fail_after(5):
                async with DeviceLoader(
                    m, source, "cuda:0", prefetch=1, staging_slots=2, ring=ring
                ) as loader:
                    for _attempt in range(3):  # each pass stops with buffers filled ahead
                        async for _batch in loader:
                            # Wait until both buffers hold batches (one handed out, one filled).
                            filled = 2 * _attempt + 2
                            await until(lambda n=filled: loader.stats().source_batches >= n)
                            break
                    got = [batch["x"].clone() async for batch in loader]
            assert_nothing_left(m)
    assert torch.equal(torch.cat(got), x)


@pytest.mark.parametrize("shuffle", [False, True], ids=["runs", "shuffled"])
def test_read_pieces_cut_a_large_batch_into_pieces_that_fill_it_in_any_order(
    tmp_path: Path, shuffle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3 MiB batch asked for in 8 parts with pieces of at least a MiB (the module's setting,
    lowered from its default): 3 pieces (or more where the batch spans shards), and running
    them backwards fills the buffer as read_into does."""
    monkeypatch.setattr(shards_module, "MIN_PIECE", 1 << 20)
    rows = 3 * 1024  # 1 KiB samples: 3 MiB per batch
    generator = np.random.default_rng(3)
    for number in range(2):
        np.save(tmp_path / f"x-{number}.npy", generator.standard_normal((rows, 256)).astype("f4"))
    with ShardSource(sorted(tmp_path.glob("*.npy")), batch_size=rows, shuffle=shuffle) as source:
        plans = source.plan_epoch()
        for plan in plans:
            whole = torch.zeros(source.max_batch_nbytes, dtype=torch.uint8)
            layout = source.read_into(plan, whole)
            pieces_buffer = torch.zeros_like(whole)
            same_layout, pieces = source.read_pieces(plan, pieces_buffer, 8)
            assert same_layout == layout
            assert 3 <= len(pieces) <= 6
            for piece in reversed(pieces):
                piece()
            assert torch.equal(pieces_buffer, whole)
            assert len(source.read_pieces(plan, pieces_buffer, 1)[1]) == len(plan.runs)
    monkeypatch.undo()
    with ShardSource(sorted(tmp_path.glob("*.npy")), batch_size=rows) as source:
        plan = source.plan_epoch()[0]
        buffer = torch.empty(source.max_batch_nbytes, dtype=torch.uint8)
        assert len(source.read_pieces(plan, buffer, 8)[1]) == 1  # under 32 MiB: one piece


class PiecesSource:
    """A staged source read only in pieces, ``workers`` per batch of ``workers`` int64 (piece
    ``k`` of batch ``b`` writes ``10 * b + k``). The pieces of a batch meet at a barrier, so a
    batch is read only if its pieces run in different threads at once. In batch
    ``fail_batch`` piece 0 fails at once while piece 1 goes on until the consumer saw the error
    (or half a second passed): ``late_piece_ended_first`` says whether it ended before that."""

    def __init__(self, workers: int, fail_batch: int | None = None) -> None:
        self.workers = workers
        self.max_batch_nbytes = 8 * workers
        self.fail_batch = fail_batch
        self.barrier = threading.Barrier(workers, timeout=5)
        self.failed = threading.Event()
        self.consumer_saw_error = threading.Event()
        self.late_piece_ended = threading.Event()

    def plan_epoch(self) -> Sequence[Any]:
        return list(range(4))

    def read_into(self, plan: Any, out: torch.Tensor) -> Any:
        raise AssertionError("the loader read a batch in one piece")

    def read_pieces(self, plan: Any, out: torch.Tensor, parts: int) -> tuple[Any, list[Any]]:
        assert parts == self.workers
        spec = TensorSpec(0, torch.int64, (parts,))
        view = spec.view(out)

        def piece(k: int) -> None:
            if plan == self.fail_batch and k == 0:
                self.failed.set()
                raise OSError(f"piece {k} of batch {plan} failed")
            if plan == self.fail_batch:
                if k == 1:
                    self.failed.wait(5)
                    self.consumer_saw_error.wait(0.5)
                    self.late_piece_ended.set()
                view[k] = 10 * plan + k
                return
            self.barrier.wait()
            view[k] = 10 * plan + k

        return spec, [functools.partial(piece, k) for k in range(parts)]


async def test_a_loader_reads_each_batch_several_threads_wide(ring: bool | None) -> None:
    source = PiecesSource(workers=3)
    async with ResidencyManager(backend=sim()) as m:
        with anyio.fail_after(10):
            async with DeviceLoader(m, source, "cuda:0", prefetch=1, ring=ring) as loader:
                got = [batch.tolist() async for batch in loader]
        assert_nothing_left(m)
    assert got == [[10 * b + k for k in range(3)] for b in range(4)]


async def test_a_failed_piece_raises_at_its_batch_after_the_batchs_other_pieces(
    ring: bool | None,
) -> None:
    """The error reaches the consumer with its type, after the batches before it, and only
    once no piece of its batch still writes the staging buffer."""
    source = PiecesSource(workers=2, fail_batch=3)  # the last: no later read holds the pass
    got: list[list[int]] = []
    async with ResidencyManager(backend=sim()) as m:
        with anyio.fail_after(10):
            async with DeviceLoader(m, source, "cuda:0", prefetch=1, ring=ring) as loader:
                with pytest.raises(OSError, match="piece 0 of batch 3 failed"):
                    async for batch in loader:
                        got.append(batch.tolist())
                late_piece_ended_first = source.late_piece_ended.is_set()
                source.consumer_saw_error.set()
        assert_nothing_left(m)
    assert got == [[0, 1], [10, 11], [20, 21]]
    assert late_piece_ended_first


async def test_staging_starts_every_fill_thread_when_it_opens() -> None:
    """An executor starts a thread on a submit that finds none idle and waits for it to run:
    off the loop, at open, so that a submit from the loop never does."""
    from aresidency.loader.staging import StagingSlots

    slots = StagingSlots(2, 4 * KiB, 3, "prestart")
    async with ResidencyManager(backend=sim()) as m:
        await slots.open(m)
        try:
            names = [t.name for t in threading.enumerate() if t.is_alive()]
            assert sum(n.startswith("aresidency-loader-fill-prestart") for n in names) == 3
        finally:
            await slots.aclose()
