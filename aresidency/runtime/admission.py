"""Admission: the first-come, first-served queue of scopes waiting for room.

A scope whose plan does not fit now waits here, in arrival order, as long as only *transient*
state stands in its way: leases, holds, pending consumer events, transfers in flight and the
reservations of other scopes or ``manager.reservation`` blocks (they all end on their own). A
plan that resident values block (nobody protects them, so nothing will move them) first asks
the tenants that cache such values (*reclaimers*: a model pool's idle models) for the bytes it
lacks, unless it was derived from a state (a decision chose its evictions); one they do not
make room for, or that could never fit, fails at once with the explanation's reason, and so
does one that only the entering task's own entered scopes, reservation blocks, leases and holds
keep out (they end only when that task goes on: it would wait for itself). The same holds for
what a tenant keeps on the task's behalf and gives back only when the task goes on (a loader's
batches copied ahead, which move only when their consumer asks for the next one): a tenant
tells the queue through a *keeper* (:meth:`AdmissionQueue.add_keeper`), and it counts as the
task's own. A scope is checked, on every state change, only once it is first among the waiters
it contends with (those that charge a location it charges, where a budget applies), so a later
scope never overtakes an earlier one for the same room, and a scope for another device does not
wait behind it (a scope waiting on ``cuda:1`` behind one waiting on ``cuda:0`` could otherwise
wait for room that the first one's holder, waiting itself for ``cuda:1``, keeps).

Direct operations queue too, so that they cannot starve a waiting scope: one that would charge
a location where a waiting scope will charge bytes (``materialize``, ``move``, ``execute``)
waits for the scopes ahead of it, then runs (it never waits for room itself: it either fits
then or raises ``ResidencyBudgetError``; ``execute`` a ``ResidencyPlanError``). Two
exceptions keep that from deadlocking or lying: a caller that holds room of this manager (a
lease or hold, an entered scope or reservation block, a reservation it made with
``reserve_nowait`` and has not ended, what a keeper keeps for it) does not
wait (the scope may be waiting for exactly that room) and goes ahead (a scope of such a task
does not queue behind the waiting ones either, for the same reason);
and an operation that cannot wait (``materialize_nowait``, ``reserve_nowait``,
``manager.reservation``) is refused with a ``ResidencyBudgetError`` whose byte fields are the
true ledger and request and whose ``waiting_scopes`` says how many scopes it would overtake.
One that charges nothing there (a release, a move out to the host) runs at once: it may be
what the scopes wait for. A scope whose plan charges nothing where the waiting ones will (an
empty plan, a plan for another device) does not queue either.

A scope that judges its own admission (``controller.scope``: a decision is bound to the state
it was derived from, so each change means a new one) waits in an :class:`AdmissionTurn`: a
place in the same queue, taken when it must wait (its request does not fit now, or earlier
waiters want the same room) and kept until a scope entered in it is admitted or it gives up.
It is a waiting scope like the others for everything that comes later, and it decides again
only while it is first, so it keeps its place in arrival order however often its decisions go
stale. Only its own task's calls pass it (the task cannot be waiting in it while it makes
them): behind it they would wait for ever.

Why this module is long: the queue, the refusals of the operations that cannot wait, and the
account of what a waiting task holds itself (``Kept``, ``_HeldBy``) are one policy: each asks
the others (a refusal names the scopes it would overtake, a wait is refused when only the
task's own holdings stand in the way, a task holding room passes the queue), and split apart
they would share the queue's private state.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel

from ..core.errors import ResidencyBudgetError, ResidencyPlanError, ResidencyStaleStateError
from ..core.explain import (
    PlanExplanation,
    Steps,
    drain,
    explain_plan_steps,
    fails_while_kept_steps,
    plan_fits_at_once,
    plan_fits_steps,
)
from ..core.locations import Location
from ..core.plans import MemoryReservation, Release, ResidencyPlan
from ..core.values import DuplicateReservationError, ValueHandle
from .leases import current_task, lease_owners
from .signal import ManagerClosedError

if TYPE_CHECKING:
    from .context import Runtime

__all__ = ["AdmissionQueue", "AdmissionTurn", "Kept", "Keeper", "RoomWait"]

T = TypeVar("T")

#: A location several tasks' waiters claim (see :meth:`AdmissionQueue._firsts`).
_MANY = object()

#: Sliced simulations restarted because the state moved, before one runs in one go.
MAX_RESTARTS = 8
#: Rounds of asking the reclaimers for room (and explaining again) before a plan that resident
#: values nobody protects keep out is refused.
_RECLAIM_ROUNDS = 3

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Kept:
    """What a tenant keeps on a task's behalf that ends only when the task goes on (a
    loader's batches copied ahead and handed out, which move only when their consumer asks
    for the next one): ``materializations`` as ``(handle, location)``, ``reservations`` as
    ``(name, location)``; ``what`` names them in an error (``"3 slots of loader 'train'
    ..."``), ``hint`` says how to make room, as a sentence (``"Lower its prefetch."``)."""

    what: str
    materializations: tuple[tuple[ValueHandle, Location], ...] = ()
    reservations: tuple[tuple[str, Location], ...] = ()
    hint: str = ""


#: ``keeper(task)``: what a tenant keeps for ``task`` (``None``: nothing). Called on the loop,
#: when a task is about to wait for room; it must not raise or await.
Keeper = Callable[[object], "Kept | None"]


def _task_name(task: object) -> str:
    """A task's name for messages (asyncio's ``get_name()``, trio's ``name``)."""
    get_name = getattr(task, "get_name", None)
    name = get_name() if callable(get_name) else getattr(task, "name", None)
    return str(name) if name else repr(task)


class _HeldBy:
    """What one task (or ``tasks`` of them together) holds itself, which ends only when it
    goes on: the scopes it entered (``own``), its leases and holds (``leased``, one entry
    each; ``uses``: the leases among them), the reservation blocks it is in (``blocks``, as
    ``(name, location)``), the reservations it made with ``reserve_nowait`` and has not
    ended (``nowaits``, alike), and what keepers keep for it (``tenants``); ``scoped``: the
    values of the other tasks' entered scopes (their exit may move them)."""

    __slots__ = (
        "blocks",
        "kept",
        "leased",
        "nowaits",
        "own",
        "reservations",
        "scoped",
        "tasks",
        "tenants",
        "uses",
    )

    def __init__(
        self,
        own: list[Any],
        leased: tuple[tuple[ValueHandle, Location], ...],
        tenants: list[Kept],
        scoped: list[ValueHandle],
        blocks: list[tuple[str, Location]] | None = None,
        tasks: int = 1,
        uses: tuple[tuple[ValueHandle, Location], ...] = (),
        nowaits: list[tuple[str, Location]] | None = None,
    ) -> None:
        self.tasks = tasks  # how many tasks hold all this together
        self.own = own
        self.tenants = tenants
        self.scoped = scoped
        self.blocks = blocks or []
        self.nowaits = nowaits or []
        self.kept = [*leased, *(pair for tenant in tenants for pair in tenant.materializations)]
        self.reservations = [held for scope in own for held in scope.reservations_held]
        self.reservations += [pair for tenant in tenants for pair in tenant.reservations]
        self.reservations += self.blocks
        self.reservations += self.nowaits
        # A tenant's own leases (a loader's, entered while this task ran it) are named as the
        # tenant's, not as the task's.
        theirs = {pair for tenant in tenants for pair in tenant.materializations}
        self.leased = tuple(pair for pair in leased if pair not in theirs)
        self.uses = tuple(pair for pair in uses if pair not in theirs)

    def released(self) -> list[ValueHandle]:
        """``scoped`` and the values of the task's own scopes: what may move once everything
        the task holds ended too (its scopes' exits may move their values)."""
        return [*self.scoped, *(h for scope in self.own for h in scope.plan.handles())]

    def describe(self, location: Location | None) -> str:
        """What stands in the way, naming what is charged at ``location`` (``None``:
        everything), and what to do."""
        leased = [p for p in self.leased if location is None or p[1] == location]
        tenants = [
            t
            for t in self.tenants
            if location is None
            or any(loc == location for _, loc in (*t.materializations, *t.reservations))
        ]
        blocks = [b for b in self.blocks if location is None or b[1] == location]
        nowaits = [r for r in self.nowaits if location is None or r[1] == location]
        held: list[str] = []
        hints: list[str] = []
        if self.own:
            names = sorted({h.name for scope in self.own for h in scope.plan.handles()})
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            scopes = f"{len(self.own)} entered scope(s)"
            held.append(f"{scopes} (values {shown})" if names else scopes)
        # What the task holds, by kind: each lease and hold once (``leased``), the leases
        # among them (``uses``).
        leases: list[tuple[ValueHandle, Location]] = []
        holds: list[tuple[ValueHandle, Location]] = []
        uses = [p for p in self.uses if location is None or p[1] == location]
        for pair in leased:
            if pair in uses:
                uses.remove(pair)
                leases.append(pair)
            else:
                holds.append(pair)
        for kind, pairs in (("lease", leases), ("hold", holds)):
            if pairs:
                where = sorted({f"{h.name} at {loc}" for h, loc in pairs})
                shown = ", ".join(where[:6]) + (
                    f" and {len(where) - 6} more" if len(where) > 6 else ""
                )
                held.append(f"{len(pairs)} {kind}{'s' if len(pairs) > 1 else ''} ({shown})")
        if self.own or leases or holds:
            kinds = [
                *(["scopes"] if self.own else []),
                *(["leases"] if leases else []),
                *(["holds"] if holds else []),
            ]
            ends = "Exit" if not holds else "End"
            hints.append(
                f"{ends} those {' and '.join(kinds)} first, or put these values in one plan."
            )
        if blocks:
            named = ", ".join(sorted(f"{name!r} at {loc}" for name, loc in blocks))
            held.append(f"{len(blocks)} reservation block(s) ({named})")
            hints.append(
                "End those reservation blocks first, or reserve that room in the plan itself."
            )
        if nowaits:
            named = ", ".join(sorted(f"{name!r} at {loc}" for name, loc in nowaits))
            many = len(nowaits) > 1
            held.append(
                f"{len(nowaits)} reservation{'s' if many else ''} made with reserve_nowait "
                f"({named})"
            )
            hints.append(
                f"End {'them' if many else 'it'} with unreserve_nowait first, or reserve that "
                "room in the plan itself."
            )
        for tenant in tenants:
            held.append(tenant.what)
            if tenant.hint:
                hints.append(tenant.hint)
        if not held and location is not None:
            return self.describe(None)  # nothing charged there: name everything
        hints = list(dict.fromkeys(hints))  # (several tenants may give the same advice)
        if self.tasks > 1:
            hints.insert(
                0,
                "Have one of the tasks ask for this room before it holds the rest, or all of "
                "them take what they hold in one order.",
            )
            return (
                f"only what {self.tasks} waiting tasks hold themselves stands in the way "
                f"({'; '.join(held)}), and that ends only when they go on, so waiting would "
                "never end. " + " ".join(hints)
            ).rstrip()
        return (
            f"only what the waiting task holds itself stands in the way ({'; '.join(held)}), "
            "and that ends only when the task goes on, so waiting would never end. "
            + " ".join(hints)
        ).rstrip()


class _Waiter:
    """One entry of the queue: a scope's plan, or a direct operation waiting for its turn, or
    the turn of a scope that judges its own admission (see :class:`AdmissionTurn`)."""

    __slots__ = ("ahead", "event", "plan", "scope", "short_of", "task")

    def __init__(
        self,
        plan: ResidencyPlan | None,
        short_of: frozenset[Location],
        *,
        ahead: bool = False,
        scope: bool = False,
        task: object | None = None,
    ) -> None:
        self.plan = plan
        # Where it will charge bytes: a waiting scope's claim, which later direct operations
        # charging the same locations do not overtake.
        self.short_of = short_of
        # Its task holds room itself (leases, holds, entered scopes): it waits behind no one,
        # since an earlier waiter may wait for exactly that room.
        self.ahead = ahead
        # A scope (not a direct operation waiting for its turn): what a refusal counts.
        self.scope = scope or plan is not None
        # The task it waits for (None: outside any task). An earlier waiter of the same task
        # is one it cannot be waiting in while it runs (its turn): nobody waits behind it.
        self.task = task
        self.event: anyio.Event | None = None

    def of_another_task(self, task: object | None) -> bool:
        """Whether ``task`` would wait behind this waiter: it is not ``task``'s own."""
        return task is None or self.task is not task

    def arm(self) -> None:
        """Before the checks that decide whether to sleep: a wake-up that comes while they
        run (a sliced simulation awaits) is kept, and the sleep that follows returns at once
        (without it, room freed during the checks, after they looked, was never looked at)."""
        if self.event is None:
            self.event = anyio.Event()

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()

    async def sleep(self, deadline: float | None) -> None:
        """Until woken since it was armed (at once if it was already), or ``deadline``."""
        self.arm()
        event = self.event
        assert event is not None
        try:
            if deadline is None:
                await event.wait()
            else:
                with anyio.move_on_at(deadline):
                    await event.wait()
        finally:
            if self.event is event:
                self.event = None  # consumed: the next round arms a new one


class RoomWait:
    """A tenant's wait for room, registered while it lasts (see
    :meth:`ResidencyManager.room_wait`, and a scope waiting in the queue): ``plan`` for
    ``task`` (a byte need is a plan of one reservation), charging ``locations`` where budgets
    apply; ``what`` names it, ``exempt`` are the tenant's own values (it gives them back
    itself)."""

    __slots__ = ("_exempt", "locations", "needs", "plan", "task", "what")

    def __init__(
        self,
        plan: ResidencyPlan,
        needs: Mapping[Location, int],
        what: str,
        task: object,
        exempt: frozenset[ValueHandle] | Callable[[], Iterable[ValueHandle]] = frozenset(),
    ) -> None:
        self.plan = plan
        self.needs = dict(needs)  # the bytes it would charge per location (for reports)
        self.locations = frozenset(needs)
        self.what = what
        self.task = task
        self._exempt = exempt  # or what names them when asked (they change as it waits)

    @property
    def exempt(self) -> frozenset[ValueHandle]:
        exempt = self._exempt
        return exempt if isinstance(exempt, frozenset) else frozenset(exempt())

    @classmethod
    def for_bytes(
        cls,
        need: int,
        location: Location,
        what: str,
        task: object,
        exempt: frozenset[ValueHandle] | Callable[[], Iterable[ValueHandle]] = frozenset(),
    ) -> RoomWait:
        plan = ResidencyPlan(reserve=[MemoryReservation("aresidency.wait", location, need)])
        return cls(plan, {location: need}, what, task, exempt)


class AdmissionTurn:
    """A place in the admission queue for a scope that judges its own admission and waits for
    room outside :meth:`AdmissionQueue.admit` (``controller.scope``: a decision is bound to
    the state it was derived from, so it derives a new one whenever the state changed), from
    :meth:`AdmissionQueue.take_turn` until :meth:`leave`, or until a scope entered in it
    (``manager.scope(decision, turn=turn)``) was admitted (its entry charged what it needs).

    While it is in the queue it is a waiting scope like any other, charging ``locations``
    where budgets apply: a later scope, or a direct operation charging one of them, queues
    behind it; an operation that cannot wait is refused (``waiting_scopes`` counts it);
    tenants hold back (``waiting_for_room``). Like a queued scope it is woken by a change
    only while it is :attr:`first` among the waiters it contends with (or always, when its
    task holds room: it waits behind no one). Its owner judges, then awaits :meth:`wait`,
    and judges again: a change that came while it judged is kept (``wait`` returns at once).
    A scope entered in it waits where it is, never at the back of the queue, and a stale
    decision leaves it in place for the next one."""

    __slots__ = ("_queue", "_waiter", "locations")

    def __init__(self, queue: AdmissionQueue, waiter: _Waiter) -> None:
        self._queue = queue
        self._waiter = waiter
        self.locations = waiter.short_of

    def __repr__(self) -> str:
        where = ", ".join(str(loc) for loc in sorted(self.locations))
        status = "first" if self.first else "queued" if self.active else "done"
        return f"<AdmissionTurn {status} [{where}]>"

    @property
    def active(self) -> bool:
        """Whether it is still in the queue (not left, nor used by an admitted scope)."""
        return self._waiter in self._queue._queue

    @property
    def first(self) -> bool:
        """Whether no earlier waiter contends with it (it would be checked now)."""
        return self.active and self._queue._is_first(self._waiter)

    @property
    def waiting_ahead(self) -> int:
        """How many earlier waiters contend with it (and come first)."""
        return self._queue._ahead_of(self._waiter)

    async def wait(self, deadline: float | None) -> bool:
        """Park until woken (by a change while it is first, or at once for one that came
        since the last ``wait`` returned) or until ``deadline`` (``anyio.current_time()``
        clock); ``False`` if the deadline passed first. ``ManagerClosedError`` once the
        manager closes; ``RuntimeError`` once it left the queue."""
        queue, waiter = self._queue, self._waiter
        queue._check_open()
        if not self.active:
            raise RuntimeError(f"{self!r} left the admission queue: take a new turn")
        waiter.arm()
        event = waiter.event
        assert event is not None
        try:
            await waiter.sleep(deadline)
        finally:
            waiter.arm()  # for a change that comes while its owner judges again
        queue._check_open()
        return event.is_set()

    def leave(self) -> None:
        """Give up the place (nothing when it left already); the waiters behind it move up."""
        self._queue.release(self._waiter)


class AdmissionQueue:
    """Waiting scopes and direct operations, first come first served (loop thread only).

    State: ``_queue`` (waiters in arrival order; the head is the one checked), ``_judging``
    (what scopes charge that are judged, in slices, before they queue), ``_closed``
    (the manager closed: every waiter and later arrival gets ``ManagerClosedError``),
    ``_room_waits`` (the tenants' registered waits for room: see :meth:`waiting_on_each_other`).
    """

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._queue: deque[_Waiter] = deque()
        self._judging: list[frozenset[Location]] = []  # where scopes about to wait charge
        self._closed: str | None = None
        # Listening only while someone waits: most changes have nobody queued to wake.
        self._unlisten: Callable[[], None] | None = None
        self._keepers: list[Keeper] = []
        self._reclaimers: list[Callable[[Location, int], int]] = []
        self._room_waits: dict[int, RoomWait] = {}
        self._room_wait_ids = 0

    def add_room_wait(self, wait: RoomWait) -> Callable[[], None]:
        """Register ``wait`` until the returned function is called."""
        self._room_wait_ids += 1
        key = self._room_wait_ids
        self._room_waits[key] = wait

        def remove() -> None:
            self._room_waits.pop(key, None)

        return remove

    @property
    def has_room_waits(self) -> bool:
        """Whether any wait for room is registered (cheap: for every request's end)."""
        return bool(self._room_waits)

    def room_waits(self) -> list[tuple[str, Location, int, str]]:
        """The registered waits (see :meth:`ResidencyManager.room_waits`)."""
        return [
            (_task_name(w.task), location, need, w.what)
            for w in self._room_waits.values()
            for location, need in sorted(w.needs.items())
        ]

    def waiting_on_each_other(
        self, wait: RoomWait
    ) -> tuple[str, _HeldBy, tuple[str, BaseException]] | None:
        """Whether ``wait`` and the waits other tasks registered now (where it charges too)
        would wait for one another for ever: each task holds room that ends only when it goes
        on, and none of their plans would fit while the others' holdings stay (hold and
        wait). The check of a deadlock's safety (the banker's): a registered wait whose plan
        would fit while the holdings of the tasks still in the set stay could end, its task
        going on and giving its own back, and leaves the set; if ``wait``'s task is left with
        others, none of them can go on. Returns what to say of the others, what the set holds
        and where and why ``wait``'s plan fails then; ``None`` otherwise (and when no other
        task waits there). Loop thread; never waits."""
        task = wait.task
        if task is None or not self._room_waits or not self._holds_room(task):
            return None  # (a task that holds nothing is in no cycle)
        holding: dict[int, bool] = {}
        stuck = [
            other
            for other in self._room_waits.values()
            if other.locations & wait.locations
            and other.task is not None
            and other.task is not task
            and holding.setdefault(id(other.task), self._holds_room(other.task))
        ]
        if not stuck:
            return None
        stuck.append(wait)
        state = self._rt.state
        # Each wait is judged with its own tenant's exempt values: what one tenant gives back
        # itself (a pool evicts its idle models for its requests) is not room for another.
        # Every wait that could go on leaves in the same pass (its leaving only adds room), so
        # that waits kept out by what none of them holds are seen in one pass: one simulation
        # each, and one in all when the new wait itself could go on.
        while True:
            tasks = list({id(w.task): w.task for w in stuck}.values())
            if len(tasks) < 2 or wait not in stuck:
                return None
            held_by: dict[frozenset[ValueHandle], _HeldBy | None] = {}
            gone: set[int] = set()
            for other in [wait, *(w for w in stuck if w is not wait)]:
                exempt = other.exempt
                if exempt not in held_by:
                    held_by[exempt] = self._held_by_tasks(tasks, exempt)
                held = held_by[exempt]
                if held is None or self._fails_while(state, other.plan, held) is None:
                    if other is wait:
                        return None  # it could go on while all of them wait
                    gone.add(id(other.task))
            if not gone:
                break
            stuck = [w for w in stuck if id(w.task) not in gone]
        own = self._held_by_tasks(tasks, wait.exempt)
        if own is None:
            return None
        failure = self._fails_while(state, wait.plan, own)
        if failure is None:  # (judged above: it failed)
            return None
        # Only if what the set holds is what keeps it out: with that ended too, would it fit?
        # (Resident values nobody protects stay in both: another tenant may move them, and
        # then it is not the set that stands in the way.)
        if drain(fails_while_kept_steps(state, wait.plan, scoped=own.released())) is not None:
            return None
        others = "; ".join(
            f"task {_task_name(w.task)} waits for {w.what}" for w in stuck if w.task is not task
        )
        return (
            f"while {others} (each task waits for room the others hold: hold and wait)",
            own,
            failure,
        )

    def room_wait_error(
        self, wait: RoomWait, kind: str = "reservation"
    ) -> ResidencyBudgetError | None:
        """:meth:`waiting_on_each_other` for a byte need (:meth:`RoomWait.for_bytes`), as the
        ``ResidencyBudgetError`` (of ``kind``) a tenant raises (see
        :meth:`ResidencyManager.room_wait`)."""
        found = self.waiting_on_each_other(wait)
        if found is None:
            return None
        others, own, (_, cause) = found
        (reservation,) = wait.plan.reserve
        location = reservation.location
        ledger = self._rt.state.ledger(location)
        error = ResidencyBudgetError(
            location,
            ledger.budget_bytes,
            ledger.used_bytes,
            ledger.reserved_bytes,
            reservation.nbytes,
            kind=kind,
            what=f"{wait.what}, {others}; {own.describe(location)}",
        )
        error.__cause__ = cause
        return error

    @staticmethod
    def _fails_while(
        state: Any, plan: ResidencyPlan, own: _HeldBy
    ) -> tuple[str, BaseException] | None:
        """Where and why ``plan`` fails once everything transient ended but ``own``."""
        return drain(
            fails_while_kept_steps(
                state,
                plan,
                scoped=own.scoped,
                kept=own.kept,
                kept_reservations=own.reservations,
                kept_uses=own.uses,
            )
        )

    def add_keeper(self, keeper: Keeper) -> Callable[[], None]:
        """Count what ``keeper(task)`` returns as ``task``'s own (see the module docstring)
        until the returned function is called."""
        self._keepers.append(keeper)

        def remove() -> None:
            if keeper in self._keepers:
                self._keepers.remove(keeper)

        return remove

    @property
    def has_reclaimers(self) -> bool:
        """Whether a tenant offers a cache it gives back when asked (:meth:`reclaim`)."""
        return bool(self._reclaimers)

    def add_reclaimer(self, reclaimer: Callable[[Location, int], int]) -> Callable[[], None]:
        """Offer a tenant's cache (see :meth:`ResidencyManager.add_reclaimer`) until the
        returned function is called."""
        self._reclaimers.append(reclaimer)

        def remove() -> None:
            if reclaimer in self._reclaimers:
                self._reclaimers.remove(reclaimer)

        return remove

    def reclaim(self, location: Location, nbytes: int) -> int:
        """Ask the reclaimers, in the order they came, to give back ``nbytes`` at
        ``location``; the bytes whose release began (see :meth:`ResidencyManager.reclaim`)."""
        freed = 0
        for reclaimer in list(self._reclaimers):
            if freed >= nbytes:
                break
            try:
                freed += reclaimer(location, nbytes - freed)
            except Exception:  # a tenant's bug must not fail the caller's wait
                _log.exception("reclaimer %r failed", reclaimer)
        if freed:
            self._rt.signal.notify()
        return freed

    async def _reclaiming(
        self, plan: ResidencyPlan, explanation: PlanExplanation, expected: int | None
    ) -> PlanExplanation:
        """For a plan that does not fit now: ask the reclaimers for the bytes it lacks where
        it fails, and explain it again, a few rounds at most. The explanation as it stands
        then. Also when the plan would fit once transient state ended (another task's scope,
        a pool request): an idle cache given back now admits it without waiting for them.
        Not for a plan derived from a state (``expected``): its decision chose what to
        evict, and a change would make it stale."""
        state = self._rt.state
        for _ in range(0 if expected is not None else _RECLAIM_ROUNDS):
            error = explanation.blocking_error
            if explanation.feasible or not self._reclaimers:
                break
            if not isinstance(error, ResidencyBudgetError) or error.location is None:
                break
            if not self.reclaim(error.location, max(1, error.missing_bytes)):
                break
            explanation = await self._sliced(
                lambda: explain_plan_steps(state, plan, scoped=self._rt.scoped_values())
            )
        return explanation

    def kept_for(self, task: object | None) -> list[Kept]:
        """What the keepers keep on ``task``'s behalf (each non-empty answer)."""
        if task is None or not self._keepers:
            return []
        found = []
        for keeper in list(self._keepers):
            kept = keeper(task)
            if kept is not None and (kept.materializations or kept.reservations):
                found.append(kept)
        return found

    def __len__(self) -> int:
        return len(self._queue)

    def _enqueue(self, waiter: _Waiter) -> None:
        """Queue a waiter that may sleep, and wake the queue's firsts on every change from
        now on (an admitted scope's claim, which never sleeps, is only appended)."""
        self._queue.append(waiter)
        if self._unlisten is None:
            self._unlisten = self._rt.signal.add_listener(self._wake_head)

    def _wake_head(self) -> None:
        """Wake every waiter that is first among those it contends with."""
        if len(self._queue) == 1:
            self._queue[0].wake()  # (first among one: an entering scope's claim, mostly)
        elif self._queue:
            for waiter in self._firsts():
                waiter.wake()
        elif self._unlisten is not None:  # the queue emptied: listen again with the next
            self._unlisten()
            self._unlisten = None

    def _budgeted(self) -> frozenset[Location]:
        """The locations where room can run short (a budget applies): what a waiter charges
        elsewhere never makes it wait behind another."""
        return frozenset(
            loc
            for loc, ledger in self._rt.state.ledgers_by_location()
            if ledger.budget_bytes is not None
        )

    def _firsts(self) -> list[_Waiter]:
        """The waiters that no earlier waiter contends with (charging a budgeted location
        they charge too), in queue order: the queue's head and every waiter for other room.
        One pass, with set operations on a few locations per waiter: a thousand waiters are
        checked on every change."""
        budgeted = self._budgeted()
        # location -> the task of the waiters that claimed it so far (_MANY: several tasks)
        claimed: dict[Location, object] = {}
        firsts = []
        for waiter in self._queue:
            wants = waiter.short_of & budgeted
            task = waiter.task
            if waiter.ahead or all(
                loc not in claimed or (task is not None and claimed[loc] is task) for loc in wants
            ):
                firsts.append(waiter)
            for loc in wants:
                claimed[loc] = task if claimed.get(loc, task) is task else _MANY
        return firsts

    def _is_first(self, waiter: _Waiter) -> bool:
        """Whether no waiter ahead of ``waiter`` contends with it."""
        if waiter.ahead:
            return True
        wants = waiter.short_of & self._budgeted()
        for other in self._queue:
            if other is waiter:
                return True
            if not wants.isdisjoint(other.short_of) and other.of_another_task(waiter.task):
                return False
        return False

    def _ahead_of(self, waiter: _Waiter) -> int:
        """How many waiters ahead of ``waiter`` contend with it (0 when it is ahead)."""
        if waiter.ahead or waiter not in self._queue:
            return 0
        return self._contending_before(waiter)

    def _contending_before(self, waiter: _Waiter) -> int:
        """How many waiters of other tasks before ``waiter`` want room it wants."""
        wants = waiter.short_of & self._budgeted()
        queue = list(self._queue)
        return sum(
            1
            for other in queue[: queue.index(waiter)]
            if wants & other.short_of and other.of_another_task(waiter.task)
        )

    def take_turn(
        self, locations: Iterable[Location], *, only_behind_others: bool = False
    ) -> AdmissionTurn | None:
        """A place at the back of the queue for a scope charging ``locations`` that judges
        its own admission (see :class:`AdmissionTurn`). Its task holds room itself (a lease,
        hold, entered scope, reservation...): it waits behind no one, as such a task's scope
        does. ``only_behind_others``: ``None`` unless it would wait behind an earlier waiter
        (one charging one of ``locations`` where a budget applies, and the task holds no
        room)."""
        self._check_open()
        charged = frozenset(locations)
        task = current_task()
        ahead = self._holds_room(task)
        if only_behind_others and (ahead or not self.must_queue(charged, task)):
            return None
        waiter = _Waiter(None, charged, ahead=ahead, scope=True, task=task)
        waiter.arm()  # a change from now on is one it has not judged
        self._enqueue(waiter)
        return AdmissionTurn(self, waiter)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise ManagerClosedError(self._closed)

    def short_of(self, task: object | None = None) -> frozenset[Location]:
        """Locations some waiting scope is short of (or where one about to wait is being
        judged: see :meth:`admit`). Only budgeted ones: room never runs short where no budget
        applies, so an operation there overtakes nobody (it was refused with a budget error
        "of unlimited" while a scope charging that location was admitted and entering).
        ``task``: as ``task`` sees it, leaving out its own waiters (its turn, which it cannot
        be waiting in while it asks)."""
        out: set[Location] = set()
        for waiter in self._queue:
            if waiter.of_another_task(task):
                out |= waiter.short_of
        for charged in self._judging:
            out |= charged
        if not out:
            return frozenset()
        return frozenset(out) & self._budgeted()

    # -- scopes

    async def admit(
        self,
        plan: ResidencyPlan,
        expected_version: int | None,
        timeout: float | None,
        *,
        overtake: bool = False,
        turn: AdmissionTurn | None = None,
    ) -> _Waiter:
        """Return once ``plan`` may start (FIFO); see the module docstring. Raises
        ``ResidencyStaleStateError`` (checked before anything else, and again when its turn
        comes), ``ResidencyPlanError`` (could never fit, or blocked by what will not move on
        its own, or ``timeout == 0``), ``TimeoutError`` after ``timeout`` seconds.
        ``overtake``: it had its turn already (``execute`` waited for it as a direct operation
        does), so it does not queue behind scopes that came later. ``turn``: the place in the
        queue it waits in (see :class:`AdmissionTurn`), instead of one at the back; a failure
        leaves it there, for its owner to judge again in it or leave.

        Returns the scope's *claim*, which stays in the queue until :meth:`release`: the
        entry awaits its transfers after admission, and nothing queued behind it may take its
        room meanwhile. The caller releases it once the entry charged what it needs (or
        failed)."""
        self._check_open()
        if turn is not None and (turn._queue is not self or not turn.active):
            raise RuntimeError(
                f"{turn!r} is not a place in this manager's admission queue any more (it was "
                "left, or a scope was admitted in it): take a new turn"
            )
        state = self._rt.state
        self._check_stale(expected_version)
        charged = self.charged_by(plan)
        # A plan that charges nothing where a waiting scope will overtakes no one (an empty
        # plan, a plan for another device): it does not wait behind them. Nor does one whose
        # task holds room itself: an earlier waiter may wait for exactly that room.
        if turn is not None:  # already in its place: it waits behind the waiters before it
            task = current_task()
            waiter = turn._waiter
            waiter.plan = plan
            waiter.short_of = turn.locations | charged
            queued = not self._is_first(waiter)
        else:
            # (the task is asked for only where there is a queue to wait in: an operation never
            # waits behind its own task's turn; a waiter without one is everyone's)
            task = current_task() if self._queue else None
            queued = not overtake and self.must_queue(charged, task)
            ahead = queued and self._holds_room(task)
            queued = queued and not ahead
            waiter = _Waiter(plan, charged, ahead=ahead, task=task)
        if not queued and (
            plan_fits_at_once(state, plan) or await self._fits(plan, expected_version)
        ):
            self._check_stale(expected_version)  # a sliced simulation let others run
            if turn is None:
                self._queue.append(waiter)  # (a claim: it never sleeps, nothing to wake it for)
            return waiter
        if task is None:
            task = waiter.task = current_task()
        explanation = await self._sliced(
            lambda: explain_plan_steps(state, plan, scoped=self._rt.scoped_values())
        )
        explanation = await self._reclaiming(plan, explanation, expected_version)
        self._check_stale(expected_version)
        if explanation.feasible and not queued:
            if turn is None:
                self._queue.append(waiter)  # (a claim, as above)
            return waiter
        if not explanation.feasible and (not explanation.transient or timeout == 0):
            raise ResidencyPlanError(explanation.reason) from explanation.blocking_error
        if not explanation.feasible:
            # Judged in slices for a large plan: meanwhile this scope counts as waiting for
            # room (tenants that would fill room the judgement counts as given back, a
            # loader's free ring slots, hold back), as it will once queued.
            self._judging.append(charged)
            try:
                await self._refuse_waiting_on_itself(plan, task, expected_version)
            except BaseException:
                self._rt.signal.notify()  # (refused: those tenants may go on)
                raise
            finally:
                self._judging.remove(charged)
        deadline = None if timeout is None else anyio.current_time() + timeout
        # Waiting for room its task may hold some of: registered, and refused at once if it
        # closes a cycle of tasks each waiting for room the others hold (hold and wait).
        unregister = None if explanation.feasible else self._register_scope_wait(plan, task)
        if turn is None:
            self._enqueue(waiter)
        try:
            while True:
                waiter.arm()
                if self._is_first(waiter):
                    self._check_stale(expected_version)
                    if plan_fits_at_once(state, plan) or await self._fits(plan, expected_version):
                        return waiter
                    explanation = await self._sliced(
                        lambda: explain_plan_steps(state, plan, scoped=self._rt.scoped_values())
                    )
                    explanation = await self._reclaiming(plan, explanation, expected_version)
                    if not explanation.feasible and not explanation.transient:
                        raise ResidencyPlanError(explanation.reason) from (
                            explanation.blocking_error
                        )
                    if not explanation.feasible and self._holds_room(task):
                        # What stood in the way may have ended and left for good what only
                        # the task's own holdings now keep out (another scope's value stays
                        # resident once it exited): then it waits on itself.
                        await self._refuse_waiting_on_itself(plan, task, expected_version)
                if deadline is not None and anyio.current_time() >= deadline:
                    message, cause = self._timeout_message(waiter, timeout, explanation)
                    # chained to what stood in the way (diagnose reads it as the evidence)
                    raise TimeoutError(message) from cause
                await waiter.sleep(deadline)
                self._check_open()
        except BaseException:
            if turn is None:
                self.release(waiter)
            raise
        finally:
            if unregister is not None:
                unregister()

    def _register_scope_wait(
        self, plan: ResidencyPlan, task: object | None, what: str | None = None
    ) -> Callable[[], None] | None:
        """Register the wait of a scope about to wait for room (see :meth:`admit`), or raise
        ``ResidencyPlanError`` if it would close a cycle of waiting tasks
        (:meth:`waiting_on_each_other`). ``None`` for a wait outside any task, or one that
        charges no budgeted location. ``what`` names the wait (default: the scope's values)."""
        if task is None:
            return None
        state = self._rt.state
        budgeted = self._budgeted()
        needs: dict[Location, int] = {}
        for reservation in plan.reserve:
            if reservation.location in budgeted:
                needs[reservation.location] = needs.get(reservation.location, 0) + (
                    reservation.nbytes
                )
        names: list[str] = []
        for action in plan.enter:
            value = state.find_value(action.handle)
            if value is None or isinstance(action, Release):
                continue
            names.append(action.handle.name or str(action.handle.value_id))
            if action.location in budgeted and action.location not in value.materializations:
                needs[action.location] = needs.get(action.location, 0) + value.charge_bytes
        if not needs:
            return None
        if what is None:
            shown = ", ".join(names[:4])
            shown += f" and {len(names) - 4} more" if len(names) > 4 else ""
            what = f"a scope entering {shown}" if names else "a scope's reservations"
        wait = RoomWait(plan, needs, what, task)
        found = self.waiting_on_each_other(wait)
        if found is not None:
            others, own, (where, error) = found
            refused = ResidencyPlanError(
                f"infeasible at {where}: {error}; {what}, {others}; "
                f"{own.describe(getattr(error, 'location', None))}"
            )
            refused.hold_and_wait = True
            raise refused from error
        return self.add_room_wait(wait)

    def _holds_room(self, task: object | None) -> bool:
        """Whether ``task`` holds a lease or hold of this manager, has entered a scope or
        a reservation block, made a reservation with ``reserve_nowait`` it has not ended, or a
        keeper keeps something on its behalf."""
        if task is None:
            return False
        if lease_owners(self._rt).task_protects(task):
            return True
        if any(getattr(scope, "task", None) is task for scope in self._rt.scopes):
            return True
        if any(owner is task for owner in self._rt.blocks.values()):
            return True
        if any(owner is task for owner in self._rt.nowaits.values()):
            return True
        return bool(self.kept_for(task))

    async def _refuse_waiting_on_itself(
        self, plan: ResidencyPlan, task: object | None, expected_version: int | None
    ) -> None:
        """Raise ``ResidencyPlanError`` if ``plan`` could not fit even once everything
        transient ended but what ``task`` (the one about to wait) holds itself: the scopes it
        entered (their values and reservations), its leases and holds, and what keepers keep
        on its behalf. Those end only when the task goes on, so the wait would never end."""
        own = self._held_by(task)
        if own is None:
            return
        state = self._rt.state

        def steps() -> Steps[tuple[str, BaseException] | None]:
            return fails_while_kept_steps(
                state,
                plan,
                scoped=own.scoped,
                kept=own.kept,
                kept_reservations=own.reservations,
                kept_uses=own.uses,
            )

        failure = await self._sliced(steps)
        self._check_stale(expected_version)
        if failure is None:
            return
        where, error = failure
        detail = own.describe(getattr(error, "location", None))
        if isinstance(error, DuplicateReservationError):
            # The name keeps it out, not the room: a name of its own lets it in beside.
            detail += (
                " Or give the plan's reservation a name of its own (a name is unique per "
                "location while it is active)."
            )
        refused = ResidencyPlanError(f"infeasible at {where}: {error}; {detail}")
        refused.hold_and_wait = True
        raise refused from error

    def budget_waiting_on_itself(
        self,
        need: int,
        location: Location,
        what: str,
        task: object | None,
        exempt: frozenset[ValueHandle] = frozenset(),
        kind: str = "reservation",
    ) -> ResidencyBudgetError | None:
        """The error for a tenant about to wait, for ``task``, for ``need`` bytes at
        ``location`` that only what the task holds itself keeps out (see
        :meth:`ResidencyManager.waiting_on_itself`); ``None`` when the wait may end. Runs the
        simulation in one go: a single reservation against a partial copy of the state."""
        if task is None:
            return None
        error = self.budget_short_while_held(need, location, what, (task,), exempt, kind)
        if error is None:
            return None
        # Only if what the task holds is what keeps it out: with that ended too, would it fit?
        # (Resident values nobody protects stay in both: they may leave by another tenant's
        # hand, a pool giving its cache back, and the task's own holdings elsewhere are not
        # the cause.)
        own = self._held_by(task, exempt)
        assert own is not None
        plan = ResidencyPlan(reserve=[MemoryReservation("aresidency.wait", location, need)])
        if drain(fails_while_kept_steps(self._rt.state, plan, scoped=own.released())) is not None:
            return None
        return error

    def budget_short_while_held(
        self,
        need: int,
        location: Location,
        what: str,
        tasks: Collection[object],
        exempt: frozenset[ValueHandle] = frozenset(),
        kind: str = "reservation",
    ) -> ResidencyBudgetError | None:
        """The error (of ``kind``) when ``need`` bytes at ``location`` would not fit even once
        everything transient ended but what ``tasks`` hold themselves (their scopes, leases,
        holds, reservation blocks, and what keepers keep for them; the values in ``exempt``
        count as transient); ``None`` when they would fit (or the tasks hold nothing)."""
        own = self._held_by_tasks(tasks, exempt)
        if own is None:
            return None
        state = self._rt.state
        plan = ResidencyPlan(reserve=[MemoryReservation("aresidency.wait", location, need)])
        failure = self._fails_while(state, plan, own)
        if failure is None:
            return None
        ledger = state.ledger(location)
        error = ResidencyBudgetError(
            location,
            ledger.budget_bytes,
            ledger.used_bytes,
            ledger.reserved_bytes,
            need,
            kind=kind,
            what=f"{what}; {own.describe(location)}",
        )
        error.__cause__ = failure[1]
        return error

    def _held_by(
        self, task: object | None, exempt: frozenset[ValueHandle] = frozenset()
    ) -> _HeldBy | None:
        """What ``task`` holds itself (``None``: nothing). The values in ``exempt`` (a
        tenant's own, which it gives back itself) count as transient, leased or not."""
        return None if task is None else self._held_by_tasks((task,), exempt)

    def _held_by_tasks(
        self, tasks: Collection[object], exempt: frozenset[ValueHandle] = frozenset()
    ) -> _HeldBy | None:
        """What ``tasks`` hold themselves, together (``None``: nothing); see :meth:`_held_by`."""
        members = {id(task) for task in tasks if task is not None}
        if not members:
            return None
        rt = self._rt
        owners = lease_owners(rt)
        own = [scope for scope in rt.scopes if id(getattr(scope, "task", None)) in members]
        leased = tuple(
            pair
            for task in tasks
            if task is not None
            for pair in owners.protected_by(task)
            if pair[0] not in exempt
        )
        uses = tuple(
            pair
            for task in tasks
            if task is not None
            for pair in owners.leased_by(task)
            if pair[0] not in exempt
        )
        tenants = [kept for task in tasks if task is not None for kept in self.kept_for(task)]
        blocks = [key for key, owner in rt.blocks.items() if id(owner) in members]
        nowaits = [key for key, owner in rt.nowaits.items() if id(owner) in members]
        if not own and not leased and not tenants and not blocks and not nowaits:
            return None
        others = [scope for scope in rt.scopes if id(getattr(scope, "task", None)) not in members]
        scoped = [*(h for s in others for h in s.plan.handles()), *exempt]
        return _HeldBy(own, leased, tenants, scoped, blocks, len(members), uses, nowaits)

    def release(self, claim: _Waiter) -> None:
        """End an admitted scope's claim (its entry charged what it needs, or failed)."""
        if claim in self._queue:
            self._queue.remove(claim)
            # A change for everyone, not only the next waiter: a tenant that held back while a
            # scope waited for room (``materialize_nowait`` refuses to overtake it, a loader's
            # ring gives its free slots back) may go on now.
            self._rt.signal.notify()

    def _timeout_message(
        self, waiter: _Waiter, timeout: float | None, explanation: PlanExplanation
    ) -> tuple[str, BaseException | None]:
        """The timeout's message, and the error that stood in the way (the explanation's
        blocking error; ``None`` when only earlier waiters did)."""
        ahead = self._contending_before(waiter)
        plan = waiter.plan
        fits = plan is not None and drain(plan_fits_steps(self._rt.state, plan))
        if explanation.feasible or fits:
            why = f"it fits now, but {ahead} earlier waiter(s) come first (FIFO)"
            return f"plan not admitted within {timeout} s: {why}", None
        return f"plan not admitted within {timeout} s: {explanation.reason}", (
            explanation.blocking_error
        )

    def charged_by(self, plan: ResidencyPlan) -> frozenset[Location]:
        """Where ``plan`` would charge bytes: its reservations' locations, its copies'
        destinations, and the source locations of values it may rebuild."""
        out = {reservation.location for reservation in plan.reserve} if plan.reserve else set()
        values = self._rt.state._values  # (find_value, inline: one lookup per action)
        for action in (*plan.reclaim, *plan.enter, *plan.exit):
            if isinstance(action, Release):
                continue
            out.add(action.location)
            value = values.get(action.handle)
            if value is not None and value.has_source and value.source_location is not None:
                out.add(value.source_location)
        return frozenset(out)

    async def _fits(self, plan: ResidencyPlan, expected_version: int | None) -> bool:
        """Whether ``plan`` fits the current state. In slices, except for a plan bound to a
        state version (a controller decision, just found current): a slice lets other tasks
        run, and any transition one of them commits meanwhile (another value's lease, a reaped
        event) makes that plan stale for good, so under steady activity elsewhere it went stale
        at every attempt and ``controller.scope`` never got in. Such a plan is simulated in one
        step, as ``decide`` already explains it in one step."""
        state = self._rt.state
        if expected_version is not None:
            return drain(plan_fits_steps(state, plan))
        return await self._sliced(lambda: plan_fits_steps(state, plan))

    async def _sliced(self, make: Callable[[], Steps[T]]) -> T:
        """Run a simulation in slices (a checkpoint every few actions), so that a plan of
        thousands of actions never holds the loop for long. A slice that finds the state
        changed starts again from the new state; after ``MAX_RESTARTS`` it runs in one go (a
        manager changing faster than a slice would otherwise starve it)."""
        state = self._rt.state
        for _ in range(MAX_RESTARTS):
            version = state.state_version
            steps = make()
            try:
                while True:
                    next(steps)
                    await self._rt.checkpoint()
                    if state.state_version != version:
                        break
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            finally:
                steps.close()
        return drain(make())

    def _check_stale(self, expected: int | None) -> None:
        actual = self._rt.state.state_version
        if expected is not None and expected != actual:
            raise ResidencyStaleStateError(expected, actual)

    # -- direct operations

    def must_queue(self, locations: Iterable[Location], task: object | None = None) -> bool:
        """Whether an operation of ``task`` charging ``locations`` would overtake a waiting
        scope (not ``task``'s own turn)."""
        if not self._queue:
            return False
        short = self.short_of(task)
        return any(location in short for location in locations)

    async def wait_turn(self, locations: Iterable[Location]) -> None:
        """Park a direct operation that charges ``locations`` until every scope queued
        before it, that is short of one of them, has been admitted or has given up."""
        self._check_open()
        wanted = frozenset(locations)
        task = current_task()
        if not self.must_queue(wanted, task):
            return
        if self._holds_room(task):
            # The caller holds a lease or hold, has entered a scope or a reservation block, or
            # a keeper keeps room for it: a waiting scope may wait for exactly that, so
            # waiting behind it could never end. It goes ahead (it still must fit).
            return
        waiter = _Waiter(None, wanted, task=task)
        self._enqueue(waiter)
        try:
            while True:
                waiter.arm()
                ahead = list(self._queue)[: list(self._queue).index(waiter)]
                if not any(
                    other.short_of & wanted and other.of_another_task(task) for other in ahead
                ):
                    return
                await waiter.sleep(None)
                self._check_open()
        finally:
            self._queue.remove(waiter)
            self._wake_head()

    def refuse_nowait(
        self,
        charges: Mapping[Location, tuple[int, str]],
        what: Callable[[], str],
        handle: Any = None,
    ) -> None:
        """For an operation that cannot wait: ``ResidencyBudgetError`` if it would overtake a
        waiting scope at one of the locations of ``charges`` (location -> (bytes it would
        charge there, budget error ``kind``); ``what()`` names the operation). The error's
        byte fields are the ledger and the request as they are; ``waiting_scopes`` says how
        many scopes it would overtake (see ``ResidencyBudgetError``)."""
        if not self._queue:
            return  # nobody waits (the common case: a direct operation's fast path)
        task = current_task()
        short = self.short_of(task)  # (the caller's own turn it does not overtake)
        for location, (nbytes, kind) in charges.items():
            if location in short:
                ledger = self._rt.state.ledger(location)
                waiting = sum(
                    1
                    for w in self._queue
                    if w.scope and location in w.short_of and w.of_another_task(task)
                )
                raise ResidencyBudgetError(
                    location,
                    ledger.budget_bytes,
                    ledger.used_bytes,
                    ledger.reserved_bytes,
                    nbytes,
                    what=what(),
                    handle=handle,
                    kind=kind,
                    waiting_scopes=max(waiting, 1),
                )

    def close(self, message: str) -> None:
        """Wake every waiter with ``ManagerClosedError(message)``."""
        self._closed = message
        for waiter in list(self._queue):
            waiter.wake()
