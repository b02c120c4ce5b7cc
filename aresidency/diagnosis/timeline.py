"""The trace as a timeline: a Chrome trace-event JSON file that Perfetto and chrome://tracing
open.

Three processes (groups of tracks):

* ``values``: one track per value (more when its intervals overlap: a second lease while a
  copy is in flight). Copies, moves and loads are duration events from their begin to their
  commit or abort (a load's temporary charge at its source location included), leases and
  holds from entry to exit; registrations, releases, invalidations, discards and consumer
  events are instants.
* ``location charges``: a counter per location, its ``used`` and ``reserved`` bytes after
  every transition that changed them (stacked, they are the charge the budget is checked
  against). With the snapshot taken with the trace, the counters are absolute even when the
  ring overwrote older transitions (they are computed back from the final charges);
  without it they start at zero.
* ``reservations``: named reservations, from reserve to unreserve, a track per location.

Only what the trace kept is shown (``trace_capacity``); an interval whose begin was
overwritten starts at the first kept transition, one still open ends at the last (their args
say so). Timestamps are microseconds from the first kept transition (``time_ns`` is the
manager's monotonic clock).
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.locations import Location
from ..core.sizes import format_nbytes
from ..core.snapshot import ResidencySnapshot
from ..core.trace import ResidencyTrace, Transition

__all__ = ["timeline_document", "write_timeline"]

#: What a timeline of a disabled trace lacks (logged, and printed by the command line).
DISABLED = (
    "the trace was disabled (trace_capacity=0), so the timeline holds only the charges at the "
    "end and no transitions; make the manager with trace_capacity > 0 to see them"
)
_log = logging.getLogger(__name__)

VALUES_PID = 1
CHARGES_PID = 2
RESERVATIONS_PID = 3

_TRANSFER_BEGIN = {"copy_begin", "move_begin", "load_begin", "rebuild_temp"}
_TRANSFER_END = {"copy_commit", "move_commit", "load_commit", "copy_abort", "rebuild_abort"}
_INSTANTS = {
    "register",
    "release",
    "invalidate",
    "discard",
    "event_recorded",
    "event_reaped",
    "budget",
    "peak_reset",
}


@dataclass
class _Interval:
    pid: int
    owner: Hashable
    start_ns: int
    end_ns: int
    name: str
    category: str
    args: dict[str, Any] = field(default_factory=dict)


class _Builder:
    """Pairs begins with ends over one pass of the trace and lays intervals out on tracks.

    State: ``intervals`` (closed ones), ``_open_*`` (begun, not yet ended: transfers by
    ``(handle, destination)``, leases and holds FIFO by ``(handle, location)``, reservations
    by ``(name, location)``), ``instants``. Invariant: an interval ends no earlier than it
    begins."""

    def __init__(self, transitions: tuple[Transition, ...]) -> None:
        self.transitions = transitions
        self.t0 = transitions[0].time_ns if transitions else 0
        self.t_end = transitions[-1].time_ns if transitions else 0
        self.intervals: list[_Interval] = []
        self.instants: list[tuple[Transition, str]] = []
        self._transfers: dict[tuple[Any, Location | None], _Interval] = {}
        self._uses: dict[tuple[str, Any, Location | None], deque[_Interval]] = defaultdict(deque)
        self._reservations: dict[tuple[str | None, Location | None], _Interval] = {}

    def run(self) -> None:
        for t in self.transitions:
            kind = t.kind
            if kind in _TRANSFER_BEGIN:
                self._begin_transfer(t)
            elif kind in _TRANSFER_END:
                self._end_transfer(t)
            elif kind in ("lease", "hold"):
                self._uses[(kind, t.handle, t.location)].append(
                    _Interval(
                        VALUES_PID,
                        t.handle,
                        t.time_ns,
                        t.time_ns,
                        f"{kind} @ {t.location}",
                        kind,
                        {"begin_seq": t.seq},
                    )
                )
            elif kind in ("unlease", "unhold"):
                self._end_use(t, kind[2:])
            elif kind == "reserve":
                self._reservations[(t.name, t.location)] = _Interval(
                    RESERVATIONS_PID,
                    t.location,
                    t.time_ns,
                    t.time_ns,
                    f"{t.name} {format_nbytes(t.nbytes)}",
                    "reservation",
                    {"bytes": t.nbytes, "begin_seq": t.seq},
                )
            elif kind == "unreserve":
                self._end_reservation(t)
            elif kind in _INSTANTS:
                self.instants.append((t, kind))
        for interval in self._transfers.values():
            self._close_open(interval)
        for queue in self._uses.values():
            for interval in queue:
                self._close_open(interval)
        for interval in self._reservations.values():
            self._close_open(interval)

    def _close_open(self, interval: _Interval) -> None:
        interval.end_ns = self.t_end
        interval.args["open_at_end"] = True
        self.intervals.append(interval)

    def _begin_transfer(self, t: Transition) -> None:
        key = (t.handle, t.destination)
        if key in self._transfers:  # a load's begin after its temporary charge: one interval
            self._transfers[key].args["bytes"] = t.nbytes
            return
        verb = t.kind.split("_", 1)[0]
        verb = "load" if verb == "rebuild" else verb
        source = "its source" if t.source is None else str(t.source)
        self._transfers[key] = _Interval(
            VALUES_PID,
            t.handle,
            t.time_ns,
            t.time_ns,
            f"{verb} {source} -> {t.destination}",
            "transfer",
            {"bytes": t.nbytes, "begin_seq": t.seq},
        )

    def _end_transfer(self, t: Transition) -> None:
        interval = self._transfers.pop((t.handle, t.destination), None)
        if interval is None:
            if t.kind == "rebuild_abort":
                return  # its copy_abort closed the interval already
            verb = t.kind.split("_", 1)[0]
            source = "its source" if t.source is None else str(t.source)
            interval = _Interval(
                VALUES_PID,
                t.handle,
                self.t0,
                self.t0,
                f"{verb} {source} -> {t.destination}",
                "transfer",
                {"begin_overwritten": True},
            )
        interval.end_ns = t.time_ns
        aborted = t.kind.endswith("abort")
        interval.args.update(outcome="aborted" if aborted else "committed", end_seq=t.seq)
        if aborted:
            interval.name += " (aborted)"
        self.intervals.append(interval)

    def _end_use(self, t: Transition, kind: str) -> None:
        queue = self._uses.get((kind, t.handle, t.location))
        if queue:
            interval = queue.popleft()
        else:
            interval = _Interval(
                VALUES_PID,
                t.handle,
                self.t0,
                self.t0,
                f"{kind} @ {t.location}",
                kind,
                {"begin_overwritten": True},
            )
        interval.end_ns = t.time_ns
        interval.args["end_seq"] = t.seq
        self.intervals.append(interval)

    def _end_reservation(self, t: Transition) -> None:
        interval = self._reservations.pop((t.name, t.location), None)
        if interval is None:
            interval = _Interval(
                RESERVATIONS_PID,
                t.location,
                self.t0,
                self.t0,
                f"{t.name} {format_nbytes(-t.nbytes)}",
                "reservation",
                {"bytes": -t.nbytes, "begin_overwritten": True},
            )
        interval.end_ns = t.time_ns
        interval.args["end_seq"] = t.seq
        self.intervals.append(interval)


def _lanes(intervals: list[_Interval]) -> list[tuple[_Interval, int]]:
    """Give each interval a lane so that intervals on one lane never overlap (greedy interval
    partitioning: the fewest lanes)."""
    ends: list[int] = []
    out: list[tuple[_Interval, int]] = []
    for interval in sorted(intervals, key=lambda i: (i.start_ns, i.end_ns)):
        for lane, end in enumerate(ends):
            if end <= interval.start_ns:
                ends[lane] = interval.end_ns
                out.append((interval, lane))
                break
        else:
            ends.append(interval.end_ns)
            out.append((interval, len(ends) - 1))
    return out


def _owner_key(owner: Any) -> tuple[int, str]:
    value_id = getattr(owner, "value_id", None)
    return (value_id if isinstance(value_id, int) else -1, str(owner))


def _owner_name(owner: Any) -> str:
    name = getattr(owner, "name", None)
    value_id = getattr(owner, "value_id", None)
    if value_id is not None:
        return f"{name or 'value'} #{value_id}"
    return str(owner)


def timeline_document(
    trace: ResidencyTrace, snapshot: ResidencySnapshot | None = None
) -> dict[str, Any]:
    """The Chrome trace-event document (``{"traceEvents": [...], ...}``) of ``trace``;
    ``snapshot`` (taken with it) makes the charge counters absolute."""
    transitions = trace.transitions
    builder = _Builder(transitions)
    builder.run()
    t0 = builder.t0

    def ts(time_ns: int) -> float:
        return round((time_ns - t0) / 1000.0, 3)

    events: list[dict[str, Any]] = []
    metadata: list[dict[str, Any]] = []
    for pid, name in (
        (VALUES_PID, "values"),
        (CHARGES_PID, "location charges"),
        (RESERVATIONS_PID, "reservations"),
    ):
        metadata.append(_meta(pid, 0, "process_name", {"name": name}))
        metadata.append(_meta(pid, 0, "process_sort_index", {"sort_index": pid}))

    # Tracks: (pid, owner, lane) -> tid, numbered in owner order.
    by_owner: dict[tuple[int, Any], list[_Interval]] = defaultdict(list)
    for interval in builder.intervals:
        by_owner[(interval.pid, interval.owner)].append(interval)
    for t, _ in builder.instants:
        if t.handle is not None:
            by_owner.setdefault((VALUES_PID, t.handle), [])
    tids: dict[tuple[int, Any, int], int] = {}
    next_tid = 1
    for pid, owner in sorted(by_owner, key=lambda k: (k[0], _owner_key(k[1]))):
        placed = _lanes(by_owner[(pid, owner)]) or []
        lanes = max((lane for _, lane in placed), default=0) + 1
        for lane in range(lanes):
            tid = tids[(pid, owner, lane)] = next_tid
            next_tid += 1
            suffix = f" [{lane + 1}]" if lane else ""
            metadata.append(_meta(pid, tid, "thread_name", {"name": _owner_name(owner) + suffix}))
            metadata.append(_meta(pid, tid, "thread_sort_index", {"sort_index": tid}))
        for interval, lane in placed:
            events.append(
                {
                    "name": interval.name,
                    "cat": interval.category,
                    "ph": "X",
                    "ts": ts(interval.start_ns),
                    "dur": round(max(0, interval.end_ns - interval.start_ns) / 1000.0, 3),
                    "pid": pid,
                    "tid": tids[(pid, owner, lane)],
                    "args": interval.args,
                }
            )
    metadata.append(_meta(CHARGES_PID, 0, "thread_name", {"name": "events"}))
    for t, kind in builder.instants:
        where = "" if t.location is None else f" @ {t.location}"
        on_value = t.handle is not None and (VALUES_PID, t.handle, 0) in tids
        events.append(
            {
                "name": f"{kind}{where}",
                "cat": "state",
                "ph": "i",
                "s": "t",
                "ts": ts(t.time_ns),
                "pid": VALUES_PID if on_value else CHARGES_PID,
                "tid": tids[(VALUES_PID, t.handle, 0)] if on_value else 0,
                "args": {"seq": t.seq, "state_version": t.state_version, "bytes": t.nbytes},
            }
        )
    events.extend(_counters(transitions, snapshot, ts))
    events.sort(key=lambda e: e["ts"])
    return {
        "traceEvents": metadata + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "aresidency",
            "manager_id": None if snapshot is None else snapshot.manager_id,
            "state_version": None if snapshot is None else snapshot.state_version,
            "trace_capacity": trace.capacity,
            "trace_overwritten": trace.overwritten,
            "transitions": len(transitions),
            "counters_absolute": snapshot is not None,
        },
    }


def _meta(pid: int, tid: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _counters(
    transitions: tuple[Transition, ...], snapshot: ResidencySnapshot | None, ts: Any
) -> list[dict[str, Any]]:
    """Used and reserved bytes per location after each transition that changed them."""
    used: dict[Location, int] = defaultdict(int)
    reserved: dict[Location, int] = defaultdict(int)
    if snapshot is not None:
        # Computed back from the final charges: right even when older entries were dropped.
        for location, record in snapshot.locations.items():
            used[location] = record.used_bytes
            reserved[location] = record.reserved_bytes
        for t in transitions:
            if t.location is not None:
                target = reserved if t.kind in ("reserve", "unreserve") else used
                target[t.location] -= t.nbytes
    out = []
    start = transitions[0].time_ns if transitions else 0
    for location in sorted(set(used) | set(reserved)):
        out.append(_counter(location, ts(start), used[location], reserved[location]))
    for t in transitions:
        if t.location is None or t.nbytes == 0:
            continue
        target = reserved if t.kind in ("reserve", "unreserve") else used
        target[t.location] += t.nbytes
        out.append(_counter(t.location, ts(t.time_ns), used[t.location], reserved[t.location]))
    return out


def _counter(location: Location, at: float, used: int, reserved: int) -> dict[str, Any]:
    return {
        "name": f"{location} bytes",
        "cat": "charge",
        "ph": "C",
        "ts": at,
        "pid": CHARGES_PID,
        "tid": 0,
        "args": {"used": used, "reserved": reserved},
    }


def write_timeline(
    path: str | os.PathLike[str], trace: ResidencyTrace, snapshot: ResidencySnapshot | None
) -> Path:
    """Write :func:`timeline_document` to ``path`` (the host waits for the write). A trace that
    was disabled gives a timeline of the charges now and nothing else: a warning says so."""
    target = Path(path)
    target.write_text(json.dumps(timeline_document(trace, snapshot)))
    if not trace.enabled:
        _log.warning("%s: %s", target, DISABLED)
    return target
