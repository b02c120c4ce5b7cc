"""Python calls per operation of the runtime's host path, counted by cProfile: deterministic,
unlike a timing, so a change to that path can be followed on a loaded machine.

The rows are ``host_cost_ab.py``'s, on its instant SIMULATION (copies complete in the calling
thread; 1,000 other values registered), 64 operations per round after three warm-up rounds:

* ``in turn``: one value materialized and released, 64 times in a row (per pair);
* ``scope``: a 4 KiB value moved in on entry and out on exit;
* ``asyncio tasks``: 64 tasks each awaiting ``materialize``, then each value released (per
  pair).

``--deferred`` runs them on a variant whose copies complete two turns of the loop after they
were issued, so that every operation takes the waiting path a GPU copy of a few MB takes (its
done event, the task woken by it). Calls are counted per code object (``pstats`` would merge
functions that share a file, line and name, such as every dataclass's generated ``__init__``)
and include the event loop's, the backend's and anyio's. ``--base REV`` counts the package as
it was at a git revision instead (``host_cost_ab.py``'s export); ``--top N`` lists the N
functions called most per operation.

    python benchmarks/host_calls.py [--deferred] [--base REV] [--top 40]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_cost_ab

N = 64


def deferred_backend(pkg: ModuleType) -> Any:
    """``host_cost_ab``'s instant backend whose copies complete two loop turns later."""
    backend = host_cost_ab.instant_backend(pkg)
    base = importlib.import_module(pkg.__name__ + ".backends.base")
    events = importlib.import_module(pkg.__name__ + ".backends.events")
    location = importlib.import_module(pkg.__name__ + ".core.locations").Location

    def copy(src, src_location, dst_location, *, wait_events=()):  # type: ignore[no-untyped-def]
        dst_loc = location.parse(dst_location)
        dst = backend.allocate(src.shape, src.dtype, dst_loc)
        dst.copy_(src)
        nbytes = src.numel() * src.element_size()
        transfer = base.Transfer(
            backend, dst, nbytes, location.parse(src_location), dst_loc, "deferred"
        )
        done = events.HostEvent(label="deferred")
        transfer._finish_issue(done)
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, done.set)
        return transfer

    backend.copy = copy
    return backend


async def count(pkg: ModuleType, deferred: bool, top: int) -> dict[str, float]:
    backend = deferred_backend(pkg) if deferred else host_cost_ab.instant_backend(pkg)
    async with pkg.ResidencyManager(budgets={"cuda:0": 1 << 30}, backend=backend) as m:
        handles, plan = host_cost_ab.populate(pkg, m, N)

        async def in_turn() -> None:
            for h in handles:
                await m.materialize(h, "cuda:0")
                await m.release(h, "cuda:0")

        async def scope() -> None:
            for _ in range(N):
                async with m.scope(plan):
                    pass

        async def asyncio_tasks() -> None:
            tasks = [asyncio.create_task(m.materialize(h, "cuda:0")) for h in handles]
            for task in tasks:
                await task
            for h in handles:
                await m.release(h, "cuda:0")

        rows: dict[str, Callable[[], Awaitable[None]]] = {
            "in turn": in_turn,
            "scope": scope,
            "asyncio tasks": asyncio_tasks,
        }
        out = {}
        for name, fn in rows.items():
            for _ in range(3):
                await fn()
            await asyncio.sleep(0.01)
            profile = cProfile.Profile()
            profile.enable()
            await fn()
            profile.disable()
            entries = profile.getstats()
            out[name] = sum(e.callcount for e in entries) / N
            if top:
                print(f"== {name}: {out[name]:.1f} Python calls per operation")
                for e in sorted(entries, key=lambda e: -e.callcount)[:top]:
                    code = e.code
                    where = (
                        f"{code.co_filename}:{code.co_firstlineno} {code.co_name}"
                        if not isinstance(code, str)
                        else code
                    )
                    print(f"{e.callcount / N:8.2f}  {where}")
    return out


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            pkg = host_cost_ab.export_base(args.base, Path(tmp))
        else:
            import aresidency as pkg
        counts = asyncio.run(count(pkg, args.deferred, args.top))
    what = f"at {args.base}" if args.base else "this checkout"
    path = "copies completing two loop turns later" if args.deferred else "instant simulation"
    print(f"Python calls per operation ({what}, {path}):")
    for name, calls in counts.items():
        print(f"| {name} | {calls:.1f} |")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--base", default=None, help="count the package at this git revision")
    parser.add_argument("--deferred", action="store_true", help="the waiting (GPU-like) path")
    parser.add_argument("--top", type=int, default=0, help="list the most called functions")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse())
