"""Waiting and asserting without sleeps: the helpers a test of code built on aresidency needs.

A test must never sleep "long enough" for a copy to finish: on a loaded CI machine it is never
long enough, and on a fast one it wastes time. These helpers wait on the manager's own change
signal (:meth:`~aresidency.runtime.manager.ResidencyManager.wait_for_change`) instead:

* :func:`settled` waits until no device work the manager has begun is unfinished: no transfer
  in flight, no consumer event pending (what a lease's readers recorded);
* :func:`until` waits until a condition of yours holds (re-checked after every change);
* :func:`assert_quiet` checks that nothing is leased, held, reserved (but the backend's own
  staging pool), waiting for admission or in flight: what a finished request should leave;
* :func:`assert_within_budgets` checks that no location's peak ever went over its budget (or
  over a limit of your own: "this server never used more than 3 GiB of cuda:0").

They read the manager's live state (``manager.state``, read only) and its snapshot, on the
event loop's thread; they work on every backend, the simulation included, and on asyncio,
uvloop and trio. The waits raise ``TimeoutError`` (after ``timeout`` seconds, 10 by default:
a simulated test that waits longer is stuck) naming what was still pending, and
``ManagerClosedError`` if the manager closes meanwhile.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import anyio

from ..core.locations import Location
from ..core.sizes import ByteSize, format_nbytes, parse_nbytes
from ..core.timeouts import check_timeout
from ..integrations.streaming.module import host_copy_holds
from ..runtime.manager import ResidencyManager

__all__ = [
    "DEFAULT_TIMEOUT",
    "assert_quiet",
    "assert_within_budgets",
    "in_flight",
    "settled",
    "until",
]

T = TypeVar("T")

#: Seconds :func:`settled` and :func:`until` wait by default before raising ``TimeoutError``.
DEFAULT_TIMEOUT = 10.0

# The reservation owner the manager gives its backend's staging pool: held for the manager's
# whole life, so it is not something a test left behind.
_BACKEND_OWNER = "backend"


def _size(nbytes: int) -> str:
    """Exact bytes for arithmetic, the readable size beside them when it differs."""
    exact, readable = f"{nbytes} B", format_nbytes(nbytes)
    return exact if readable == exact else f"{exact} ({readable})"


def _check_manager(manager: object) -> ResidencyManager:
    if not isinstance(manager, ResidencyManager):
        raise TypeError(f"expected a ResidencyManager, got {manager!r}")
    manager.check_thread()  # a running manager, called from its loop's thread
    return manager


def in_flight(manager: ResidencyManager) -> list[str]:
    """One line per piece of device work ``manager`` has begun and not finished: each transfer
    in flight (copies and loads from a source) and each materialization with pending consumer
    events. Empty when the manager is settled. Reads the state; never waits."""
    state = _check_manager(manager).state
    lines = []
    for ticket in state.open_tickets():
        if ticket.source is None:
            route = f"load from its source into {ticket.destination}"
        else:
            kind = "move" if ticket.move else "copy"
            route = f"{kind} {ticket.source} -> {ticket.destination}"
        lines.append(f"{ticket.handle}: {route}, {_size(ticket.nbytes)}")
    for value in state.values():
        for mat in value.materializations.values():
            if mat.pending_event_count:
                lines.append(
                    f"{value.handle} at {mat.location}: {mat.pending_event_count} consumer "
                    "event(s) pending (work still reading it)"
                )
    return lines


async def until(
    manager: ResidencyManager,
    predicate: Callable[[], T],
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    what: str | None = None,
) -> T:
    """Wait until ``predicate()`` is truthy and return its value.

    ``predicate`` is called now and after every change of ``manager``'s state (on the loop;
    it must not await or block); the task parks on :meth:`ResidencyManager.wait_for_change`
    in between, so the host never waits. So the condition must be about the residency state
    (the snapshot, the trace, ``manager.state``, what ``in_flight`` reports), or about
    something that changes with it: ``manager.waiting`` and your own variables change
    without a transition, and nothing would wake the wait (use ``anyio.Event`` or
    ``anyio.wait_all_tasks_blocked()`` for those). ``what`` describes the condition in the
    timeout's message. Raises ``TimeoutError`` after ``timeout`` seconds (``None``: no limit), and
    ``ManagerClosedError`` if the manager closes first.
    """
    _check_manager(manager)
    if not callable(predicate):
        raise TypeError(f"until needs a predicate to call, got {predicate!r}")
    seconds = check_timeout(timeout)
    deadline = None if seconds is None else anyio.current_time() + seconds
    while True:
        result = predicate()
        if result:
            return result
        remaining = None if deadline is None else deadline - anyio.current_time()
        if remaining is not None and remaining <= 0:
            described = what or getattr(predicate, "__name__", repr(predicate))
            busy = in_flight(manager)
            raise TimeoutError(
                f"{described} was still false after {seconds} s (state version "
                f"{manager.state_version}; in flight: {'; '.join(busy) or 'nothing'})"
            )
        await manager.wait_for_change(remaining)


async def settled(manager: ResidencyManager, *, timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """Wait until ``manager`` has no transfer in flight and no pending consumer event.

    The host never waits: the task parks on the manager's change signal until the device work
    completes (on the simulation: until the simulated streams' worker threads reach it).
    Operations still being decided are not waited for: a scope queued for admission is not
    device work (see :func:`assert_quiet`). Raises ``TimeoutError`` naming what was still in
    flight after ``timeout`` seconds (``None``: no limit), ``ManagerClosedError`` if the
    manager closes first.
    """
    await until(manager, lambda: not in_flight(manager), timeout=timeout, what="settled")


def assert_quiet(manager: ResidencyManager) -> None:
    """Raise ``AssertionError`` listing everything that keeps ``manager`` from being quiet:
    leases, holds (except those that keep an open streamed module's host copies in place, a
    pooled model's included: held for its whole life), reservations (except the backend's
    own staging pool), scopes waiting for admission, transfers in flight and pending consumer
    events. Call it after
    :func:`settled` when a test checks that finished work left nothing behind. Never waits.
    """
    state = _check_manager(manager).state
    # Held for a streamed module's whole life (a served model's host copies): not left behind.
    standing = Counter(host_copy_holds(manager))
    problems = []
    for value in state.values():
        for mat in value.materializations.values():
            if mat.use_count:
                writes = f" ({mat.write_count} writing)" if mat.write_count else ""
                problems.append(
                    f"{value.handle} is leased {mat.use_count}x at {mat.location}{writes}"
                )
            held = mat.hold_count - standing[value.handle, mat.location]
            if held > 0:
                problems.append(f"{value.handle} is held {held}x at {mat.location}")
    for location in state.locations():
        ledger = state.find_ledger(location)
        if ledger is None:
            continue
        for name, (nbytes, owner) in sorted(ledger.reservations.items()):
            if owner != _BACKEND_OWNER:
                problems.append(f"reservation {name!r} holds {_size(nbytes)} at {location}")
    if manager.waiting:
        problems.append(f"{manager.waiting} scope(s) or operation(s) wait for admission")
    problems.extend(in_flight(manager))
    if problems:
        raise AssertionError(
            f"the manager is not quiet (state version {manager.state_version}): "
            + "; ".join(problems)
        )


def assert_within_budgets(
    manager: ResidencyManager, limits: Mapping[Any, ByteSize] | None = None
) -> None:
    """Raise ``AssertionError`` if any location's peak or current charge went over its budget,
    or over ``limits`` (location -> size such as ``"3GiB"``, checked as well as the budgets).

    The peak is the largest ``used + reserved`` since the manager started or since the last
    ``manager.reset_peak_bytes(location)``: to check one phase of a test only, reset the peaks
    before it. (Lowering a budget with ``set_budget`` below an earlier peak makes that peak
    count against the new budget; reset it first.) Never waits. ``ValueError`` for a limit at
    a location the manager does not have, or a limit that is not a size.
    """
    _check_manager(manager)
    snapshot = manager.snapshot()
    extra: dict[Location, int] = {}
    for key, limit in (limits or {}).items():
        location = Location.parse(key)
        if location not in snapshot.locations:
            known = ", ".join(str(loc) for loc in sorted(snapshot.locations))
            raise ValueError(
                f"limit for {location}: the manager has no such location (it has: {known})"
            )
        extra[location] = parse_nbytes(limit, f"limit for {location}")
    problems = []
    for location, record in sorted(snapshot.locations.items()):
        bounds = []
        if record.budget_bytes is not None:
            bounds.append(("budget", record.budget_bytes))
        if location in extra:
            bounds.append(("limit", extra[location]))
        for kind, bound in bounds:
            if record.peak_bytes > bound:
                problems.append(
                    f"{location} peaked at {_size(record.peak_bytes)}, over its {kind} of "
                    f"{_size(bound)}"
                )
            elif record.charged_bytes > bound:
                problems.append(
                    f"{location} holds {_size(record.charged_bytes)}, over its {kind} of "
                    f"{_size(bound)}"
                )
    if problems:
        raise AssertionError("over budget: " + "; ".join(problems))
