"""Budgets that remember: which groups of a streamed module stay on the device between calls.

Pure arithmetic over the groups' charges and the device ledger (read from the manager's state,
never changed here). :func:`spread` picks the blocks that fill the room left beside the prefetch
window, spread evenly over the call order; :func:`others_bytes` is what other tenants hold at
the device; :func:`describe` is what
:meth:`~aresidency.integrations.streaming.module.StreamedModule.residency` returns.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ...core.locations import Location
from ...core.sizes import format_nbytes
from ...core.state import ResidencyState
from .packing import TensorGroup

__all__ = ["describe", "others_bytes", "spread", "window_blocks"]


def spread(groups: Sequence[TensorGroup], room: int) -> set[int]:
    """The indexes of blocks (``groups``, in call order) that fill ``room`` bytes, spread evenly
    over the call order (every other block when half of them fit): for equal blocks the most
    bytes kept, so the fewest copied per call, and the copies of the others fall between kept
    blocks, whose compute they overlap. What rounding leaves is filled in call order."""
    total = sum(g.charge_bytes for g in groups)
    if total <= room:
        return {g.index for g in groups}
    keep: set[int] = set()
    if room <= 0 or not groups:
        return keep
    fraction = room / total
    credit = 0.5 * groups[0].charge_bytes  # rounded to the nearest: the first block is kept
    for group in groups:
        credit += fraction * group.charge_bytes
        if credit >= group.charge_bytes and group.charge_bytes <= room:
            keep.add(group.index)
            room -= group.charge_bytes
            credit -= group.charge_bytes
    for group in groups:
        if group.index not in keep and group.charge_bytes <= room:
            keep.add(group.index)
            room -= group.charge_bytes
    return keep


def others_bytes(state: ResidencyState, device: Location, groups: Sequence[TensorGroup]) -> int:
    """What other tenants have charged at ``device``: its charge less ``groups`` there now."""
    ledger = state.find_ledger(device)
    if ledger is None:
        return 0
    ours = 0
    for group in groups:
        assert group.handle is not None
        value = state.find_value(group.handle)
        if value is not None and device in value.materializations:
            ours += group.charge_bytes
    return ledger.charged_bytes - ours


def window_blocks(
    budget: int | None,
    others: int,
    held: int,
    largest: int,
    prefetch: int,
    copied: int | None = None,
) -> int:
    """How many blocks a call's prefetch window really holds at once: ``prefetch + 1``, no
    more than the ``copied`` distinct blocks a call copies (a block listed twice is one group:
    one replica, one ring slot; 0 when nothing is copied), or, when the budget less what other
    tenants hold (``others``) and what the call holds for its whole length (``held``: the
    tensors outside the blocks, the kept blocks) leaves room for fewer blocks of ``largest``
    bytes, that many (at least one: a call waits for room for one block and runs with it). A
    ring has that many slots; a call without one copies at most that many blocks at once."""
    want = prefetch + 1 if copied is None else min(prefetch + 1, copied)
    if want <= 0:
        return 0
    if budget is None or largest <= 0:
        return want
    return max(1, min(want, (budget - others - held) // largest))


def describe(
    state: ResidencyState,
    device: Location,
    blocks: Sequence[TensorGroup],
    resident: TensorGroup | None,
    kept: Collection[int],
    *,
    window_bytes: int,
    prefetch: int,
    keep_resident: bool,
    own_reserved: int = 0,
    ring: bool = True,
) -> dict[str, Any]:
    """Which of the groups (``blocks`` in call order, and the ``resident`` one) stay, and why:
    see :meth:`~aresidency.integrations.streaming.module.StreamedModule.residency`.
    ``window_bytes``: the room the plan leaves for the prefetch window (``prefetch + 1`` x the
    largest block); when the budget leaves less, what is reported is what a call really uses
    (:func:`window_blocks`). ``own_reserved``: what the module itself reserves at ``device``
    (its calls' rings), which is not another tenant's. ``ring``: whether calls copy through a
    ring (for the wording)."""
    ledger = state.find_ledger(device)
    budget = None if ledger is None else ledger.budget_bytes
    groups = [*blocks] if resident is None else [*blocks, resident]
    staying = [g for g in groups if g.index in kept]
    if resident is not None and resident.index in kept:
        staying = [resident, *staying[:-1]]  # the resident group is kept first
    kept_bytes = sum(g.charge_bytes for g in staying)
    streamed = [g for g in groups if g.index not in kept]
    total = sum(g.charge_bytes for g in groups)
    others = None if ledger is None else others_bytes(state, device, groups) - own_reserved
    # What a call really has room for: the blocks it copies, beside what it holds throughout
    # (the kept groups, and the tensors outside the blocks even when they are not kept).
    copied = [g for g in blocks if g.index not in kept]
    largest = max((g.charge_bytes for g in copied), default=0)
    held = kept_bytes
    if resident is not None and resident.index not in kept:
        held += resident.charge_bytes
    # The window never holds more blocks than a call copies (distinct: a block run twice is
    # one replica, one ring slot), however deep the prefetch.
    want = min(prefetch + 1, len(copied))
    slots = window_blocks(budget, others or 0, held, largest, prefetch, len(copied))
    shrunk = bool(copied) and slots < want
    few = want < prefetch + 1  # fewer blocks copied than the window would hold
    if shrunk or few:
        window_bytes = slots * largest
    how = (
        f"the ring runs with {slots} slot(s) of {format_nbytes(largest)}"
        if ring
        else f"a call copies at most {slots} block(s) of {format_nbytes(largest)} at once"
    ) + f" ({format_nbytes(window_bytes)}, the window_bytes reported)"
    only = (
        f"only {len(copied)} distinct block(s) of the {prefetch + 1} the prefetch window would "
        f"hold (prefetch={prefetch}) are copied on each call"
    )
    room = (
        ""
        if budget is None
        else (
            f"the {format_nbytes(budget)} budget, less the tensors outside the blocks and what "
            f"other tenants hold, has room for {slots} of the {want} blocks of the "
            + (f"prefetch window ({only}): " if few else f"prefetch window (prefetch={prefetch}): ")
            + how
        )
    )
    if few and not shrunk and copied:
        room = f"{only}: {how}"
    if not keep_resident:
        reason = "keep_resident=False: every block is released after use"
        if shrunk or (few and copied):
            reason += f"; {room}"
    elif budget is None:
        reason = f"{device} has no strict budget, so nothing stays between calls"
        if few and copied:
            reason += f"; {room}"
    elif not streamed:
        reason = (
            "the whole model fits the budget beside what other tenants hold: every group "
            "stays and nothing is copied, so a call needs no prefetch window (window_bytes 0)"
        )
    elif copied and (shrunk or few):
        reason = (
            f"{len(staying)} of {len(groups)} groups ({format_nbytes(kept_bytes)}) stay: "
            f"{room}, so {'the' if staying else 'all'} {len(streamed)} "
            f"{'others' if staying else 'groups'} ({format_nbytes(total - kept_bytes)}) are "
            "copied on each call"
        )
    else:
        reason = (
            f"{len(staying)} of {len(groups)} groups ({format_nbytes(kept_bytes)}) stay: what "
            f"fits in the {format_nbytes(budget)} budget beside the prefetch window "
            f"({prefetch + 1} x the largest block, {format_nbytes(window_bytes)}) and what "
            f"other tenants hold, the tensors outside the blocks first, then blocks spread "
            f"evenly over the call order so that the copies of the {len(streamed)} others "
            f"({format_nbytes(total - kept_bytes)} per call) overlap their compute"
        )
    return {
        "kept": [g.name for g in staying],
        "streamed": [g.name for g in streamed],
        "kept_bytes": kept_bytes,
        "streamed_bytes": total - kept_bytes,
        "window_bytes": window_bytes,
        "window_blocks": slots,
        "budget_bytes": budget,
        "others_bytes": others,
        "reason": reason,
    }
