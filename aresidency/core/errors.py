"""The exception hierarchy (docs/architecture.md, rule 9) and each error's structured fields.

::

    ResidencyError
    ├── ResidencyBudgetError          location, budget_bytes, used_bytes, reserved_bytes,
    │                                 requested_bytes, handle, kind, in_simulation
    ├── ResidencyPlanError            reason (plan, decision when raised at a scope's entry)
    │   ├── ResidencySearchLimitError request_name, state_limit, explored_states, detail
    │   └── ResidencyStaleStateError  expected_version, actual_version
    ├── ResidencyInUseError           handle, location, use_count, hold_count, pending_event_count,
    │                                 owners
    ├── ResidencyUnavailableError     handle, location, detail
    └── ResidencyPlanExecutionError   phase, failed_action(_index), failed_reservation(_index),
                                      partial_report, plan, decision (the cause is chained)

Every field is an attribute; ``str(error)`` is built from the fields and says what to do.
``error.to_dict()`` gives every field in JSON-able form (handles as ``ValueHandle.to_dict``,
locations as strings, plans, decisions and reports summarized, the chained cause nested), for
logs and for ``manager.dump``. Errors pickle and unpickle with their fields intact (the chained
cause, as for any exception, does not travel).

Why this module is long: it is the whole hierarchy above, and each class carries its fields,
the message built from them, its ``to_dict`` and its pickling; kept together so that a field
added to one error is seen beside the others' and the serialization rules stay one set.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, ClassVar

from .locations import Location
from .trace import ExecutionReport

__all__ = [
    "BUDGET_KINDS",
    "LOAD_NOTE_PREFIX",
    "ResidencyBudgetError",
    "ResidencyError",
    "ResidencyInUseError",
    "ResidencyPlanError",
    "ResidencyPlanExecutionError",
    "ResidencySearchLimitError",
    "ResidencyStaleStateError",
    "ResidencyUnavailableError",
    "exception_to_dict",
    "format_bytes",
    "keep_scope_exit_error",
    "scope_exit_error_of",
    "to_jsonable",
]

#: How the note begins that the runtime adds to an error a value's source raised from
#: ``load()`` while the value was rebuilt (``runtime.sources.note_load_failure``); diagnosis
#: finds such notes by it.
LOAD_NOTE_PREFIX = "while rebuilding "

#: What a ``ResidencyBudgetError`` was checking, and how its message names it.
BUDGET_KINDS: Mapping[str, str] = {
    "materialization": "a new materialization",
    "reservation": "a MemoryReservation",
    "reconstruction": "temporary reconstruction storage (at the value's source_location)",
    "budget": "a new budget",
}

#: What to make smaller when a request is larger than a whole budget, by kind.
_SMALLER: Mapping[str, str] = {
    "materialization": ("the value smaller (split it; for a loader's batch, a smaller batch size)"),
    "reservation": "the reservation smaller (for a loader's ring slot, a smaller batch size)",
    "reconstruction": (
        "the value smaller, or give its source a source_location with a budget that holds it"
    ),
}

#: How deep ``to_dict`` follows nested errors and records before it summarizes with ``str``.
_MAX_DEPTH = 8
_MAX_GROUP = 16  # the members of an exception group that exception_to_dict writes


def format_bytes(nbytes: int | None) -> str:
    """``1536`` -> ``'1536 B (1.5 KiB)'``: exact bytes first, a readable size beside them."""
    if nbytes is None:
        return "unlimited"
    size = float(abs(nbytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    if unit == "B":
        return f"{nbytes} B"
    sign = "-" if nbytes < 0 else ""
    return f"{nbytes} B ({sign}{size:.1f} {unit})"


def to_jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` in a form ``json.dumps`` takes: records with a ``to_dict`` use it, locations
    become strings, enums their value, exceptions :func:`exception_to_dict`, other dataclasses
    (plans, actions, decisions, explanations) a dict of their fields with their ``type``,
    mappings and sequences recursively; anything else its ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > _MAX_DEPTH:
        return str(value)
    if isinstance(value, Location):
        return str(value)
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value, depth + 1)
    if isinstance(value, BaseException):
        return exception_to_dict(value, depth + 1)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        return to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {"type": type(value).__name__}
        for item in dataclasses.fields(value):
            out[item.name] = to_jsonable(getattr(value, item.name), depth + 1)
        return out
    if isinstance(value, Mapping):
        return {str(to_jsonable(k, depth + 1)): to_jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [to_jsonable(item, depth + 1) for item in items]
    return str(value)


def exception_to_dict(error: BaseException, depth: int = 0) -> dict[str, Any]:
    """Any exception as a JSON-able dict: a ``ResidencyError`` with all its fields, another
    with its type and message; the chained cause (``__cause__``) nested under ``cause``; an
    exception group's members (what a task group raises) under ``exceptions`` (the first
    ``_MAX_GROUP``)."""
    if isinstance(error, ResidencyError):
        return error.to_dict(depth)
    out: dict[str, Any] = {"type": type(error).__name__, "message": _safe_str(error)}
    _add_cause(out, error, depth)
    if isinstance(error, BaseExceptionGroup) and depth < _MAX_DEPTH:
        members = error.exceptions
        out["exceptions"] = [exception_to_dict(e, depth + 1) for e in members[:_MAX_GROUP]]
        if len(members) > _MAX_GROUP:
            out["exceptions_left_out"] = len(members) - _MAX_GROUP
    return out


#: The attribute a scope sets on its body's exception when its exit failed too (see
#: :func:`keep_scope_exit_error`).
_SCOPE_EXIT_ERROR = "_aresidency_scope_exit_error"


def keep_scope_exit_error(primary: BaseException, error: BaseException) -> None:
    """Record on ``primary`` (a scope body's exception, which stays the one raised) that the
    scope's exit failed with ``error``, the scope's ``exit_error``: a diagnosis of ``primary``
    then reaches the exit failure's evidence (``scope_exit_error`` in its dict), also for code
    that entered the scope without naming it."""
    try:
        setattr(primary, _SCOPE_EXIT_ERROR, error)
    except Exception:  # an exception type that refuses attributes: its note still says it
        pass


def scope_exit_error_of(error: BaseException) -> BaseException | None:
    """The exit failure a scope recorded on its body's exception ``error``, or ``None``."""
    found = getattr(error, _SCOPE_EXIT_ERROR, None)
    return found if isinstance(found, BaseException) else None


def _safe_str(error: BaseException) -> str:
    """``str(error)``, or a stand-in when the exception's own ``__str__`` raises (as the
    traceback module prints it): converting the error being diagnosed must not fail."""
    try:
        return str(error)
    except Exception as failure:  # any failure of a foreign __str__
        return f"<exception str() failed: {type(failure).__name__}: {failure}>"


def _add_cause(out: dict[str, Any], error: BaseException, depth: int) -> None:
    notes = getattr(error, "__notes__", None)
    if notes:
        out["notes"] = [str(note) for note in notes]
    cause = error.__cause__
    if cause is not None:
        out["cause"] = (
            exception_to_dict(cause, depth + 1)
            if depth < _MAX_DEPTH
            else {"type": type(cause).__name__, "message": _safe_str(cause)}
        )
    exit_error = scope_exit_error_of(error)
    if exit_error is not None and depth < _MAX_DEPTH:
        out["scope_exit_error"] = exception_to_dict(exit_error, depth + 1)


def _rebuild(cls: type[ResidencyError], state: dict[str, Any]) -> ResidencyError:
    error = cls.__new__(cls)
    error.__dict__.update(state)
    error.args = (error._message(),)
    return error


class ResidencyError(Exception):
    """Base of every error aresidency raises on purpose.

    ``FIELDS`` names the structured fields of each class (what :meth:`to_dict` writes beside
    ``type`` and ``message``)."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str | None = None) -> None:
        if message is not None:
            self.message = message
        super().__init__(self._message())

    def _message(self) -> str:
        return str(self.__dict__.get("message", ""))

    def _refresh(self) -> None:
        """Rebuild ``args`` after a field changed (the message is made from the fields)."""
        self.args = (self._message(),)

    def __str__(self) -> str:
        return self._message()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), dict(self.__dict__)))

    def to_dict(self, depth: int = 0) -> dict[str, Any]:
        """JSON-able: ``type``, ``message``, every structured field, ``cause`` (the chained
        error, nested) and ``notes``."""
        out: dict[str, Any] = {"type": type(self).__name__, "message": str(self)}
        for name in self.FIELDS:
            out[name] = to_jsonable(getattr(self, name, None), depth + 1)
        _add_cause(out, self, depth)
        return out


class ResidencyBudgetError(ResidencyError):
    """A direct materialization or reservation would exceed one strict location budget.

    Admissible iff ``budget_bytes is None or used_bytes + reserved_bytes + requested_bytes <=
    budget_bytes``; this error means that was false (or, with ``waiting_scopes``, that the
    queue refused it: see below). ``used_bytes`` and ``reserved_bytes`` are
    the ledger at the moment of the check. ``kind`` says what was asked: ``"materialization"``
    (a new copy of ``handle`` at ``location``), ``"reservation"`` (a ``MemoryReservation``;
    ``handle`` is ``None``), ``"reconstruction"`` (the temporary charge of rebuilding ``handle``
    at its ``source_location``) or ``"budget"`` (``set_budget`` below what is charged).
    ``in_simulation`` is true when the check ran on ``explain``'s simulation: the numbers are then
    the simulated state partway through the plan, not the manager's state.

    ``waiting_scopes`` is non-zero when an operation that cannot wait (``materialize_nowait``,
    ``reserve_nowait``, ``manager.reservation``) was refused because that many scopes wait for
    room at ``location`` first (FIFO): the five byte fields are still the ledger and the request
    as they are (the request may fit: ``missing_bytes`` is then 0, and the message says it was
    the queue that refused it).
    """

    FIELDS = (
        "location",
        "budget_bytes",
        "used_bytes",
        "reserved_bytes",
        "requested_bytes",
        "current_bytes",
        "missing_bytes",
        "handle",
        "kind",
        "in_simulation",
        "what",
        "waiting_scopes",
    )
    # Defaults for errors pickled before these fields existed.
    handle: Any = None
    kind: str = "materialization"
    in_simulation: bool = False
    waiting_scopes: int = 0

    def __init__(
        self,
        location: Location,
        budget_bytes: int | None,
        used_bytes: int,
        reserved_bytes: int,
        requested_bytes: int,
        *,
        what: str = "",
        handle: Any = None,
        kind: str = "materialization",
        in_simulation: bool = False,
        waiting_scopes: int = 0,
    ) -> None:
        if kind not in BUDGET_KINDS:
            raise ValueError(
                f"unknown budget error kind {kind!r}; use one of {', '.join(BUDGET_KINDS)}"
            )
        self.location = location
        self.budget_bytes = budget_bytes
        self.used_bytes = used_bytes
        self.reserved_bytes = reserved_bytes
        self.requested_bytes = requested_bytes
        self.what = what
        self.handle = handle
        self.kind = kind
        self.in_simulation = in_simulation
        self.waiting_scopes = waiting_scopes
        super().__init__()

    @property
    def current_bytes(self) -> int:
        return self.used_bytes + self.reserved_bytes

    @property
    def new_peak_bytes(self) -> int:
        """``current_bytes + requested_bytes``: what the location would have reached."""
        return self.current_bytes + self.requested_bytes

    @property
    def missing_bytes(self) -> int:
        """How many bytes of headroom are missing (0 when no budget)."""
        if self.budget_bytes is None:
            return 0
        return max(0, self.new_peak_bytes - self.budget_bytes)

    @property
    def never_fits(self) -> bool:
        """Whether the request alone is larger than the whole budget: it would not fit even
        with nothing else charged at the location, so freeing room there cannot help."""
        return (
            self.kind != "budget"
            and self.budget_bytes is not None
            and self.requested_bytes > self.budget_bytes
        )

    def _message(self) -> str:
        if self.kind == "budget":
            return (
                f"a new budget of {format_bytes(self.budget_bytes)} at {self.location} is below "
                f"what is already charged there: used {format_bytes(self.used_bytes)} + "
                f"reserved {format_bytes(self.reserved_bytes)} = "
                f"{format_bytes(self.current_bytes)}; free "
                f"{format_bytes(max(0, self.current_bytes - (self.budget_bytes or 0)))} there "
                "first (release or move values, end reservations), or set a larger budget"
            )
        what = f" ({self.what})" if self.what else ""
        if self.waiting_scopes and not self.missing_bytes:
            return (
                f"refused at {self.location}: {BUDGET_KINDS[self.kind]}{what} of "
                f"{format_bytes(self.requested_bytes)} fits the budget now (used "
                f"{format_bytes(self.used_bytes)} + reserved {format_bytes(self.reserved_bytes)}"
                f" + requested = {format_bytes(self.new_peak_bytes)} of "
                f"{format_bytes(self.budget_bytes)}), but {self.waiting_scopes} scope(s) "
                "waiting for room there come first (FIFO) and an operation that cannot wait "
                "does not overtake them; retry once they were admitted, or use the awaiting "
                "operation (it waits its turn)"
            )
        # The simulation's note comes last: the live check's message is then a prefix of the
        # simulated one (an explanation's reason reads as the execution error would).
        simulation = (
            ". This check ran in explain's simulation: used and reserved are the simulated "
            "state partway through the plan, not the manager's current state"
            if self.in_simulation
            else ""
        )
        if self.never_fits:
            # Freeing room cannot help: even an empty location would not hold it.
            advice = (
                f"it can never fit under this budget, even with nothing else charged at "
                f"{self.location}: raise the budget to at least "
                f"{format_bytes(self.requested_bytes)}, or make {_SMALLER[self.kind]}"
            )
        else:
            advice = (
                f"free {format_bytes(self.missing_bytes)} there (release or move values, end "
                "reservations) or raise the budget"
            )
        return (
            f"budget exceeded at {self.location} by {BUDGET_KINDS[self.kind]}{what}: requested "
            f"{format_bytes(self.requested_bytes)}, but used {format_bytes(self.used_bytes)} + "
            f"reserved {format_bytes(self.reserved_bytes)} + requested would reach "
            f"{format_bytes(self.new_peak_bytes)} against a budget of "
            f"{format_bytes(self.budget_bytes)}; {advice}{simulation}"
        )


class ResidencyPlanError(ResidencyError):
    """A plan or request is invalid or infeasible before any of its actions begins.

    Raised for an infeasible plan, its ``__cause__`` is the explanation's ``blocking_error``
    (a ``ResidencyBudgetError`` names the location and the five byte counts). ``plan`` and
    ``decision`` are set when a scope's entry raised it (``None`` otherwise); ``request`` when
    the controller refused a request (invalid, infeasible, or its search limit reached), so
    that each of its requirements can be checked on its own. ``hold_and_wait`` is true when a
    scope that could otherwise wait was refused because waiting would never end: only what
    the waiting task holds itself (its scopes, leases, holds), or what tasks waiting for each
    other's room hold, stands in the way."""

    FIELDS: ClassVar[tuple[str, ...]] = ("reason", "plan", "decision", "request", "hold_and_wait")
    plan: Any = None
    decision: Any = None
    request: Any = None
    hold_and_wait: bool = False

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__()

    def _message(self) -> str:
        return str(self.__dict__.get("reason", ""))


class ResidencySearchLimitError(ResidencyPlanError):
    """The controller's bounded search reached ``state_limit``: feasibility is unknown.

    ``plan_found`` is true when the search had found a feasible plan before it stopped
    (``detail`` then gives the best so far): the request is not infeasible, but whether that
    plan is the cheapest is unknown, and the search makes no decision it could not finish."""

    FIELDS = (
        *ResidencyPlanError.FIELDS,
        "request_name",
        "state_limit",
        "explored_states",
        "detail",
        "plan_found",
    )
    plan_found: bool = False  # (errors pickled before the field existed)

    def __init__(
        self,
        request_name: str,
        state_limit: int,
        explored_states: int,
        detail: str,
        *,
        plan_found: bool = False,
    ) -> None:
        self.request_name = request_name
        self.state_limit = state_limit
        self.explored_states = explored_states
        self.detail = detail
        self.plan_found = plan_found
        super().__init__(self._limit_message())

    def _limit_message(self) -> str:
        known = (
            "a feasible plan was found, but whether it is the cheapest is unknown, so no "
            "decision was made"
            if self.plan_found
            else "feasibility is unknown, not disproved"
        )
        return (
            f"search for request {self.request_name!r} reached its limit of {self.state_limit} "
            f"states after exploring {self.explored_states}; {known} ({self.detail}); simplify "
            "the request's alternatives or raise search_state_limit"
        )


class ResidencyStaleStateError(ResidencyPlanError):
    """A decision's expected manager version no longer matches; nothing was changed."""

    FIELDS = (*ResidencyPlanError.FIELDS, "expected_version", "actual_version")

    def __init__(self, expected_version: int, actual_version: int) -> None:
        self.expected_version = expected_version
        self.actual_version = actual_version
        super().__init__(
            f"stale decision: it expected state version {expected_version} but the manager is at "
            f"{actual_version}; nothing was changed. Derive a new decision from the request "
            "(controller.decide) and review it instead of replaying this one"
        )


class ResidencyInUseError(ResidencyError):
    """A lease, hold or pending CUDA event protects the materialization a removal needs.

    ``owners`` names the tasks holding leases and holds on that materialization when the
    runtime raised the error (empty from the pure model, or when only pending events protect
    it). ``transfer`` is set when a transfer in flight is (also) in the way: ``"incoming"``
    (the copy there is still arriving) or ``"outgoing"`` (the value is moving out of there,
    or this phase's own copy reads it); ``None`` otherwise."""

    FIELDS = (
        "handle",
        "location",
        "use_count",
        "hold_count",
        "pending_event_count",
        "operation",
        "owners",
        "transfer",
    )
    owners: tuple[str, ...] = ()
    transfer: str | None = None

    def __init__(
        self,
        handle: Any,
        location: Location,
        use_count: int,
        hold_count: int,
        pending_event_count: int,
        *,
        operation: str = "remove",
        owners: tuple[str, ...] = (),
        transfer: str | None = None,
    ) -> None:
        if transfer not in (None, "incoming", "outgoing"):
            raise ValueError(f"transfer must be None, 'incoming' or 'outgoing', not {transfer!r}")
        self.handle = handle
        self.location = location
        self.use_count = use_count
        self.hold_count = hold_count
        self.pending_event_count = pending_event_count
        self.operation = operation
        self.owners = tuple(owners)
        self.transfer = transfer
        super().__init__()

    def with_owners(self, owners: tuple[str, ...]) -> ResidencyInUseError:
        """Set ``owners`` (the runtime does, before the error reaches the caller); returns
        the error itself."""
        self.owners = tuple(owners)
        self._refresh()
        return self

    def _message(self) -> str:
        owners = self.__dict__.get("owners") or ()
        held = (
            " (leases and holds owned by task(s) " + ", ".join(repr(o) for o in owners) + ")"
            if owners
            else ""
        )
        counts = (
            f"use_count={self.use_count}, hold_count={self.hold_count}, "
            f"pending_event_count={self.pending_event_count}{held}"
        )
        transfer = self.__dict__.get("transfer")
        if transfer is not None:
            what = (
                "its copy there is still arriving (an incoming transfer is in flight)"
                if transfer == "incoming"
                else "an outgoing transfer out of it is in flight"
            )
            protected = (
                f"; it is also protected by {counts}"
                if self.use_count or self.hold_count or self.pending_event_count or owners
                else ""
            )
            return (
                f"cannot {self.operation} {self.handle} at {self.location}: {what}{protected}; "
                "await that transfer (or cancel it), then retry (or defer the removal)"
            )
        return (
            f"cannot {self.operation} {self.handle} at {self.location}: it is protected by "
            f"{counts}; exit the lease, release the hold, or wait for the consumer stream, then "
            "retry (or defer the removal)"
        )


class ResidencyUnavailableError(ResidencyError):
    """A direct operation needs an endpoint (or source) that is absent."""

    FIELDS = ("handle", "location", "detail")

    def __init__(self, handle: Any, location: Location | None, detail: str) -> None:
        self.handle = handle
        self.location = location
        self.detail = detail
        super().__init__()

    def _message(self) -> str:
        where = f" at {self.location}" if self.location is not None else ""
        what = "the location" if self.handle is None else str(self.handle)
        if self.handle is None and self.location is not None:
            return f"{self.location} is unavailable: {self.detail}"
        return f"{what}{where} is unavailable: {self.detail}"


class ResidencyPlanExecutionError(ResidencyError):
    """Execution failed after preflight; a prefix may have committed and is not rolled back.

    ``partial_report.transitions`` lists every transition the plan run committed (and only
    those: not what other tasks committed meanwhile); ``partial_report.in_effect`` leaves out
    the clean-up (aborted copies, the released reservation prefix) and what it undid: the
    message counts those. ``plan`` and ``decision`` are the scope's, when it had them."""

    FIELDS = (
        "phase",
        "failed_action",
        "failed_action_index",
        "failed_reservation",
        "failed_reservation_index",
        "detail",
        "partial_report",
        "plan",
        "decision",
    )
    plan: Any = None
    decision: Any = None

    def __init__(
        self,
        phase: str,
        *,
        failed_action: Any = None,
        failed_action_index: int | None = None,
        failed_reservation: Any = None,
        failed_reservation_index: int | None = None,
        partial_report: ExecutionReport,
        detail: str = "",
        plan: Any = None,
        decision: Any = None,
    ) -> None:
        if phase not in ("execute", "reclaim", "reserve", "enter", "exit"):
            raise ValueError(f"unknown plan phase {phase!r}")
        self.phase = phase
        self.failed_action = failed_action
        self.failed_action_index = failed_action_index
        self.failed_reservation = failed_reservation
        self.failed_reservation_index = failed_reservation_index
        self.partial_report = partial_report
        self.detail = detail
        self.plan = plan
        self.decision = decision
        super().__init__()

    def set_report(self, report: ExecutionReport) -> None:
        """Replace ``partial_report`` (a scope does, once its clean-up committed)."""
        self.partial_report = report
        self._refresh()

    def _message(self) -> str:
        if self.failed_reservation is not None:
            failed = f"reservation #{self.failed_reservation_index} {self.failed_reservation}"
        elif self.failed_action is not None:
            failed = f"action #{self.failed_action_index} {self.failed_action}"
        else:
            failed = "no single action"
        report = self.partial_report
        kept = len(report.in_effect)
        undone = len(report.transitions) - kept
        cleaned = f" ({undone} more were clean-up or undone by it)" if undone else ""
        detail = f": {self.detail}" if self.detail else ""
        return (
            f"plan execution failed in phase {self.phase!r} at {failed}{detail}; "
            f"{kept} committed transition(s) stay in effect{cleaned} (see "
            "partial_report.in_effect); take a new snapshot and continue from the actual state"
        )
