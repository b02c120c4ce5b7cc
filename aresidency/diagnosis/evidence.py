"""The evidence a diagnosis reads: a manager's state at one moment, in memory or in a dump file.

:func:`collect` takes it from a manager in one synchronous step (the snapshot, the trace, the
owners of active leases and holds, and, for an error that carries a plan, ``explain`` of that
plan against the current state); :func:`write_dump` writes it with an error's ``to_dict`` as
JSON and :func:`read_dump` reads it back. ``diagnose(error, manager)`` and ``python -m aresidency
diagnose PATH`` build their report from the same :class:`Evidence`, so both print the same.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ResidencyError, exception_to_dict, scope_exit_error_of, to_jsonable
from ..core.locations import Location
from ..core.snapshot import ResidencySnapshot, take_snapshot
from ..core.trace import ResidencyTrace, Transition
from ..core.values import ValueHandle

__all__ = [
    "DUMP_FORMAT",
    "DUMP_VERSION",
    "Evidence",
    "Owner",
    "RoomWaitRecord",
    "collect",
    "read_dump",
    "trace_from_dict",
    "transition_from_dict",
    "write_dump",
]

DUMP_FORMAT = "aresidency.dump"
DUMP_VERSION = 1


@dataclass(frozen=True, slots=True)
class Owner:
    """One active lease or hold: the task that entered it (``kind``: ``"read lease"``,
    ``"write lease"`` or ``"hold"``)."""

    handle: ValueHandle
    location: Location
    kind: str
    task: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "handle": self.handle.to_dict(),
            "location": str(self.location),
            "kind": self.kind,
            "task": self.task,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Owner:
        return cls(
            ValueHandle.from_dict(data["handle"]),
            Location.parse(data["location"]),
            str(data["kind"]),
            str(data["task"]),
        )


@dataclass(frozen=True, slots=True)
class RoomWaitRecord:
    """One registered wait for room (``manager.room_waits()``): the waiting ``task``, the
    ``location``, the bytes it needs there and ``what`` it waits for."""

    task: str
    location: Location
    nbytes: int
    what: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "location": str(self.location),
            "nbytes": self.nbytes,
            "what": self.what,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoomWaitRecord:
        return cls(
            str(data["task"]),
            Location.parse(data["location"]),
            int(data["nbytes"]),
            str(data["what"]),
        )


@dataclass(frozen=True, slots=True)
class Evidence:
    """What one manager showed at one moment (all tensor-free).

    ``snapshot`` and ``trace`` were taken in the same synchronous step; ``owners`` lists the
    active leases and holds with their tasks; ``explanation`` is ``explain`` of the error's
    plan against that state, as a JSON-able dict (``None`` when the error had no plan);
    ``captured_unix_s`` is the wall-clock time it was taken; ``room_waits``: the tenants'
    waits for room registered then (who waits, for what)."""

    snapshot: ResidencySnapshot
    trace: ResidencyTrace
    owners: tuple[Owner, ...] = ()
    explanation: Mapping[str, Any] | None = None
    captured_unix_s: float = 0.0
    room_waits: tuple[RoomWaitRecord, ...] = ()

    @classmethod
    def capture(
        cls,
        snapshot: ResidencySnapshot,
        trace: ResidencyTrace,
        owners: Iterable[tuple[ValueHandle, Location, str, str]] = (),
        *,
        explanation: Any = None,
        room_waits: Iterable[tuple[str, Location, int, str]] = (),
    ) -> Evidence:
        """Evidence from live objects (``owners`` as ``manager.owners()`` gives them,
        ``room_waits`` as ``manager.room_waits()``)."""
        return cls(
            snapshot,
            trace,
            tuple(Owner(*entry) for entry in owners),
            None if explanation is None else to_jsonable(explanation),
            time.time(),
            tuple(RoomWaitRecord(*entry) for entry in room_waits),
        )

    def owners_of(self, handle: ValueHandle, location: Location) -> tuple[Owner, ...]:
        return tuple(o for o in self.owners if o.handle == handle and o.location == location)

    def to_dict(self) -> dict[str, Any]:
        return {
            "manager_id": self.snapshot.manager_id,
            "state_version": self.snapshot.state_version,
            "captured_unix_s": self.captured_unix_s,
            "snapshot": self.snapshot.to_dict(),
            "trace": self.trace.to_dict(),
            "owners": [owner.to_dict() for owner in self.owners],
            "explanation": self.explanation,
            "room_waits": [wait.to_dict() for wait in self.room_waits],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Evidence:
        """The evidence ``to_dict`` wrote; ``ValueError`` naming what is missing or malformed."""
        try:
            snapshot = ResidencySnapshot.from_dict(data["snapshot"])
            trace = trace_from_dict(data["trace"])
            owners = tuple(Owner.from_dict(o) for o in data.get("owners", ()))
            waits = tuple(RoomWaitRecord.from_dict(w) for w in data.get("room_waits", ()))
        except KeyError as missing:
            raise ValueError(
                f"not an aresidency dump: the field {missing} is missing (write dumps with "
                "manager.dump)"
            ) from None
        except (TypeError, AttributeError) as error:
            raise ValueError(f"not an aresidency dump: {error}") from None
        explanation = data.get("explanation")
        return cls(
            snapshot,
            trace,
            owners,
            explanation if isinstance(explanation, Mapping) else None,
            float(data.get("captured_unix_s", 0.0)),
            waits,
        )


def transition_from_dict(data: Mapping[str, Any]) -> Transition:
    """The transition ``Transition.to_dict`` described."""

    def location(key: str) -> Location | None:
        value = data.get(key)
        return None if value is None else Location.parse(value)

    handle = data.get("handle")
    return Transition(
        int(data["seq"]),
        int(data["state_version"]),
        str(data["kind"]),
        None if handle is None else ValueHandle.from_dict(handle),
        location("location"),
        int(data["nbytes"]),
        int(data["time_ns"]),
        data.get("name"),
        location("source"),
        location("destination"),
    )


def trace_from_dict(data: Mapping[str, Any]) -> ResidencyTrace:
    """The trace ``ResidencyTrace.to_dict`` described."""
    return ResidencyTrace(
        bool(data["enabled"]),
        int(data["capacity"]),
        int(data["overwritten"]),
        tuple(transition_from_dict(t) for t in data["transitions"]),
    )


def _chained(error: BaseException) -> list[BaseException]:
    """``error`` and what it carries, outermost first, as the report's chain follows them: its
    causes, an exception group's member that is, or was caused by, an aresidency error, and a
    scope's exit failure recorded on its body's exception when nothing else is ours."""
    out: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(out) < 16:
        out.append(current)
        following = current.__cause__
        if following is None and isinstance(current, BaseExceptionGroup):
            members = current.exceptions
            following = next(
                (m for m in members if any(isinstance(e, ResidencyError) for e in _chained(m))),
                members[0] if members else None,
            )
        current = following
    exit_error = scope_exit_error_of(error)
    if exit_error is not None and not any(isinstance(e, ResidencyError) for e in out):
        out.extend(_chained(exit_error)[: 16 - len(out)])  # as the report's chain does
    return out


def _carried_plan(error: BaseException | None) -> Any:
    """The plan of the first error in ``error``'s chain that carries one (a scope's entry
    raised it): a cause, or a task group's member, as well as the error itself."""
    if error is None:
        return None
    plans = (getattr(e, "plan", None) for e in _chained(error))
    return next((plan for plan in plans if plan is not None), None)


