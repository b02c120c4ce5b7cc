"""The device-to-host lane's streaming (non-temporal) host copy: byte for byte at every size and
alignment, used by the lane where it can be had, and a plain ``memmove`` where it cannot, with
the reason said (no GPU needed)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import pytest
import torch

from aresidency.backends import staging, streamcopy
from aresidency.backends.staging import StagingLane


def _forget(monkeypatch: pytest.MonkeyPatch, cache: str) -> None:
    """Forget the process's built copy; build into ``cache``."""
    monkeypatch.setattr(streamcopy, "_resolved", False)
    monkeypatch.setattr(streamcopy, "_function", None)
    monkeypatch.setattr(streamcopy, "_status", "not built yet")
    monkeypatch.setenv("XDG_CACHE_HOME", cache)


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    _forget(monkeypatch, str(tmp_path))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The copy, built once for this module into a cache directory of its own."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _forget(monkeypatch, str(tmp_path_factory.mktemp("cache")))
        yield _copy_or_skip()


def _copy_or_skip() -> object:
    """The built copy; skips only where it is not made (not x86-64 Linux, no compiler): a
    build that failed, or a copy that failed its own check, fails the test."""
    fn = streamcopy.streaming_memmove()
    if fn is None:
        status = streamcopy.streaming_memmove_status()
        if "x86-64 Linux only" in status or "no C compiler" in status:
            pytest.skip(f"no streaming copy here: {status}")
        pytest.fail(f"the streaming copy should be built here: {status}")
    return fn


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 65536 + 13, (1 << 20) + 77])
def test_the_streaming_copy_is_byte_exact_at_every_alignment(built: object, nbytes: int) -> None:
    fn = built
    for src_off, dst_off in [(0, 0), (1, 0), (0, 1), (3, 31), (17, 32), (64, 5)]:
        src = torch.randint(0, 256, (nbytes + 128,), dtype=torch.uint8)
        dst = torch.full((nbytes + 128,), 0xA5, dtype=torch.uint8)
        fn(dst.data_ptr() + dst_off, src.data_ptr() + src_off, nbytes)  # type: ignore[operator]
        assert torch.equal(dst[dst_off : dst_off + nbytes], src[src_off : src_off + nbytes])
        # Not a byte outside the destination was written.
        assert bool((dst[:dst_off] == 0xA5).all())
        assert bool((dst[dst_off + nbytes :] == 0xA5).all())


def test_the_copy_is_built_once_into_the_cache_and_found_there(fresh_build: None) -> None:
    _copy_or_skip()
    status = streamcopy.streaming_memmove_status()
    assert status.startswith("built with") and os.environ["XDG_CACHE_HOME"] in status
    assert streamcopy.streaming_memmove() is streamcopy.streaming_memmove()


def test_it_is_off_when_the_environment_says_so(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARESIDENCY_STREAM_COPY", "0")
    assert streamcopy.streaming_memmove() is None
    assert "ARESIDENCY_STREAM_COPY=0" in streamcopy.streaming_memmove_status()


def test_a_compiler_that_fails_gives_no_copy_and_says_why(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if streamcopy.platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("built only on x86-64")
    monkeypatch.setenv("CC", "false")  # on PATH, exits 1
    assert streamcopy.streaming_memmove() is None
    assert "false failed" in streamcopy.streaming_memmove_status()


@pytest.mark.parametrize("streaming", [True, False])
def test_the_device_to_host_lane_copies_out_with_the_streaming_copy_where_it_can(
    monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    calls: list[str] = []
    real_memmove = ctypes.memmove

    def fake_stream(d: int, s: int, n: int) -> int:
        calls.append("stream")
        return int(real_memmove(d, s, n) is None)

    def counted_memmove(d: int, s: int, n: int) -> object:
        calls.append("memmove")
        return real_memmove(d, s, n)

    monkeypatch.setattr(staging, "streaming_memmove", lambda: fake_stream)
    monkeypatch.setattr(staging.ctypes, "memmove", counted_memmove)
    lane = StagingLane(None, "d2h", 4 << 20, 2, memcpy_threads=3, streaming_stores=streaming)  # type: ignore[arg-type]
    src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    for future in lane.host_copy(dst, src):
        future.result()
    assert torch.equal(dst, src)
    lane.close()
    assert calls == ["stream" if streaming else "memmove"] * 3
    lane.close()


def test_a_lane_without_the_streaming_copy_falls_back_to_memmove(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(staging, "streaming_memmove", lambda: None)
    lane = StagingLane(None, "d2h", 4 << 20, 2, memcpy_threads=2)  # type: ignore[arg-type]
    assert lane.memmove() is ctypes.memmove
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    for future in lane.host_copy(dst, src):
        future.result()
    assert torch.equal(dst, src)
    lane.close()


def test_a_cache_that_cannot_be_written_builds_in_the_temporary_directory(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    if streamcopy.platform.machine() not in ("x86_64", "AMD64") or streamcopy._compiler() is None:
        pytest.skip("built only on x86-64 with a C compiler")
    blocker = os.path.join(tmp_path, "a-file")
    with open(blocker, "w") as f:
        f.write("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", blocker)  # its aresidency/ cannot be made
    monkeypatch.setattr(streamcopy.tempfile, "gettempdir", lambda: str(tmp_path))
    assert streamcopy.streaming_memmove() is not None
    assert str(tmp_path) in streamcopy.streaming_memmove_status()


def test_a_directory_others_may_write_is_not_built_in_nor_loaded_from(
    fresh_build: None, monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    if streamcopy.platform.machine() not in ("x86_64", "AMD64") or streamcopy._compiler() is None:
        pytest.skip("built only on x86-64 with a C compiler")
    shared = os.path.join(tmp_path, "shared")
    os.makedirs(os.path.join(shared, "aresidency"))
    os.chmod(os.path.join(shared, "aresidency"), 0o777)
    elsewhere = os.path.join(tmp_path, "tmp")
    os.makedirs(elsewhere)
    monkeypatch.setenv("XDG_CACHE_HOME", shared)
    monkeypatch.setattr(streamcopy.tempfile, "gettempdir", lambda: elsewhere)
    assert streamcopy.streaming_memmove() is not None
    status = streamcopy.streaming_memmove_status()
    assert elsewhere in status and not os.listdir(os.path.join(shared, "aresidency"))
