"""The runtime's host cost per operation, this checkout against an earlier commit, side by side
in one process (alternating rounds, so the host's drift hits both alike).

The package as it was at ``--base`` (a git revision) is exported to a temporary directory and
imported as ``aresidency_base`` beside this checkout's ``aresidency`` (every import inside the
package is relative). Both managers run on the instant SIMULATION of ``bench_scope.py``
(copies complete in the calling thread, no device, no poisoning): what is measured is the
runtime's own host work. Rows, µs per operation, median of ``--rounds`` rounds:

* ``scope``: a 4 KiB value moved in on entry and out on exit (``bench_scope.py``'s row);
* ``nowait``: 64 ``materialize_nowait`` calls, then each awaited;
* ``asyncio tasks`` / ``anyio tasks``: 64 tasks each awaiting ``materialize``
  (``asyncio.create_task``, or one anyio task group);
* ``anyio tasks, no work``: the same 64 anyio tasks, each only a checkpoint (the group's own
  cost, which any anyio program pays);
* ``in turn``: one value materialized and released, 64 times in a row.

The manager made second ran 3-5% faster on the scope and in-turn rows with the same code
(``--base HEAD`` on a clean tree, 60 rounds, on the 2-core development CPU), so by default each
order runs in an interpreter of its own and the ratio is the geometric mean of the two. Even
then a ratio from identical code lands anywhere within about 0.9-1.1 on the task rows and
0.97-1.03 on the others: run ``--base HEAD`` first to see the spread on your machine.

    python benchmarks/host_cost_ab.py --base HEAD~1 --rounds 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.lowlevel
import torch

import aresidency

REPO = Path(__file__).resolve().parent.parent


def export_base(revision: str, into: Path) -> ModuleType:
    """``aresidency/`` at ``revision``, importable as ``aresidency_base``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "aresidency"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "aresidency").rename(into / "aresidency_base")
    sys.path.insert(0, str(into))
    return importlib.import_module("aresidency_base")


def instant_backend(pkg: ModuleType) -> Any:
    """``bench_scope.py``'s InstantBackend, built on ``pkg``'s own classes (a SIMULATION)."""
    sim = importlib.import_module(pkg.__name__ + ".backends.sim")
    base = importlib.import_module(pkg.__name__ + ".backends.base")
    events = importlib.import_module(pkg.__name__ + ".backends.events")
    location = importlib.import_module(pkg.__name__ + ".core.locations").Location
    done = events.HostEvent(done=True, label="instant")

    class InstantBackend(sim.SimBackend):  # type: ignore[misc, name-defined]
        name = "instant"

        def allocate(self, shape, dtype, where):  # type: ignore[no-untyped-def]
            tensor = torch.empty(tuple(shape), dtype=dtype)
            with self._lock:
                self._owned[tensor.untyped_storage().data_ptr()] = location.parse(where)
            return tensor

        def copy(self, src, src_location, dst_location, *, wait_events=()):  # type: ignore[no-untyped-def]
            dst_loc = location.parse(dst_location)
            dst = self.allocate(src.shape, src.dtype, dst_loc)
            dst.copy_(src)
            nbytes = src.numel() * src.element_size()
            transfer = base.Transfer(
                self, dst, nbytes, location.parse(src_location), dst_loc, "instant"
            )
            transfer._finish_issue(done)
            return transfer

        copy_many = base.Backend.copy_many

        def free(self, tensor, where):  # type: ignore[no-untyped-def]
            with self._lock:
                self._owned.pop(tensor.untyped_storage().data_ptr(), None)

    return InstantBackend()


def populate(pkg: ModuleType, m: Any, n: int) -> tuple[list[Any], Any]:
    """Fill `m` as bench_scope.py's populated manager: 1000 other values, `n` replicable
    pinned values, and a one-value plan that moves 4 KiB in on entry and out on exit."""
    for i in range(1000):
        m.register(torch.empty(256), name=f"other{i}")
    handles = [
        m.register(
            torch.empty(1024),
            name=f"v{i}",
            location="pinned-host",
            replica_mode=pkg.ReplicaMode.REPLICABLE,
        )
        for i in range(n)
    ]
    moving = m.register(torch.randn(1024), name="moving", location="pinned-host")
    plan = pkg.ResidencyPlan(
        enter=[pkg.Move(moving, "cuda:0")], exit=[pkg.Move(moving, "pinned-host")]
    )
    return handles, plan


Rows = dict[str, Callable[[], Awaitable[float]]]


