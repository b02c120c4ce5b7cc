"""``Scope``: a plan entered for the duration of an ``async with`` block (single use).

Entry: compare the decision's ``expected_state_version`` (``ResidencyStaleStateError`` before
anything changes), wait for admission while only transient state blocks it (FIFO, up to
``timeout``; ``timeout=0`` never waits; a plan that could never fit fails at once; see
:mod:`~aresidency.runtime.admission`), then run ``reclaim``, admit ``reserve``, run ``enter``
and await its transfers. Exit: end the reservations, run ``exit``.

A failure after admission is ``ResidencyPlanExecutionError``: nothing committed is rolled back,
and the reservations a failed entry admitted are released. A body exception stays primary; a
failing exit is kept on ``exit_error`` (and raised when the body succeeded). ``report`` lists
the transitions this scope committed, and only those (not what other tasks committed while it
waited); the release of a failed entry's reservations is marked as clean-up there, so that
``report.in_effect`` lists what stays. Errors raised at entry carry the scope's ``plan`` and
``decision``; a ``ResidencyInUseError`` cause names the tasks owning the leases and holds.

Logging (logger ``aresidency.runtime.scopes``, nothing computed when disabled): INFO when a
scope is about to wait for admission and for what (an extra simulation of the plan, made only
when INFO is enabled), how long it waited, a summary of the controller decision it enters, and
its failures; DEBUG each eviction of the decision.

Cancellation at any await of the entry leaves no reservation, charge or protection behind (the
driver finishes or aborts every transfer begun); the exit phase runs shielded from
cancellation, so the plan's exit actions are carried out even when the body was cancelled or
the task is cancelled during the exit, natively on asyncio too (``task.cancel()``,
``asyncio.timeout``, ``asyncio.wait_for``: see :mod:`~aresidency.runtime.shield`). A
cancellation that arrives during the exit is raised once the exit finished, in place of the
body's exception if there was one (a cancellation is never lost); ``asyncio.timeout`` then
raises its ``TimeoutError`` as usual.

Closing the manager while a scope is entered: its exit changes nothing (the state is final)
and ``exit_error`` is ``ManagerClosedError`` (raised when the body succeeded).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import anyio.lowlevel

from ..core.errors import (
    ResidencyError,
    ResidencyPlanError,
    ResidencyPlanExecutionError,
    keep_scope_exit_error,
)
from ..core.explain import explain_plan, plan_fits
from ..core.locations import Location
from ..core.plans import Action, ActionFailed, ResidencyPlan, TransitionRecorder
from ..core.timeouts import check_timeout
from ..core.trace import ExecutionReport, Transition
from .admission import AdmissionTurn
from .driver import PhaseRun
from .leases import add_owners, current_task
from .signal import ManagerClosedError, refuse_copy
from .sources import load_failure_notes

if TYPE_CHECKING:
    from .context import Runtime

__all__ = ["Scope"]

_log = logging.getLogger(__name__)


def plan_of(plan_or_decision: Any, manager_id: str | None = None) -> ResidencyPlan:
    """The plan of a ``ResidencyPlan`` or of a controller decision; ``TypeError`` otherwise.
    With ``manager_id``: a decision derived from another manager's state is a
    ``ResidencyPlanError`` saying so (its expected version counts another manager's
    transitions, so staleness cannot tell)."""
    plan = getattr(plan_or_decision, "plan", plan_or_decision)
    if not isinstance(plan, ResidencyPlan):
        raise TypeError(
            f"expected a ResidencyPlan or a ResidencyDecision, got {plan_or_decision!r} "
            f"({type(plan_or_decision).__name__})"
        )
    derived_for = getattr(plan_or_decision, "manager_id", None)
    if manager_id is not None and derived_for is not None and derived_for != manager_id:
        request = getattr(plan_or_decision, "request", None)
        name = getattr(request, "name", None)
        what = f"the decision for request {name!r}" if name else "the decision"
        error = ResidencyPlanError(
            f"{what} was derived for manager {derived_for}, not for this manager "
            f"({manager_id}); nothing was changed. Derive one from this manager's state with a "
            "controller of this manager"
        )
        error.plan, error.decision = plan, plan_or_decision
        raise error
    return plan


class Scope:
    """``async with manager.scope(plan_or_decision, timeout=None) as scope`` (see the module
    docstring). State: ``plan``, ``decision`` (when made from one), ``status`` (``new`` ->
    ``entering`` -> ``entered`` -> ``exited`` | ``failed``), ``exit_error``, ``report``.
    Made with a ``turn`` (:meth:`ResidencyManager.take_turn`), it waits for admission in that
    place of the queue instead of at its back; admitted, it ends the turn (entry failed
    before admission: the turn stays, for its owner)."""

    def __init__(
        self,
        runtime: Runtime,
        plan_or_decision: Any,
        *,
        timeout: float | None = None,
        phase_name: str | None = None,
        turn: AdmissionTurn | None = None,
    ) -> None:
        if turn is not None and not isinstance(turn, AdmissionTurn):
            raise TypeError(
                f"turn must be an AdmissionTurn (manager.take_turn(...)) or None, got {turn!r}"
            )
        plan = plan_of(plan_or_decision, runtime.state.manager_id)
        if turn is not None and (turn._queue is not runtime.admission or not turn.active):
            raise ValueError(
                f"turn {turn!r} is not a place in this manager's admission queue (it is "
                "another manager's, was left, or a scope was admitted in it already): take a "
                "new one with manager.take_turn(...)"
            )
        self._rt = runtime
        self.plan = plan
        self.decision = plan_or_decision if plan_or_decision is not plan else None
        expected = getattr(plan_or_decision, "expected_state_version", None)
        self.expected_state_version: int | None = (
            expected if expected is not None else plan.expected_state_version
        )
        self.timeout = check_timeout(timeout)
        self._phase_name = phase_name
        self._turn = turn  # its place in the admission queue, when it has one already
        self._transitions: list[Transition] = []
        self._cleanup: set[int] = set()  # seqs of the failed entry's reservation release
        self._reserved: list[tuple[str, Location]] = []
        self.exit_error: BaseException | None = None
        self.status = "new"
        # The task that entered it: while that task waits for room, this scope does not exit
        # (admission counts what it keeps as the waiter's own, see AdmissionQueue.admit).
        self.task: object | None = None

    @property
    def reservations_held(self) -> tuple[tuple[str, Location], ...]:
        """The reservations it made and holds, as ``(name, location)``."""
        return tuple(self._reserved)

    @property
    def report(self) -> ExecutionReport:
        return ExecutionReport(tuple(self._transitions), frozenset(self._cleanup))

    def _name(self) -> str:
        request = getattr(self.decision, "request", None)
        name = getattr(request, "name", None)
        return f"scope for request {name!r}" if name else f"scope {id(self):#x}"

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy(
            self,
            "it is one single-use entry of a plan into its manager, and a copy would enter "
            "or exit it twice",
            "call manager.scope(...) again (with a new decision) for another scope",
        )

    def __repr__(self) -> str:
        return f"<Scope {self.status} [{len(self._transitions)} transitions]>"

    def _fail(
        self, phase: str, cause: BaseException, index: int | None = None, action: Any = None
    ) -> ResidencyPlanExecutionError:
        reservation = action if phase == "reserve" else None
        # A source's load() that raised: its note (which value, rebuilt where) is part of what
        # failed, as in the exception a direct materialize raises.
        notes = load_failure_notes(cause)[-1:]  # (this rebuild's: the latest)
        described = f"{cause} ({notes[0]})" if notes else str(cause)
        error = ResidencyPlanExecutionError(
            self._phase_name or phase,
            failed_action=None if phase == "reserve" else action,
            failed_action_index=None if phase == "reserve" else index,
            failed_reservation=reservation,
            failed_reservation_index=index if phase == "reserve" else None,
            partial_report=self.report,
            detail=(
                f"{phase} failed: {described}"
                if not self._phase_name or self._phase_name == phase
                else f"(of the plan's {phase} actions) {described}"  # execute runs every phase
            ),
            plan=self.plan,
            decision=self.decision,
        )
        add_owners(self._rt, cause)
        error.__cause__ = cause
        return error

    async def _run_phase(self, phase: str, actions: Sequence[Action]) -> None:
        if not actions:
            return
        run = PhaseRun(self._rt, phase, actions)
        try:
            await run.wait()
        except BaseException as error:
            if error is not run.error:  # a cancellation (the run finished cancelled first)
                self._transitions.extend(run.transitions)
                raise
        self._outcome(phase, run, actions)

    def _outcome(self, phase: str, run: PhaseRun, actions: Sequence[Action]) -> None:
        """Record what ``run`` (finished) committed; raise its failure as the structured
        error of ``phase`` (a cancellation or anything else unknown is the caller's)."""
        self._transitions.extend(run.transitions)
        error = run.error
        if error is None:
            return
        if isinstance(error, ActionFailed):
            action = error.action if error.action is not None else actions[error.index]
            raise self._fail(phase, error.cause, error.index, action) from error.cause
        if isinstance(error, ResidencyError):
            raise self._fail(phase, error) from error
        raise error

    def _reserve_all(self) -> None:
        if not self.plan.reserve:
            return
        # The manager may have closed while the entry waited (its reclaim): nothing changes
        # a final state.
        self._rt.check_not_frozen(f"the entry of {self._name()}")
        state = self._rt.state
        with TransitionRecorder(state, self, self._transitions):
            for index, reservation in enumerate(self.plan.reserve):
                try:
                    state.reserve(
                        reservation.name, reservation.location, reservation.nbytes, owner=self
                    )
                except (ResidencyError, ValueError) as error:
                    raise self._fail("reserve", error, index, reservation) from error
                self._reserved.append((reservation.name, reservation.location))
        self._rt.settle()

    def _unreserve_all(self, cleanup: bool = False) -> None:
        """End the reservations; ``cleanup``: a failed entry's (marked so in the report)."""
        if not self._reserved:
            return
        state = self._rt.state
        start = len(self._transitions)
        with TransitionRecorder(state, self, self._transitions):
            while self._reserved:
                name, location = self._reserved.pop()
                state.unreserve(name, location)
        if cleanup:
            self._cleanup.update(t.seq for t in self._transitions[start:])
        self._rt.settle()

    def _log_blocked(self) -> bool:
        """INFO: what the scope is about to wait for, if anything; returns whether it logged.
        Runs an extra simulation of the plan (and ``explain`` when it does not fit): call it
        only when INFO is enabled."""
        rt = self._rt
        ahead = len(rt.admission)
        if not plan_fits(rt.state, self.plan):
            explanation = explain_plan(rt.state, self.plan, scoped=rt.scoped_values())
            if not explanation.transient:
                return False  # it fails at once (and logs that): it will not wait
            _log.info("%s may wait for admission: %s", self._name(), explanation.reason)
            return True
        if ahead:
            _log.info("%s may wait behind %d earlier waiter(s) (FIFO)", self._name(), ahead)
            return True
        return False

    def _log_decision(self) -> None:
        """INFO: the summary of the controller decision entered; DEBUG: each eviction."""
        decision = self.decision
        summary = getattr(decision, "summary", None)
        if not callable(summary):
            return
        data = summary()
        _log.info(
            "%s entered decision v%s: explored %s states, %d eviction(s), placements %s, "
            "predicted peaks %s",
            self._name(),
            data.get("expected_state_version"),
            data.get("explored_states"),
            len(data.get("evictions", ())),
            data.get("placements"),
            data.get("predicted_peak_bytes"),
        )
        if _log.isEnabledFor(logging.DEBUG):
            for eviction in getattr(decision, "evictions", ()):
                _log.debug("%s evicts %s: %s", self._name(), eviction, eviction.reason)

    async def __aenter__(self) -> Scope:
        rt = self._rt
        rt.check_thread()
        if self.status != "new":
            raise RuntimeError(
                f"a scope is single use and this one is {self.status}; make a new scope (and a "
                "new decision) from the current state"
            )
        # A checkpoint, entering and leaving (as trio's async context managers are): a caller
        # already cancelled enters nothing; see __aexit__ for the other end.
        await rt.checkpoint_if_cancelled()
        self.status = "entering"
        self.task = current_task()
        plan = self.plan
        try:
            for action in (*plan.reclaim, *plan.enter, *plan.exit, *plan.reserve):
                rt.backend.check_location(action.location)
            blocked = _log.isEnabledFor(logging.INFO) and self._log_blocked()
            started = anyio.current_time() if blocked else 0.0
            overtake = self._phase_name == "execute"
            if overtake:
                # A direct operation: its turn behind the scopes already waiting for room where
                # it charges, then admitted or refused at once (it never waits for room).
                await rt.admission.wait_turn(rt.admission.charged_by(plan))
            claim = await rt.admission.admit(
                plan, self.expected_state_version, self.timeout, overtake=overtake, turn=self._turn
            )
            if blocked:
                waited = anyio.current_time() - started
                _log.info("%s admitted after waiting %.3f s", self._name(), waited)
            try:
                if plan.reclaim:
                    await self._run_phase("reclaim", plan.reclaim)
                if plan.reserve:
                    self._reserve_all()
                await self._run_phase("enter", plan.enter)
            finally:
                rt.admission.release(claim)  # what it needs is charged: let the next in
        except BaseException as error:
            self.status = "failed"
            if not rt.frozen:  # else the state is final: what it reserved stays in it
                self._unreserve_all(cleanup=True)
            if isinstance(error, ResidencyPlanExecutionError):
                error.set_report(self.report)  # with the reservation clean-up included
            elif isinstance(error, ResidencyPlanError) and error.plan is None:
                error.plan, error.decision = self.plan, self.decision
            if isinstance(error, ResidencyError) and _log.isEnabledFor(logging.INFO):
                _log.info("%s failed at entry: %s", self._name(), error)
            raise
        self.status = "entered"
        rt.scopes.add(self)
        if self.decision is not None and _log.isEnabledFor(logging.INFO):
            self._log_decision()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.status != "entered":
            return
        rt = self._rt
        rt.scopes.discard(self)
        # A change for admission even when the exit moves nothing: its values are no longer
        # "a scope's" (what a waiter counted as room to come back may stay for good now), and
        # a waiter must judge again.
        rt.signal.notify()
        if rt.frozen:
            # The manager closed during the body: its state is final, so the exit changes
            # nothing (its reservations end with the manager) and says so.
            self.status = "failed"
            self.exit_error = ManagerClosedError(
                f"the manager closed while {self._name()} was entered: its exit actions were "
                "not carried out and its reservations stay in the final state"
            )
            if exc is None:
                raise self.exit_error
            _note_exit_failure(exc, self._name(), self.exit_error)
            return
        cancelled: BaseException | None = None
        try:
            if self._reserved:
                self._unreserve_all()
            if self.plan.exit:
                # Finished whatever cancels the task meanwhile, a native asyncio cancellation
                # included (an anyio shield would let that one through): see .shield.
                run = PhaseRun(rt, "exit", self.plan.exit)
                cancelled = await run.wait_finished_shielded()
                self._outcome("exit", run, self.plan.exit)
            self.status = "exited"
        except BaseException as error:
            self.status = "failed"
            self.exit_error = error
            if isinstance(error, ResidencyPlanExecutionError):
                error.set_report(self.report)
            if isinstance(error, ResidencyError) and _log.isEnabledFor(logging.INFO):
                _log.info("%s failed at exit: %s", self._name(), error)
            if cancelled is not None:
                raise cancelled from error  # the cancellation is not lost to a failed exit
            if exc is None:
                raise
            _note_exit_failure(exc, self._name(), error)
            return
        if cancelled is not None:
            raise cancelled  # it arrived during the exit, which finished first
        if not self.plan.exit:
            # Lets the loop run even when nothing had to move: a loop of scopes on resident
            # values never starves the other tasks.
            await rt.cancel_shielded_checkpoint()


def _note_exit_failure(primary: BaseException, scope: str, error: BaseException) -> None:
    """The body's exception stays primary; a note on it (shown in its traceback) says the exit
    failed too, for code that wrote ``async with manager.scope(plan):`` with no name for the
    scope whose ``exit_error`` keeps it; ``diagnose(primary, manager)`` reaches it too."""
    keep_scope_exit_error(primary, error)
    primary.add_note(
        f"aresidency: {scope} also failed at exit (kept on scope.exit_error): "
        f"{type(error).__name__}: {error}"
    )
