"""Host copies with non-temporal (streaming) stores, for the device-to-host staging lane.

The device-to-host half of a pageable transfer ends in a host memcpy out of a pinned staging
buffer into the pageable destination, and on the hosts we measured that memcpy, not the link,
is the limit. A plain ``memmove`` writes through the cache: each destination line is first read
(read-for-ownership), then written, then evicted, half again as much memory traffic as the copy
itself. glibc switches to non-temporal stores only above ``x86_non_temporal_threshold`` (a
quarter of the last-level cache, tens of MiB on a server), far above the 4 MiB pieces the
lane's threads copy. Measured on an H100 host (16 cores, ``benchmarks/diag_host_memcpy.py``,
pinned to pageable memory already faulted in): 8 threads copying 4 MiB pieces reached 27.1 GB/s
with glibc's default and 44.3 GB/s with non-temporal stores; 16 threads 38.5 and 56.3 GB/s.
In the lane itself, where the link writes the staging buffers meanwhile, a 1 GB
device-to-pageable copy went from 32.0 to 35.9 GB/s on that host.

No library that Python or torch reaches offers such a copy, so this module compiles one: a
small C function (below) built once per machine with the system C compiler (``cc``) into the
user's cache directory (``$XDG_CACHE_HOME/aresidency``, else ``~/.cache/aresidency``; a
directory of the user's under the temporary one when that cannot be written; never one that
another user may write, since code is loaded from it), as triton builds its launchers, and
called through :mod:`ctypes`, which releases the interpreter
lock for the call. It copies the unaligned head with ``memcpy``, the body with AVX2 (or SSE2)
non-temporal stores, the tail with ``memcpy``, then fences (``sfence``), so the bytes are in
memory, in order, when it returns. Anywhere this cannot be had (not x86-64, no compiler, a
failed build, ``ARESIDENCY_STREAM_COPY=0``) :func:`streaming_memmove` returns ``None`` and the
lane copies with ``ctypes.memmove`` as before; the reason is logged once (logger
``aresidency``, DEBUG).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

__all__ = ["STREAM_COPY_SOURCE", "streaming_memmove", "streaming_memmove_status"]

_log = logging.getLogger("aresidency")

#: The C source of the copy (x86-64 only): ``aresidency_stream_copy(dst, src, n)``.
STREAM_COPY_SOURCE: Final = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

__attribute__((target("avx2")))
static void body_avx2(char *d, const char *s, size_t n) {
    for (; n >= 128; n -= 128, d += 128, s += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(d + 96), e);
    }
    memcpy(d, s, n);
}

static void body_sse2(char *d, const char *s, size_t n) {
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
}

/* Copy n bytes (non-overlapping); returns 2 (AVX2 body), 1 (SSE2 body) or 0 (memcpy only). */
int aresidency_stream_copy(void *dst, const void *src, size_t n) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (size_t)((32 - ((uintptr_t)d & 31)) & 31);
    if (n < 4096) {
        memcpy(d, s, n);
        return 0;
    }
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    int avx2 = __builtin_cpu_supports("avx2");
    if (avx2) body_avx2(d, s, n); else body_sse2(d, s, n);
    _mm_sfence();
    return avx2 ? 2 : 1;
}
"""

_lock = threading.Lock()
_resolved = False
_function: Callable[[int, int, int], int] | None = None
_status = "not built yet"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aresidency"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _private(path: Path) -> bool:
    """Whether ``path`` belongs to this user and no one else may write it."""
    info = path.stat()
    uid = os.getuid() if hasattr(os, "getuid") else info.st_uid
    return info.st_uid == uid and not info.st_mode & 0o022


def _build() -> tuple[Callable[[int, int, int], int] | None, str]:
    if os.environ.get("ARESIDENCY_STREAM_COPY", "1") == "0":
        return None, "disabled by ARESIDENCY_STREAM_COPY=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not built on {platform.system()} {platform.machine()} (x86-64 Linux only)"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    key = hashlib.sha256(f"{cc}\n{STREAM_COPY_SOURCE}".encode()).hexdigest()[:16]
    # The user's cache first; a directory of this user's under the temporary one when the
    # cache cannot be written (a read-only home).
    uid = os.getuid() if hasattr(os, "getuid") else 0
    places = (_cache_dir(), Path(tempfile.gettempdir()) / f"aresidency-{uid}")
    failures: list[str] = []
    for directory in places:
        library = directory / f"streamcopy-{key}.so"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Code is loaded from here: only a directory (and file) of this user's that no one
            # else may write will do (the temporary directory is shared).
            if not _private(directory) or (library.exists() and not _private(library)):
                failures.append(f"{directory}: not this user's alone")
                continue
            if library.exists():
                break
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                source = Path(tmp) / "streamcopy.c"
                source.write_text(STREAM_COPY_SOURCE)
                built = Path(tmp) / "streamcopy.so"
                result = subprocess.run(
                    [cc, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                if result.returncode != 0:
                    return None, f"{cc} failed: {result.stderr.strip()[-500:]}"
                os.replace(built, library)  # atomic: another process may build it too
            break
        except (OSError, subprocess.SubprocessError) as error:
            failures.append(f"{directory}: {error}")
    else:
        return None, "could not build it in " + "; nor in ".join(failures)
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as error:
        return None, f"could not load {library}: {error}"
    fn = lib.aresidency_stream_copy
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    probe_src = (ctypes.c_uint8 * 8192)(*(i % 251 for i in range(8192)))
    probe_dst = (ctypes.c_uint8 * 8192)()
    fn(ctypes.addressof(probe_dst), ctypes.addressof(probe_src), 8192)
    if bytes(probe_dst) != bytes(probe_src):  # never trust a copy that did not copy
        return None, f"{library} copied wrong bytes: not used"
    return fn, f"built with {cc}: {library}"


def streaming_memmove() -> Callable[[int, int, int], int] | None:
    """The non-temporal copy ``fn(dst_address, src_address, nbytes)`` (non-overlapping host
    memory; blocks the calling thread, not the interpreter lock), built on first use (which
    may take a fraction of a second: call it off the event loop); ``None`` where it cannot be
    had (see the module docstring and :func:`streaming_memmove_status`)."""
    global _resolved, _function, _status
    with _lock:
        if not _resolved:
            _function, _status = _build()
            _resolved = True
            _log.debug("streaming host copy: %s", _status)
        return _function


def streaming_memmove_status() -> str:
    """Why :func:`streaming_memmove` gives what it gives (``"not built yet"`` before)."""
    with _lock:
        return _status
