"""Room where a checkpoint's group is read on its way to the device.

A group rebuilt from a checkpoint is loaded into ``pageable-host`` (its value's
``source_location``), charged there until its copy to the device landed. When that budget is
full, :meth:`~aresidency.ResidencyManager.materialize_nowait` refuses the load with a
``ResidencyBudgetError`` of kind ``"reconstruction"``. Waiting is right when what fills the room
ends on its own (a lease, a hold, another load in flight) or can never go (the last copy of a
value without a source). But room held by values the controller would evict (a replica whose
value stays resident elsewhere, or a value with a source of its own, dropped and rebuilt when
needed again: another model's idle groups) never comes back by waiting: nothing releases them.
:func:`make_read_room` releases those, as a controller decision would, before the load is tried
again.

What is evicted: exactly the controller's candidates at that location that go without a move
(:func:`~aresidency.controller.index.classify`: resident, not in use, held or read, and with
another resident replica or a source it may be dropped to under ``graph``), least recently used
first (the controller's order of cost within a class), only as many bytes as the load lacks,
and nothing at all when those candidates could not make the room (what stays in the way is then
protected or unevictable, and the caller waits as before, keeping the caches). Never a value a
waiting scope is queued for: a refusal by the admission queue (``waiting_scopes``) is left to
the queue. The releases commit at once (a candidate has no pending reader event), so the
ledger shows the room when this returns: the exact bytes of each released materialization.
"""

from __future__ import annotations

import logging

from ...controller.index import classify
from ...controller.policy import FallbackGraph
from ...core.errors import ResidencyBudgetError, ResidencyError
from ...core.sizes import format_nbytes
from ...core.values import ValueHandle
from ...runtime.manager import ResidencyManager

__all__ = ["make_read_room"]

_log = logging.getLogger("aresidency.integrations")

_DEFAULT_GRAPH = FallbackGraph.default()


def make_read_room(
    manager: ResidencyManager,
    refusal: ResidencyBudgetError,
    *,
    graph: FallbackGraph | None = None,
) -> int:
    """After ``refusal`` (a load from a source refused at its ``source_location``): release
    the evictable values there, least recently used first, until the load fits. Returns the
    bytes released (0: nothing was, and the caller waits for room as before). Loop thread;
    never raises a residency error (a candidate taken meanwhile is skipped)."""
    if refusal.kind != "reconstruction" or refusal.waiting_scopes or refusal.never_fits:
        return 0
    location = refusal.location
    state = manager.state
    ledger = state.find_ledger(location)
    if ledger is None or ledger.budget_bytes is None:
        return 0
    short = ledger.charged_bytes + refusal.requested_bytes - ledger.budget_bytes
    if short <= 0:
        return 0  # (room came meanwhile: the caller tries again)
    graph = _DEFAULT_GRAPH if graph is None else graph
    loading = refusal.handle
    candidates: list[tuple[int, int, ValueHandle, int]] = []
    for value in state.values():
        if value.handle == loading:
            continue
        for where, cls, entry in classify(value, graph):
            if where == location and cls.releasable:
                candidates.append(entry)
    if sum(entry[3] for entry in candidates) < short:
        return 0  # it would not be enough: keep them and wait for the rest to end
    candidates.sort(key=lambda entry: (entry[0], entry[1]))
    freed = 0
    for _, _, handle, charge in candidates:
        if freed >= short:
            break
        try:
            manager.release_nowait(handle, location)
        except ResidencyError:
            continue
        freed += charge
    if freed:
        _log.info(
            "evicted %s at %s to read %s from its source",
            format_nbytes(freed),
            location,
            loading,
        )
    return freed
