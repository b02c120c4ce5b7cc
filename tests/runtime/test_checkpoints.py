"""The safetensors reader: single files, sharded checkpoints, dtype conversion, errors, threads.

Synchronous tests: no event loop, no manager."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
from safetensors.torch import save_file

from aresidency.core.locations import Location
from aresidency.runtime.checkpoints import Checkpoint, convertible
from aresidency.runtime.sources import SafetensorsSource


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(8, 16, generator=g),
        "a.bias": torch.randn(16, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(4, 4, 2, generator=g).to(torch.float16),
        "b.steps": torch.arange(10, dtype=torch.int64),
        "c.mask": torch.rand(5, generator=g) > 0.5,
        "c.scalar": torch.tensor(3.5, dtype=torch.float64),
        "c.empty": torch.empty(0, 3),
    }


def save_sharded(
    directory: Path,
    data: dict[str, torch.Tensor],
    index_name: str = "model.safetensors.index.json",
) -> dict[str, str]:
    """Two shards and a Hugging Face index (name -> shard file) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(data)
    half = len(names) // 2
    weight_map: dict[str, str] = {}
    for number, part in enumerate((names[:half], names[half:]), start=1):
        shard = f"model-{number:05d}-of-00002.safetensors"
        save_file({n: data[n] for n in part}, str(directory / shard))
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / index_name).write_text(json.dumps(index))
    return weight_map


def assert_reads(checkpoint: Checkpoint, data: dict[str, torch.Tensor]) -> None:
    assert sorted(checkpoint.names()) == sorted(data)
    assert len(checkpoint) == len(data)
    for name, expected in data.items():
        assert name in checkpoint
        info = checkpoint.info(name)
        assert (info.name, info.dtype, info.shape) == (name, expected.dtype, tuple(expected.shape))
        assert info.nbytes == expected.numel() * expected.element_size()
        got = checkpoint.read(name)
        assert got.dtype == expected.dtype and torch.equal(got, expected)


# ---------------------------------------------------------------- opening


def test_a_single_file_knows_every_tensor_and_reads_it_back_equal(tmp_path: Path) -> None:
    data = tensors()
    save_file(data, str(tmp_path / "weights.safetensors"))
    with Checkpoint.open(tmp_path / "weights.safetensors") as checkpoint:
        assert checkpoint.index is None
        assert checkpoint.files == (tmp_path / "weights.safetensors",)
        assert_reads(checkpoint, data)
        assert "nope" not in checkpoint


def test_a_directory_holding_model_safetensors_opens_that_file(tmp_path: Path) -> None:
    data = tensors()
    save_file(data, str(tmp_path / "model.safetensors"))
    with Checkpoint.open(tmp_path) as checkpoint:
        assert checkpoint.files == (tmp_path / "model.safetensors",)
        assert_reads(checkpoint, data)


def test_a_sharded_directory_reads_each_tensor_from_its_shard(tmp_path: Path) -> None:
    data = tensors()
    weight_map = save_sharded(tmp_path, data)
    with Checkpoint.open(tmp_path) as checkpoint:
        assert checkpoint.index == tmp_path / "model.safetensors.index.json"
        assert len(checkpoint.files) == 2
        assert_reads(checkpoint, data)
        for name, shard in weight_map.items():
            assert checkpoint.info(name).file == tmp_path / shard


def test_the_path_of_an_index_opens_the_sharded_checkpoint(tmp_path: Path) -> None:
    data = tensors()
    save_sharded(tmp_path, data, index_name="diffusion.safetensors.index.json")
    with Checkpoint.open(tmp_path / "diffusion.safetensors.index.json") as checkpoint:
        assert_reads(checkpoint, data)
    with Checkpoint.open(tmp_path) as checkpoint:  # the directory's only index
        assert_reads(checkpoint, data)


# ---------------------------------------------------------------- dtypes


