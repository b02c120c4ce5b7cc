"""The budget arithmetic of the loader's admission: whether a batch fits a location now, whether
it could ever fit, and the errors that say so with the numbers. Reads the live ledgers
(``manager.state``); never waits."""

from __future__ import annotations

from collections.abc import Iterable

from ..core.errors import ResidencyBudgetError
from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..core.values import ValueHandle
from ..runtime.manager import ResidencyManager
from .records import BatchRecord

__all__ = [
    "held_by_waiter",
    "kept_by_waiter",
    "never_fits",
    "reclaim_for",
    "room",
    "timeout_error",
]


def room(manager: ResidencyManager, location: Location, need: int) -> bool:
    """Whether ``need`` more bytes fit ``location``'s budget now (no budget: always)."""
    ledger = manager.state.find_ledger(location)
    return (
        ledger is None
        or ledger.budget_bytes is None
        or ledger.charged_bytes + need <= ledger.budget_bytes
    )


def never_fits(
    manager: ResidencyManager, device: Location, batch: BatchRecord, name: str
) -> ResidencyBudgetError | None:
    """The error for a batch larger than a whole budget it needs (device, or the host
    location its tensors are registered at), else None."""
    needs: dict[Location, int] = {device: sum(p.charge for p in batch.parts)}
    for part in batch.parts:
        if part.location is not None and part.location != device:
            needs[part.location] = needs.get(part.location, 0) + part.charge
    for location, need in needs.items():
        ledger = manager.state.find_ledger(location)
        if ledger is None or ledger.budget_bytes is None or need <= ledger.budget_bytes:
            continue
        return ResidencyBudgetError(
            location,
            ledger.budget_bytes,
            ledger.used_bytes,
            ledger.reserved_bytes,
            need,
            what=(
                f"batch {batch.index} of {name}: its {len(batch.parts)} "
                f"tensor(s) need {format_nbytes(need)} at {location}, more than the whole "
                f"budget of {format_nbytes(ledger.budget_bytes)}, so it could never be "
                "copied there"
            ),
        )
    return None


def timeout_error(
    manager: ResidencyManager,
    device: Location,
    batch: BatchRecord,
    name: str,
    timeout: float | None,
) -> TimeoutError:
    """The error for a batch that waited ``timeout`` seconds for room at ``device``."""
    ledger = manager.state.ledger(device)
    need = sum(p.charge for p in batch.parts if p.pending is None)
    waiting = manager.waiting
    scopes = f"; {waiting} scope(s) wait for admission" if waiting else ""
    budget = "no" if ledger.budget_bytes is None else format_nbytes(ledger.budget_bytes)
    return TimeoutError(
        f"batch {batch.index} of {name} waited {timeout} s for room "
        f"at {device}: it needs {format_nbytes(need)}, and "
        f"{format_nbytes(ledger.used_bytes)} used + {format_nbytes(ledger.reserved_bytes)} "
        f"reserved of a {budget} budget left too little{scopes}; release batches you keep, "
        "or give the loader more room"
    )


def kept_by_waiter(
    manager: ResidencyManager,
    device: Location,
    need: int,
    index: int,
    kept: list[tuple[int, int]],
    name: str,
    kind: str = "materialization",
) -> ResidencyBudgetError | None:
    """The error for batch ``index`` (``need`` bytes at ``device``) when the batches the
    waiting consumer keeps itself (``kept``: ``(index, bytes)`` of those its own ``async
    with`` blocks hold) leave too little of the budget for it ever to fit: they end only when
    that task goes on, so its wait for room would never end. ``None`` otherwise."""
    ledger = manager.state.find_ledger(device)
    held = sum(nbytes for _, nbytes in kept)
    if not kept or ledger is None or ledger.budget_bytes is None:
        return None
    if held + need <= ledger.budget_bytes:
        return None
    indices = ", ".join(f"#{i}" for i, _ in kept[:8]) + (" ..." if len(kept) > 8 else "")
    return ResidencyBudgetError(
        device,
        ledger.budget_bytes,
        ledger.used_bytes,
        ledger.reserved_bytes,
        need,
        kind=kind,
        what=(
            f"batch {index} of {name}: it needs {format_nbytes(need)} at {device}, but the "
            f"task asking for it keeps {len(kept)} earlier batch(es) of the loader in open "
            f"'async with batch' blocks ({indices}: {format_nbytes(held)}) of a "
            f"{format_nbytes(ledger.budget_bytes)} budget, and only that task can release "
            "them, so waiting for room would never end; release batches before asking for "
            "the next one (end their 'async with', or .clone() what you keep), or raise the "
            "budget"
        ),
    )


def held_by_waiter(
    manager: ResidencyManager,
    device: Location,
    need: int,
    index: int,
    name: str,
    exempt: Iterable[ValueHandle] = (),
    kind: str = "materialization",
) -> ResidencyBudgetError | None:
    """The error for batch ``index`` (``need`` bytes at ``device``) when only what the waiting
    consumer's task holds itself, besides the loader's batches, keeps it out: a request of a
    model pool it is in, a scope it entered, its leases, holds and reservation blocks. Those
    end only when that task goes on, so its wait for room would never end. ``None`` when the
    wait may end, or when what nothing protects stands in the way too (resident values the
    loader cannot evict, but another tenant may). ``exempt``: the loader's own values;
    ``kind``: what the batch's need is (``"materialization"``: managed values to be copied;
    ``"reservation"``: a ring slot)."""
    ledger = manager.state.find_ledger(device)
    if ledger is None or ledger.budget_bytes is None:
        return None
    fixed = sum(n for n, owner in ledger.reservations.values() if owner == "backend")
    unprotected = ledger.used_bytes - ledger.protected_bytes - ledger.reconstruction_bytes
    if need > ledger.budget_bytes - fixed - max(0, unprotected):
        return None
    return manager.waiting_on_itself(
        need,
        device,
        exempt=exempt,
        what=f"batch {index} of {name} ({format_nbytes(need)} at {device})",
        kind=kind,
    )


def reclaim_for(manager: ResidencyManager, device: Location, need: int) -> int:
    """For a consumer waiting for a batch that needs ``need`` more bytes at ``device`` than
    are free: ask the tenants that cache data there (a model pool's idle models) to give the
    shortfall back (:meth:`ResidencyManager.reclaim`). Returns the bytes whose release began
    (0 when the batch fits, or nobody gave anything)."""
    return manager.reclaim_for(device, need)