def collect(manager: Any, error: BaseException | None = None) -> Evidence:
    """Take the evidence from ``manager`` in one synchronous step (loop thread while it runs;
    after it closed its state no longer changes, and there are no leases). For an error that
    carries a plan (raised at a scope's entry), ``explain`` of it against the current state
    is included. The host waits for nothing."""
    running = bool(manager.running)
    if running:
        manager.check_thread()
    state = manager.state
    explanation = None
    plan = _carried_plan(error)
    if plan is not None and running:
        try:
            explanation = manager.explain(plan)
        except (TypeError, ValueError, RuntimeError):
            explanation = None  # a plan naming what this manager lacks: nothing to add
        except ResidencyError as failure:  # the plan no longer applies to this state
            explanation = {"feasible": False, "reason": str(failure)}
    return Evidence.capture(
        take_snapshot(state),
        state.trace_ring.view(),
        manager.owners() if running else (),
        explanation=explanation,
        room_waits=manager.room_waits() if running else (),
    )


def dump_dict(evidence: Evidence, error: BaseException | None) -> dict[str, Any]:
    """The JSON document :func:`write_dump` writes."""
    return {
        "format": DUMP_FORMAT,
        "version": DUMP_VERSION,
        **evidence.to_dict(),
        "error": None if error is None else exception_to_dict(error),
    }


def write_dump(
    path: str | os.PathLike[str], evidence: Evidence, error: BaseException | None
) -> Path:
    """Write ``evidence`` and ``error`` to ``path`` as JSON (the host waits for the write)."""
    target = Path(path)
    target.write_text(json.dumps(dump_dict(evidence, error), indent=1))
    return target


def read_dump(path: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, Evidence]:
    """The error dict (``None`` if none was dumped) and the evidence of a dump file;
    ``ValueError`` for a file that is not one (naming what is wrong)."""
    source = Path(path)
    try:
        data = json.loads(source.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{source} is not JSON ({error}); write dumps with manager.dump") from None
    if not isinstance(data, dict) or data.get("format") != DUMP_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"{source} is not an aresidency dump (format {found!r}, expected {DUMP_FORMAT!r}); "
            "write dumps with manager.dump"
        )
    if data.get("version") != DUMP_VERSION:
        raise ValueError(
            f"{source} is a version {data.get('version')!r} dump; this aresidency reads version "
            f"{DUMP_VERSION}"
        )
    dumped = data.get("error")
    if dumped is not None and not isinstance(dumped, dict):
        raise ValueError(
            f"{source}: its 'error' is a {type(dumped).__name__}, not an error record (null "
            "when nothing failed); write dumps with manager.dump"
        )
    try:
        evidence = Evidence.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(
            f"{source} is not a well-formed dump ({type(error).__name__}: {error}); write "
            "dumps with manager.dump"
        ) from None
    return dumped, evidence