def test_a_bf16_checkpoint_reads_into_float32_bit_exact(tmp_path: Path) -> None:
    source = torch.randn(64, 33, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    save_file({"w": source}, str(tmp_path / "w.safetensors"))
    with Checkpoint.open(tmp_path / "w.safetensors") as checkpoint:
        out = torch.full((64, 33), float("nan"))
        checkpoint.read_into("w", out)
        assert torch.equal(out, source.float())
        assert torch.equal(out.to(torch.bfloat16), source)  # every bit came through
        assert torch.equal(checkpoint.read("w", torch.float32), source.float())


def test_a_float32_checkpoint_reads_into_bf16_rounded_as_torch_rounds(tmp_path: Path) -> None:
    source = torch.randn(64, 33, generator=torch.Generator().manual_seed(2))
    save_file({"w": source}, str(tmp_path / "w.safetensors"))
    with Checkpoint.open(tmp_path / "w.safetensors") as checkpoint:
        out = torch.zeros(64, 33, dtype=torch.bfloat16)
        checkpoint.read_into("w", out)
        assert torch.equal(out, source.to(torch.bfloat16))
        assert not torch.equal(out.float(), source)  # it did round


def test_read_into_fills_a_strided_destination_in_place(tmp_path: Path) -> None:
    source = torch.randn(6, 10)
    save_file({"w": source}, str(tmp_path / "w.safetensors"))
    base = torch.zeros(10, 6, dtype=torch.float64)
    out = base.t()  # a transposed view: not contiguous
    with Checkpoint.open(tmp_path / "w.safetensors") as checkpoint:
        checkpoint.read_into("w", out)
    assert torch.equal(base.t(), source.double())


def test_integers_are_not_converted_to_floats_or_between_widths(tmp_path: Path) -> None:
    save_file({"steps": torch.arange(4)}, str(tmp_path / "w.safetensors"))
    with Checkpoint.open(tmp_path / "w.safetensors") as checkpoint:
        with pytest.raises(ValueError, match=r"'steps' is torch\.int64.*torch\.float32"):
            checkpoint.read_into("steps", torch.zeros(4))
        with pytest.raises(ValueError, match="steps"):
            checkpoint.read_into("steps", torch.zeros(4, dtype=torch.int32))
    assert convertible(torch.bfloat16, torch.float32) and convertible(torch.int8, torch.int8)
    assert not convertible(torch.int64, torch.float32)


def test_a_dtype_torch_cannot_hold_is_an_error_naming_file_and_tensor(tmp_path: Path) -> None:
    # A header written by hand: safetensors knows F6_E2M3, torch has no such dtype.
    path = tmp_path / "f6.safetensors"
    header = {"odd": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 3)  # data covers the file
    with pytest.raises(ValueError) as caught:
        Checkpoint.open(path).info("odd")
    message = str(caught.value)
    assert str(path) in message
    if "not a readable safetensors file" in message:
        # safetensors before F6_E2M3 existed (0.4) refuses the whole header, naming no tensor
        assert "dtype this safetensors version does not know" in message
    else:
        assert "'odd'" in message and "F6_E2M3" in message


# ---------------------------------------------------------------- errors


def test_a_missing_path_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Checkpoint.open(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors"):
        Checkpoint.open(tmp_path)


def test_an_index_naming_a_missing_shard_is_an_error_naming_shard_and_tensor(
    tmp_path: Path,
) -> None:
    weight_map = save_sharded(tmp_path, tensors())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    name = next(n for n, shard in weight_map.items() if shard.startswith("model-00002"))
    with pytest.raises(FileNotFoundError) as caught:
        Checkpoint.open(tmp_path)
    assert "model-00002-of-00002.safetensors" in str(caught.value)
    assert repr(name) in str(caught.value)


def test_a_tensor_in_two_shards_is_an_error_naming_both(tmp_path: Path) -> None:
    save_sharded(tmp_path, tensors())
    save_file(
        {"a.weight": torch.zeros(8, 16), "extra": torch.zeros(1)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    with pytest.raises(ValueError, match=r"'a\.weight' is in two shards") as caught:
        Checkpoint.open(tmp_path)
    assert "model-00001-of-00002" in str(caught.value)
    assert "model-00002-of-00002" in str(caught.value)


def test_an_index_that_does_not_match_its_shards_is_an_error(tmp_path: Path) -> None:
    weight_map = save_sharded(tmp_path, tensors())
    moved = next(iter(weight_map))
    other = next(s for s in set(weight_map.values()) if s != weight_map[moved])
    weight_map[moved] = other
    index = {"weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"puts tensor '{moved}' in .*{other}"):
        Checkpoint.open(tmp_path)


def test_several_indexes_in_a_directory_must_be_chosen_between(tmp_path: Path) -> None:
    save_sharded(tmp_path, tensors(), index_name="a.safetensors.index.json")
    save_sharded(tmp_path, tensors(), index_name="b.safetensors.index.json")
    with pytest.raises(ValueError, match=r"several indexes \(a\..*b\."):
        Checkpoint.open(tmp_path)


def test_a_missing_tensor_is_a_keyerror_naming_checkpoint_and_tensor(tmp_path: Path) -> None:
    save_file(tensors(), str(tmp_path / "w.safetensors"))
    with Checkpoint.open(tmp_path / "w.safetensors") as checkpoint:
        for call in (
            lambda: checkpoint.info("ghost"),
            lambda: checkpoint.read("ghost"),
            lambda: checkpoint.read_into("ghost", torch.zeros(1)),
        ):
            with pytest.raises(KeyError, match=r"w\.safetensors has no tensor named 'ghost'"):
                call()


def test_a_shape_mismatch_is_an_error_naming_both_shapes(tmp_path: Path) -> None:
    save_file(tensors(), str(tmp_path / "w.safetensors"))
    with (
        Checkpoint.open(tmp_path / "w.safetensors") as checkpoint,
        pytest.raises(ValueError, match=r"'a\.weight' has shape \[8, 16\].*\[16, 8\]"),
    ):
        checkpoint.read_into("a.weight", torch.zeros(16, 8))


def test_read_into_refuses_a_destination_off_the_host(tmp_path: Path) -> None:
    save_file(tensors(), str(tmp_path / "w.safetensors"))
    with (
        Checkpoint.open(tmp_path / "w.safetensors") as checkpoint,
        pytest.raises(ValueError, match="must be a CPU tensor"),
    ):
        checkpoint.read_into("a.weight", torch.empty(8, 16, device="meta"))


def test_a_closed_checkpoint_refuses_reads(tmp_path: Path) -> None:
    save_file(tensors(), str(tmp_path / "w.safetensors"))
    checkpoint = Checkpoint.open(tmp_path / "w.safetensors")
    checkpoint.read("a.weight")
    checkpoint.close()
    with pytest.raises(RuntimeError, match="closed"):
        checkpoint.read("a.weight")


# ---------------------------------------------------------------- memory and threads


def test_read_returns_memory_of_its_own(tmp_path: Path) -> None:
    data = tensors()
    save_file(data, str(tmp_path / "w.safetensors"))
    with Checkpoint.open(tmp_path / "w.safetensors") as checkpoint:
        first = checkpoint.read("a.weight")
        first.fill_(7.0)
        assert torch.equal(checkpoint.read("a.weight"), data["a.weight"])


def test_concurrent_read_into_from_several_threads_gives_correct_data(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    data = {f"t{i}": torch.randn(64 + i, 129, generator=g) for i in range(12)}
    data.update({f"h{i}": torch.randn(257, 31, generator=g).half() for i in range(12)})
    save_sharded(tmp_path, data)
    checkpoint = Checkpoint.open(tmp_path)  # views made on first use, by the threads
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            start.wait()
            names = sorted(data)
            for round_ in range(20):
                for name in names[(seed + round_) % len(names) :] + names[:seed]:
                    # half the reads convert: the destination is float64
                    dtype = torch.float64 if (seed + round_) % 2 else data[name].dtype
                    out = torch.empty(data[name].shape, dtype=dtype)
                    checkpoint.read_into(name, out)
                    assert torch.equal(out, data[name].to(dtype)), name
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    checkpoint.close()
    assert not errors, errors[0]


# ---------------------------------------------------------------- SafetensorsSource


def test_safetensors_source_loads_equal_tensors_from_single_and_sharded(tmp_path: Path) -> None:
    data = tensors()
    save_file(data, str(tmp_path / "single.safetensors"))
    save_sharded(tmp_path / "sharded", data)
    shared = Checkpoint.open(tmp_path / "sharded" / "model.safetensors.index.json")
    for name, expected in data.items():
        for where in (tmp_path / "single.safetensors", tmp_path / "sharded", shared):
            source = SafetensorsSource(where, name)
            assert source.shape == tuple(expected.shape) and source.dtype == expected.dtype
            assert source.source_location == Location("pageable-host")
            assert source.nbytes == expected.numel() * expected.element_size()
            loaded = source.load()
            assert loaded.dtype == expected.dtype and torch.equal(loaded, expected)
            assert loaded.device.type == "cpu"


def test_safetensors_source_of_a_missing_name_is_a_keyerror_naming_both(tmp_path: Path) -> None:
    save_file(tensors(), str(tmp_path / "w.safetensors"))
    with pytest.raises(KeyError, match=r"w\.safetensors has no tensor named 'ghost'"):
        SafetensorsSource(tmp_path / "w.safetensors", "ghost")


# ---------------------------------------------------------------- the file changing under it


def test_a_file_renamed_over_or_removed_keeps_reading_what_was_opened(tmp_path: Path) -> None:
    # The safe way to replace a checkpoint (write a new file, rename it over the old one),
    # and removing it: the open checkpoint's mapping keeps the opened file's data.
    data = tensors()
    path = tmp_path / "model.safetensors"
    save_file(data, str(path))
    with Checkpoint.open(path) as checkpoint:
        new = tmp_path / "new.safetensors"
        save_file({name: torch.zeros_like(t) for name, t in data.items()}, str(new))
        new.replace(path)
        assert_reads(checkpoint, data)
        path.unlink()
        assert_reads(checkpoint, data)


def test_a_file_rewritten_in_place_is_refused_not_read_torn(tmp_path: Path) -> None:
    # Rewritten in place, same size: the mapping would show the new bytes (a mix of both
    # checkpoints for a read in progress). Refused, naming the file, until opened again.
    data = tensors()
    path = tmp_path / "model.safetensors"
    save_file(data, str(path))
    with Checkpoint.open(path) as checkpoint:
        assert_reads(checkpoint, data)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        stat = path.stat()
        path.write_bytes(bytes(raw))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # coarse clocks
        with pytest.raises(RuntimeError, match="was written in place since the checkpoint"):
            checkpoint.read("a.weight")
    with Checkpoint.open(path) as again:  # opened again: reads what the file holds now
        assert again.read("a.weight").shape == data["a.weight"].shape


def test_a_file_truncated_in_place_is_an_error_not_a_crash(tmp_path: Path) -> None:
    # Past a truncation, reading the mapping kills the process with SIGBUS: the read is
    # refused first. Run in a child process, so that a crash fails this test, not the run.
    data = tensors()
    path = tmp_path / "model.safetensors"
    save_file(data, str(path))
    script = (
        "import os, sys\n"
        "from aresidency.runtime.checkpoints import Checkpoint\n"
        f"checkpoint = Checkpoint.open({str(path)!r})\n"
        "checkpoint.read('a.weight')\n"
        f"os.truncate({str(path)!r}, 200)\n"
        "try:\n"
        "    checkpoint.read('b.weight')\n"
        "except RuntimeError as error:\n"
        "    print('refused:', error)\n"
        "    sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert "refused:" in done.stdout and "now 200 B" in done.stdout


def test_float8_tensors_are_never_converted_to_or_from_another_dtype(tmp_path: Path) -> None:
    """A float8 value means something only with its scale: converting it would be wrong."""
    save_file({"w": torch.ones(4).to(torch.float8_e4m3fn)}, str(tmp_path / "w.safetensors"))
    with Checkpoint.open(tmp_path / "w.safetensors") as checkpoint:
        with pytest.raises(ValueError, match=r"'w' is torch\.float8_e4m3fn.*bfloat16.*scale"):
            checkpoint.read("w", torch.bfloat16)
        assert checkpoint.read("w").dtype == torch.float8_e4m3fn  # its own dtype reads as is
    assert not convertible(torch.float32, torch.float8_e5m2)
    assert not convertible(torch.float8_e5m2, torch.float8_e4m3fn)
    assert convertible(torch.float16, torch.bfloat16)


def test_pytorch_pickle_checkpoints_are_refused_saying_how_to_convert(tmp_path: Path) -> None:
    """A directory of ``pytorch_model.bin`` (or such a file given itself) is not read: the
    error says it is a PyTorch checkpoint and how to convert it to safetensors."""
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"only PyTorch pickle files \(pytorch_model\.bin"):
        Checkpoint.open(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"save_pretrained.*safetensors\.torch\.save_file"):
        Checkpoint.open(tmp_path)
    renamed = tmp_path / "weights.data"  # found by its first bytes, whatever its name
    (tmp_path / "pytorch_model.bin").rename(renamed)
    with pytest.raises(ValueError, match=r"weights\.data is a PyTorch checkpoint.*save_file"):
        Checkpoint.open(renamed)
