"""Shuffled ``ShardSource`` batches: the checked kernel copy against torch's gather.

A shuffled batch is gathered out of the shard's mapping. Since a file cut short under a mapping
kills the process with SIGBUS when the gather touches a page past its new end, the source checks
the file and has the kernel copy the rows (``process_vm_readv`` on the process itself, which
reports such a page as a short copy). This measures what that costs against the unchecked
``torch.index_select`` from the mapping (the source's fallback where the call is refused), for
small, medium and large rows, in one thread, from the page cache. CPU only.

    python3 benchmarks/bench_shard_gather.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from aresidency.loader import ShardSource, shardfiles

CASES = [  # (rows, floats per row)
    (65536, 64),  # 256 B rows
    (4096, 1024),  # 4 KiB rows
    (512, 65536),  # 256 KiB rows
]


def rate(path: Path, rows: int, repeat: int) -> float:
    """GB/s of one epoch of shuffled batches (an eighth of the rows each), best of ``repeat``."""
    best = 0.0
    with ShardSource([path], batch_size=rows // 8, shuffle=True, workers=1) as source:
        list(source)  # the page cache is warm, the allocator too
        for _ in range(repeat):
            start = time.perf_counter()
            nbytes = sum(batch.nbytes for batch in source)
            best = max(best, nbytes / (time.perf_counter() - start) / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    kernel = shardfiles._self_read
    print("Shuffled batches out of a mapped .npy shard, one thread, GB/s (best of the repeats)")
    print()
    print(
        "| row | the source (checked; kernel copy from 1 KiB rows) "
        "| torch index_select (unchecked) | ratio |"
    )
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as directory:
        for rows, width in CASES:
            path = Path(directory) / f"x-{rows}.npy"
            np.save(path, np.ones((rows, width), dtype=np.float32))
            shardfiles._self_read = kernel
            checked = rate(path, rows, args.repeat) if kernel is not None else float("nan")
            shardfiles._self_read = None
            plain = rate(path, rows, args.repeat)
            shardfiles._self_read = kernel
            print(f"| {width * 4} B | {checked:.2f} | {plain:.2f} | {checked / plain:.2f} |")
    if kernel is None:
        print("\nprocess_vm_readv is not available here: the source gathers with torch")


if __name__ == "__main__":
    main()