async def rows_for(pkg: ModuleType, stack: contextlib.AsyncExitStack) -> Rows:
    m = await stack.enter_async_context(
        pkg.ResidencyManager(budgets={"cuda:0": 1 << 30}, backend=instant_backend(pkg))
    )
    handles, plan = populate(pkg, m, 64)
    n = len(handles)

    async def scope() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            async with m.scope(plan):
                pass
        return (time.perf_counter() - t0) / n * 1e6

    async def nowait() -> float:
        t0 = time.perf_counter()
        ops = [m.materialize_nowait(h, "cuda:0") for h in handles]
        for op in ops:
            await op
        t1 = time.perf_counter()
        for h in handles:
            await m.release(h, "cuda:0")
        return (t1 - t0) / n * 1e6

    async def asyncio_tasks() -> float:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(m.materialize(h, "cuda:0")) for h in handles]
        for task in tasks:
            await task
        t1 = time.perf_counter()
        for h in handles:
            await m.release(h, "cuda:0")
        return (t1 - t0) / n * 1e6

    async def anyio_tasks() -> float:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as group:
            for h in handles:
                group.start_soon(m.materialize, h, "cuda:0")
        t1 = time.perf_counter()
        for h in handles:
            await m.release(h, "cuda:0")
        return (t1 - t0) / n * 1e6

    async def anyio_no_work() -> float:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as group:
            for _ in handles:
                group.start_soon(anyio.lowlevel.checkpoint)
        return (time.perf_counter() - t0) / n * 1e6

    async def in_turn() -> float:
        t0 = time.perf_counter()
        for h in handles:
            await m.materialize(h, "cuda:0")
            await m.release(h, "cuda:0")
        return (time.perf_counter() - t0) / n * 1e6

    return {
        "scope": scope,
        "nowait": nowait,
        "asyncio tasks": asyncio_tasks,
        "anyio tasks": anyio_tasks,
        "anyio tasks, no work": anyio_no_work,
        "in turn": in_turn,
    }


async def measure(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Median µs per operation of each row, ``(base, this)``, with the managers made in
    ``args.order`` (the one made second ran a few percent faster with the same code)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = export_base(args.base, Path(tmp))
        async with contextlib.AsyncExitStack() as stack:
            rows: dict[str, Rows] = {}
            for who in ("base", "this") if args.order == "base-first" else ("this", "base"):
                rows[who] = await rows_for(base if who == "base" else aresidency, stack)
            for per in rows.values():
                for fn in per.values():
                    for _ in range(5):
                        await fn()
            gc.collect()
            gc.freeze()  # the collector's pauses would land on whichever row was running
            out: dict[str, dict[str, list[float]]] = {w: {k: [] for k in rows[w]} for w in rows}
            for r in range(args.rounds):
                order = ("base", "this") if r % 2 == 0 else ("this", "base")
                for key in rows["base"]:
                    for who in order:
                        out[who][key].append(await rows[who][key]())
    return {
        key: (statistics.median(out["base"][key]), statistics.median(out["this"][key]))
        for key in out["base"]
    }


def one_order(args: argparse.Namespace, order: str) -> dict[str, tuple[float, float]]:
    """:func:`measure` in a fresh interpreter (each order gets a process of its own)."""
    command = [sys.executable, __file__, "--base", args.base, "--rounds", str(args.rounds)]
    command += ["--order", order, "--json"]
    result = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
    return {k: (v[0], v[1]) for k, v in json.loads(result.stdout.splitlines()[-1]).items()}


def main(args: argparse.Namespace) -> None:
    if args.order != "both":
        medians = asyncio.run(measure(args))
        if args.json:
            print(json.dumps(medians))
            return
        per_order = {args.order: medians}
    else:
        per_order = {order: one_order(args, order) for order in ("base-first", "this-first")}
    print(
        f"host cost per operation, µs (instant simulation), {args.base} against this checkout, "
        f"median of {args.rounds} alternating rounds, torch {torch.__version__}"
    )
    orders = list(per_order)
    print("| row | " + " | ".join(f"{args.base} / this ({o})" for o in orders) + " | ratio |")
    print("|---|" + "---|" * len(orders) + "---|")
    for key in per_order[orders[0]]:
        cells = [per_order[o][key] for o in orders]
        ratio = statistics.geometric_mean(t / b for b, t in cells)
        text = " | ".join(f"{b:.1f} / {t:.1f}" for b, t in cells)
        print(f"| {key} | {text} | {ratio:.3f} |")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument(
        "--order",
        choices=("both", "base-first", "this-first"),
        default="both",
        help="which manager is made first; both (the default): each order in a process of its "
        "own, and the ratio their geometric mean",
    )
    parser.add_argument("--json", action="store_true", help="(one order) print the medians")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
