"""The few CUDA driver and libc functions the runtime calls directly, through ``ctypes``.

torch exposes CUDA streams and events but not ``cuLaunchHostFunc`` (a host function enqueued
on a stream) nor streams created with ``CU_STREAM_NON_BLOCKING`` on the primary context, which
the event waiter's ``hostfunc``/``hybrid`` strategies and the dedicated copy streams need.
ctypes calls release the GIL. Loaded once per process; :func:`hostfunc_available` says whether
the driver offers them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from typing import Any, Final

__all__ = [
    "CudaDriver",
    "Timespec",
    "cuda_driver",
    "hostfunc_available",
    "load_libc",
]

_CU_STREAM_NON_BLOCKING: Final = 1
_CUDA_ERROR_INVALID_CONTEXT: Final = 201
# Semaphores and host functions may outlive a waiter (a notify stream destroyed with work
# still queued runs it later): their memory is kept for the life of the process. 64 B each.
_KEEPALIVE: list[Any] = []


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def load_libc() -> Any:
    """libc with the POSIX semaphore functions typed (ctypes calls release the GIL)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if not hasattr(libc, "sem_timedwait"):  # glibc < 2.34 keeps them in libpthread
        libc = ctypes.CDLL(ctypes.util.find_library("pthread") or "libpthread.so.0", True)
    vp = ctypes.c_void_p
    for name in ("sem_init", "sem_post", "sem_wait", "sem_trywait", "sem_timedwait"):
        getattr(libc, name).restype = ctypes.c_int
    libc.sem_init.argtypes = [vp, ctypes.c_int, ctypes.c_uint]
    libc.sem_post.argtypes = [vp]
    libc.sem_wait.argtypes = [vp]
    libc.sem_trywait.argtypes = [vp]
    libc.sem_timedwait.argtypes = [vp, ctypes.POINTER(Timespec)]
    return libc


class CudaDriver:
    """The few CUDA driver and libc functions the ``hostfunc`` strategy needs (ctypes calls
    release the GIL)."""

    def __init__(self) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        libc = load_libc()
        self.cuda = cuda
        self.libc = libc
        vp = ctypes.c_void_p
        for name, args in {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), ctypes.c_int],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(vp)],
            "cuStreamCreate": [ctypes.POINTER(vp), ctypes.c_uint],
            "cuStreamDestroy_v2": [vp],
            "cuStreamWaitEvent": [vp, vp, ctypes.c_uint],
            "cuLaunchHostFunc": [vp, vp, vp],
            "cuMemcpyHtoDAsync_v2": [ctypes.c_ulonglong, vp, ctypes.c_size_t, vp],
        }.items():
            fn = getattr(cuda, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        self.sem_post_ptr = ctypes.cast(libc.sem_post, vp).value
        self._check(cuda.cuInit(0), "cuInit")
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"CUDA driver call {what} failed with CUresult {code}")

    def context(self, device: int) -> int:
        """The device's primary context (the one torch uses), retained once."""
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                dev = ctypes.c_int()
                self._check(self.cuda.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
                handle = ctypes.c_void_p()
                self._check(
                    self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(handle), dev.value),
                    "cuDevicePrimaryCtxRetain",
                )
                ctx = self._contexts[device] = int(handle.value or 0)
            return ctx

    def call_in(self, device: int, fn: Callable[[], int], what: str) -> None:
        """Run one driver call with the device's primary context current."""
        ctx = self.context(device)
        self._check(self.cuda.cuCtxPushCurrent_v2(ctypes.c_void_p(ctx)), "cuCtxPushCurrent")
        try:
            self._check(fn(), what)
        finally:
            self.cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def memcpy_htod_async(self, device: int, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cuMemcpyHtoDAsync``: enqueue ``nbytes`` from host address ``src`` (page-locked)
        to device address ``dst`` on ``stream``; the host does not wait. Uses the calling
        thread's current context (torch's primary context once the thread made a CUDA call),
        else makes the device's primary context current for the call."""
        code = int(
            self.cuda.cuMemcpyHtoDAsync_v2(
                ctypes.c_ulonglong(dst), ctypes.c_void_p(src), nbytes, ctypes.c_void_p(stream)
            )
        )
        if code == _CUDA_ERROR_INVALID_CONTEXT:
            self.call_in(
                device,
                lambda: int(
                    self.cuda.cuMemcpyHtoDAsync_v2(
                        ctypes.c_ulonglong(dst),
                        ctypes.c_void_p(src),
                        nbytes,
                        ctypes.c_void_p(stream),
                    )
                ),
                "cuMemcpyHtoDAsync",
            )
            return
        self._check(code, "cuMemcpyHtoDAsync")

    def create_stream(self, device: int) -> int:
        """A new non-blocking stream on ``device`` (never synchronizes with the legacy
        default stream)."""
        out = ctypes.c_void_p()
        self.call_in(
            device,
            lambda: int(self.cuda.cuStreamCreate(ctypes.byref(out), _CU_STREAM_NON_BLOCKING)),
            "cuStreamCreate",
        )
        return int(out.value or 0)

    def destroy_stream(self, device: int, stream: int) -> None:
        """Release ``stream``; work still queued on it completes first (driver semantics)."""
        self.call_in(
            device, lambda: int(self.cuda.cuStreamDestroy_v2(ctypes.c_void_p(stream))), "destroy"
        )

    def new_semaphore(self) -> ctypes.Array[ctypes.c_char]:
        sem = ctypes.create_string_buffer(64)  # sizeof(sem_t) is 32 on glibc
        if self.libc.sem_init(sem, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        _KEEPALIVE.append(sem)
        return sem


_DRIVER: CudaDriver | None = None
_DRIVER_ERROR: BaseException | None = None
_DRIVER_LOCK = threading.Lock()


def cuda_driver() -> CudaDriver:
    """The process's driver wrapper, loaded once; ``RuntimeError`` when the driver API is
    unavailable (no libcuda, or no host functions)."""
    global _DRIVER, _DRIVER_ERROR
    with _DRIVER_LOCK:
        if _DRIVER is None and _DRIVER_ERROR is None:
            try:
                _DRIVER = CudaDriver()
            except (OSError, AttributeError, RuntimeError) as exc:
                _DRIVER_ERROR = exc
        if _DRIVER is None:
            raise RuntimeError(f"the CUDA driver API is unavailable: {_DRIVER_ERROR}")
        return _DRIVER


def hostfunc_available() -> bool:
    """Whether ``libcuda.so.1`` loads and offers ``cuLaunchHostFunc`` (CUDA 10+ drivers)."""
    try:
        cuda_driver()
    except RuntimeError:
        return False
    return True
