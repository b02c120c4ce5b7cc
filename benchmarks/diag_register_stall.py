"""Does page-locking host memory (cudaHostRegister / cudaHostUnregister) while a kernel runs
stall other threads' CUDA calls, or the registering thread, until the device is idle?

    python3 benchmarks/diag_register_stall.py

Launches a 500 ms spin kernel, then registers (and later unregisters) 64 MiB in a worker thread
while the main thread times small CUDA calls (event record + query). Prints how long each took.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import torch


def main() -> None:
    torch.cuda.init()
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    size = 64 << 20
    mapping = mmap.mmap(-1, size)
    buf = (ctypes.c_uint8 * size).from_buffer(mapping)
    ptr = ctypes.addressof(buf)
    ctypes.memset(ptr, 1, size)  # fault the pages in first: time only the registration
    cycles = int(0.5 * 1.98e9)
    for what in ("register", "unregister"):
        torch.cuda._sleep(cycles)  # the device is busy for about 500 ms from now
        launched = time.perf_counter()
        took: dict[str, float] = {}

        def work(what: str = what, took: dict[str, float] = took) -> None:
            start = time.perf_counter()
            if what == "register":
                cudart.cudaHostRegister(ptr, size, 0)
            else:
                cudart.cudaHostUnregister(ptr)
            took["call"] = time.perf_counter() - start

        worker = threading.Thread(target=work)
        time.sleep(0.01)
        worker.start()
        time.sleep(0.005)
        start = time.perf_counter()
        event = torch.cuda.Event()
        event.record()
        event.query()
        main_call = time.perf_counter() - start
        worker.join()
        busy = not torch.cuda.current_stream().query()
        print(
            f"{what}: {took['call'] * 1e3:.1f} ms in the worker; a record+query on the main "
            f"thread meanwhile took {main_call * 1e3:.1f} ms; "
            f"{(time.perf_counter() - launched) * 1e3:.0f} ms after the kernel's launch the "
            f"device was {'still busy' if busy else 'idle'}"
        )
        torch.cuda.synchronize()
    del buf
    mapping.close()


if __name__ == "__main__":
    main()
