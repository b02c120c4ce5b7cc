"""The exception hierarchy (DESIGN.md rule 9) and the guide's structured fields.

::

    ResidencyError
    ├── ResidencyBudgetError          location, budget_bytes, used_bytes, reserved_bytes,
    │                                 requested_bytes
    ├── ResidencyPlanError            reason
    │   ├── ResidencySearchLimitError request_name, state_limit, explored_states, detail
    │   └── ResidencyStaleStateError  expected_version, actual_version
    ├── ResidencyInUseError           handle, location, use_count, hold_count, pending_event_count
    ├── ResidencyUnavailableError     handle, location, detail
    └── ResidencyPlanExecutionError   phase, failed_action(_index), failed_reservation(_index),
                                      partial_report (the cause is chained)

Every field is an attribute; ``str(error)`` is built from the fields and says what to do. Errors
pickle and unpickle with their fields intact (the chained cause, as for any exception, does not
travel).
"""

from __future__ import annotations

from typing import Any

from .locations import Location
from .trace import ExecutionReport

__all__ = [
    "ResidencyBudgetError",
    "ResidencyError",
    "ResidencyInUseError",
    "ResidencyPlanError",
    "ResidencyPlanExecutionError",
    "ResidencySearchLimitError",
    "ResidencyStaleStateError",
    "ResidencyUnavailableError",
    "format_bytes",
]


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


def _rebuild(cls: type[ResidencyError], state: dict[str, Any]) -> ResidencyError:
    error = cls.__new__(cls)
    error.__dict__.update(state)
    error.args = (error._message(),)
    return error


class ResidencyError(Exception):
    """Base of every error aresidency raises on purpose."""

    def __init__(self, message: str | None = None) -> None:
        if message is not None:
            self.message = message
        super().__init__(self._message())

    def _message(self) -> str:
        return str(self.__dict__.get("message", ""))

    def __str__(self) -> str:
        return self._message()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), dict(self.__dict__)))


class ResidencyBudgetError(ResidencyError):
    """A direct materialization or reservation would exceed one strict location budget.

    Admissible iff ``budget_bytes is None or used_bytes + reserved_bytes + requested_bytes <=
    budget_bytes``; this error means that was false.
    """

    def __init__(
        self,
        location: Location,
        budget_bytes: int | None,
        used_bytes: int,
        reserved_bytes: int,
        requested_bytes: int,
        *,
        what: str = "",
    ) -> None:
        self.location = location
        self.budget_bytes = budget_bytes
        self.used_bytes = used_bytes
        self.reserved_bytes = reserved_bytes
        self.requested_bytes = requested_bytes
        self.what = what
        super().__init__()

    @property
    def current_bytes(self) -> int:
        return self.used_bytes + self.reserved_bytes

    @property
    def missing_bytes(self) -> int:
        """How many bytes of headroom are missing (0 when no budget)."""
        if self.budget_bytes is None:
            return 0
        return max(0, self.current_bytes + self.requested_bytes - self.budget_bytes)

    def _message(self) -> str:
        what = f" for {self.what}" if self.what else ""
        return (
            f"budget exceeded at {self.location}: requested {format_bytes(self.requested_bytes)}"
            f"{what}, but used {format_bytes(self.used_bytes)} + reserved "
            f"{format_bytes(self.reserved_bytes)} + requested would reach "
            f"{format_bytes(self.current_bytes + self.requested_bytes)} against a budget of "
            f"{format_bytes(self.budget_bytes)}; free {format_bytes(self.missing_bytes)} there "
            "(release or move values, end reservations) or raise the budget"
        )


class ResidencyPlanError(ResidencyError):
    """A plan or request is invalid or infeasible before any of its actions begins."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__()

    def _message(self) -> str:
        return str(self.__dict__.get("reason", ""))


class ResidencySearchLimitError(ResidencyPlanError):
    """The controller's bounded search reached ``state_limit``: feasibility is unknown."""

    def __init__(
        self, request_name: str, state_limit: int, explored_states: int, detail: str
    ) -> None:
        self.request_name = request_name
        self.state_limit = state_limit
        self.explored_states = explored_states
        self.detail = detail
        super().__init__(self._limit_message())

    def _limit_message(self) -> str:
        return (
            f"search for request {self.request_name!r} reached its limit of {self.state_limit} "
            f"states after exploring {self.explored_states}; feasibility is unknown, not "
            f"disproved ({self.detail}); simplify the request's alternatives or raise "
            "search_state_limit"
        )


class ResidencyStaleStateError(ResidencyPlanError):
    """A decision's expected manager version no longer matches; nothing was changed."""

    def __init__(self, expected_version: int, actual_version: int) -> None:
        self.expected_version = expected_version
        self.actual_version = actual_version
        super().__init__(
            f"stale decision: it expected state version {expected_version} but the manager is at "
            f"{actual_version}; nothing was changed. Derive a new decision from the request "
            "(controller.decide) and review it instead of replaying this one"
        )


class ResidencyInUseError(ResidencyError):
    """A lease, hold or pending CUDA event protects the materialization a removal needs."""

    def __init__(
        self,
        handle: Any,
        location: Location,
        use_count: int,
        hold_count: int,
        pending_event_count: int,
        *,
        operation: str = "remove",
    ) -> None:
        self.handle = handle
        self.location = location
        self.use_count = use_count
        self.hold_count = hold_count
        self.pending_event_count = pending_event_count
        self.operation = operation
        super().__init__()

    def _message(self) -> str:
        return (
            f"cannot {self.operation} {self.handle} at {self.location}: it is protected by "
            f"use_count={self.use_count}, hold_count={self.hold_count}, "
            f"pending_event_count={self.pending_event_count}; exit the lease, release the hold, "
            "or wait for the consumer stream, then retry (or defer the removal)"
        )


class ResidencyUnavailableError(ResidencyError):
    """A direct operation needs an endpoint (or source) that is absent."""

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
    """Execution failed after preflight; a prefix may have committed and is not rolled back."""

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
        super().__init__()

    def _message(self) -> str:
        if self.failed_reservation is not None:
            failed = f"reservation #{self.failed_reservation_index} {self.failed_reservation}"
        elif self.failed_action is not None:
            failed = f"action #{self.failed_action_index} {self.failed_action}"
        else:
            failed = "no single action"
        count = len(self.partial_report.transitions)
        detail = f": {self.detail}" if self.detail else ""
        return (
            f"plan execution failed in phase {self.phase!r} at {failed}{detail}; "
            f"{count} committed transition(s) stay in effect (see partial_report); take a new "
            "snapshot and continue from the actual state"
        )
