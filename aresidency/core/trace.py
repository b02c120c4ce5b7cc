"""The bounded trace of transitions: a ring buffer that says how much it overwrote."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from .locations import Location

__all__ = ["ExecutionReport", "ResidencyTrace", "TraceRing", "Transition"]


@dataclass(frozen=True, slots=True)
class Transition:
    """One committed state change: the state version it produced, its kind, and what it touched.

    ``handle`` is a ``ValueHandle`` or ``None``; ``name`` carries a reservation's name;
    ``nbytes`` is the number of bytes charged (positive) or freed (negative) by the transition.
    """

    seq: int
    state_version: int
    kind: str
    handle: Any
    location: Location | None
    nbytes: int
    time_ns: int
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "state_version": self.state_version,
            "kind": self.kind,
            "handle": None if self.handle is None else self.handle.to_dict(),
            "location": None if self.location is None else str(self.location),
            "nbytes": self.nbytes,
            "time_ns": self.time_ns,
            "name": self.name,
        }

    def __str__(self) -> str:
        what = self.handle if self.handle is not None else (self.name or "")
        where = f" @ {self.location}" if self.location is not None else ""
        return f"#{self.seq} v{self.state_version} {self.kind} {what}{where} {self.nbytes:+d} B"


@dataclass(frozen=True, slots=True)
class ResidencyTrace:
    """A tensor-free copy of the trace ring taken in one step.

    ``overwritten`` counts transitions the ring dropped because it was full; when ``enabled`` is
    false nothing was recorded and ``transitions`` is empty.
    """

    enabled: bool
    capacity: int
    overwritten: int
    transitions: tuple[Transition, ...]


class TraceRing:
    """Ring buffer of :class:`Transition` records; ``capacity == 0`` disables it."""

    __slots__ = ("_capacity", "_entries", "_overwritten")

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"trace_capacity must be an int >= 0, got {capacity!r}")
        self._capacity = capacity
        self._entries: deque[Transition] = deque(maxlen=capacity or None)
        self._overwritten = 0

    def append(self, transition: Transition) -> None:
        if self._capacity == 0:
            return
        if len(self._entries) == self._capacity:
            self._overwritten += 1
        self._entries.append(transition)

    def view(self) -> ResidencyTrace:
        return ResidencyTrace(
            enabled=self._capacity > 0,
            capacity=self._capacity,
            overwritten=self._overwritten,
            transitions=tuple(self._entries),
        )


@dataclass(frozen=True, slots=True)
class ExecutionReport:
    """Every transition a plan run committed, in order."""

    transitions: tuple[Transition, ...] = ()

    def __len__(self) -> int:
        return len(self.transitions)
