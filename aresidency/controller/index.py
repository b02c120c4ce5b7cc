"""The candidate index: every evictable materialization, by location and eviction class.

A *candidate* is a RESIDENT, unprotected (``use_count == hold_count == pending_event_count ==
0``) materialization that has somewhere to go: another resident replica (it can be released), a
source (it can be dropped, if the graph allows), or a fallback tier without a copy of it (it can
be moved). Its *class* is what decides its eviction options, whatever its size or recency: the
other resident replicas' locations, the source location, and the tiers it may move to. Within a
class the cost per byte grows with the reuse weight, which grows with ``last_used_version``; so
each class keeps its candidates sorted by ``(last_used_version, value_id)``, which is also their
order by cost per byte, whatever the cost model. The search merges the classes of a location by
cost per byte without sorting anything (see ``search.py``).

Keeping it current: an index attached to a live state registers an observer, and each committed
transition marks its handle dirty (every mutation of a value is a transition that names it: rule
6); :meth:`CandidateIndex.refresh_steps` re-examines only the dirty handles. Building from scratch
walks every value once. Both are generators that yield between slices of work, so that a caller
on the event loop can interleave them with other tasks; the index content after either is a
function of the state alone.

Invariants: for every indexed handle, ``_where[handle]`` lists exactly its entries in the
buckets; each bucket's ``entries`` is sorted and its ``total_bytes`` is the sum of their charges;
``charge_counts`` of a location counts the charges of all its entries.
"""

from __future__ import annotations

import bisect
import collections
import operator
import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from ..core.locations import Location
from ..core.state import ResidencyState
from ..core.trace import Transition
from ..core.values import MaterializationState, ValueHandle
from .policy import FallbackGraph

__all__ = ["CandidateIndex", "EvictionClass", "Slicer"]

_RESIDENT = MaterializationState.RESIDENT

#: One candidate: ``(last_used_version, value_id, handle, charge_bytes)``; sorts by recency.
Entry = tuple[int, int, ValueHandle, int]


@dataclass(frozen=True, slots=True)
class EvictionClass:
    """What decides a candidate's eviction options at one location.

    ``replicas``: other RESIDENT materializations of the value (non-empty: it is released, the
    replicas stay); ``source``: its ``source_location`` if it has a source; ``moves``: the
    fallback tiers it may move to (only when it has no other resident replica)."""

    replicas: tuple[Location, ...]
    source: Location | None
    moves: tuple[Location, ...]
    droppable: bool

    @property
    def releasable(self) -> bool:
        """Whether it can be released without moving (a replica stays, or it is dropped)."""
        return bool(self.replicas) or self.droppable

    def sort_key(self) -> tuple[str, ...]:
        return (
            ",".join(str(r) for r in self.replicas),
            "" if self.source is None else str(self.source),
            ",".join(str(m) for m in self.moves),
            "d" if self.droppable else "",
        )


class Bucket:
    """The candidates of one class at one location, oldest first."""

    __slots__ = ("cls", "entries", "total_bytes")

    def __init__(self, cls: EvictionClass) -> None:
        self.cls = cls
        self.entries: list[Entry] = []
        self.total_bytes = 0


class LocationCandidates:
    """A location's buckets and the multiset of its candidates' charges."""

    __slots__ = ("buckets", "charge_counts")

    def __init__(self) -> None:
        self.buckets: dict[EvictionClass, Bucket] = {}
        self.charge_counts: dict[int, int] = {}

    def charge_range(self) -> tuple[int, int]:
        """``(smallest, largest)`` candidate charge (``(0, 0)`` when empty)."""
        if not self.charge_counts:
            return 0, 0
        return min(self.charge_counts), max(self.charge_counts)


_ClassKey = tuple[tuple[Location, ...], Location | None, tuple[Location, ...], bool]


def classify(
    value: Any, graph: FallbackGraph, classes: dict[_ClassKey, EvictionClass] | None = None
) -> list[tuple[Location, EvictionClass, Entry]]:
    """The candidate entries of one value (a ``core.state._Value``) under ``graph``.

    ``classes`` interns the classes (equal classes are one object, which keeps hashing cheap)."""
    mats = value.materializations
    if classes is None:
        classes = {}
    source = value.source_location if value.has_source else None
    droppable = source is not None and graph.allow_drop
    if len(mats) == 1:  # the common case, kept fast
        for loc, mat in mats.items():
            if (
                mat.state is not _RESIDENT
                or mat.use_count
                or mat.hold_count
                or mat.pending_event_count
            ):
                return []
            moves = graph.destinations(loc)
            if not moves and not droppable:
                return []
            key: _ClassKey = ((), source, moves, droppable)
            cls = classes.get(key)
            if cls is None:
                cls = classes[key] = EvictionClass(*key)
            return [
                (
                    loc,
                    cls,
                    (
                        value.last_used_version,
                        value.handle.value_id,
                        value.handle,
                        mat.charged_bytes,
                    ),
                )
            ]
    resident = [loc for loc, mat in mats.items() if mat.state is _RESIDENT]
    if not resident:
        return []
    handle = value.handle
    out: list[tuple[Location, EvictionClass, Entry]] = []
    for loc in resident:
        mat = mats[loc]
        if mat.use_count or mat.hold_count or mat.pending_event_count:
            continue
        if len(resident) > 1:
            key = (tuple(sorted(r for r in resident if r != loc)), source, (), droppable)
        else:
            moves = tuple(d for d in graph.destinations(loc) if d not in mats)
            if not moves and not droppable:
                continue
            key = ((), source, moves, droppable)
        cls = classes.get(key)
        if cls is None:
            cls = classes[key] = EvictionClass(*key)
        out.append(
            (loc, cls, (value.last_used_version, handle.value_id, handle, mat.charged_bytes))
        )
    return out


class _Observer:
    """A state observer that marks handles dirty without keeping the index alive."""

    __slots__ = ("index",)

    def __init__(self, index: CandidateIndex) -> None:
        self.index = weakref.ref(index)

    def __call__(self, transition: Transition) -> None:
        index = self.index()
        if index is not None and transition.handle is not None:
            index._dirty.add(transition.handle)


class CandidateIndex:
    """Evictable materializations of one state, by location and class (see the module doc).

    Use :meth:`for_state` for a one-off index (built at once), or :meth:`attach` to keep one
    current across decisions on a live state.
    """

    def __init__(self, graph: FallbackGraph) -> None:
        self.graph = graph
        self.state: ResidencyState | None = None
        self.locations: dict[Location, LocationCandidates] = {}
        self._where: dict[ValueHandle, list[tuple[Location, EvictionClass, Entry]]] = {}
        self._dirty: set[ValueHandle] = set()
        self._built = False
        self._observer: _Observer | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._classes: dict[_ClassKey, EvictionClass] = {}

    def __repr__(self) -> str:
        count = sum(len(v) for v in self._where.values())
        return (
            f"<CandidateIndex {count} candidates at {len(self.locations)} locations, "
            f"{len(self._dirty)} dirty, {'built' if self._built else 'not built'}>"
        )

    @classmethod
    def for_state(cls, state: ResidencyState, graph: FallbackGraph) -> CandidateIndex:
        index = cls(graph)
        index.state = state
        for _ in index.build_steps(None):
            pass
        return index

    # ----------------------------------------------------------- life cycle

    def attach(self, state: ResidencyState) -> None:
        """Follow ``state``'s transitions from now on (the next refresh rebuilds)."""
        self.detach()
        self.state = state
        self._observer = _Observer(self)
        self._unsubscribe = state.subscribe(self._observer)
        self._built = False

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._unsubscribe = None
        self._observer = None
        self._built = False

    @property
    def attached(self) -> bool:
        return self._observer is not None

    def invalidate(self) -> None:
        """Forget everything: the next refresh rebuilds from scratch."""
        self._built = False

    # ------------------------------------------------------------- updating

    def refresh_steps(self, deadline: Callable[[], bool] | None) -> Generator[None, None, None]:
        """Bring the index up to date with its state; yields when ``deadline()`` says the
        current slice is used up. Builds from scratch the first time."""
        if not self._built:
            yield from self.build_steps(deadline)
            return
        state = self.state
        assert state is not None
        count = 0
        while self._dirty:
            handle = self._dirty.pop()
            self._remove(handle)
            value = state.find_value(handle)
            if value is None:  # discarded: it left the state
                continue
            self._insert(handle, classify(value, self.graph, self._classes))
            count += 1
            if deadline is not None and count % 64 == 0 and deadline():
                yield

    def build_steps(self, deadline: Callable[[], bool] | None) -> Generator[None, None, None]:
        """Rebuild from every value of the state (yielding between slices).

        Candidates are classified in chunks; each chunk's entries are sorted as a run, and the
        runs are merged pairwise, so that no single step sorts more than two runs (a single
        sort of 100,000 entries would hold the loop for tens of milliseconds)."""
        state = self.state
        assert state is not None
        self.locations = {}
        self._where = {}
        self._dirty.clear()
        graph = self.graph
        classes = self._classes
        runs: dict[tuple[Location, EvictionClass], list[list[Entry]]] = {}
        current: dict[tuple[Location, EvictionClass], list[Entry]] = {}
        where = self._where
        values = list(state.values())
        for count, value in enumerate(values, 1):
            found = classify(value, graph, classes)
            if found:
                where[value.handle] = found
                for loc, cls, entry in found:
                    run = current.get((loc, cls))
                    if run is None:
                        run = current[(loc, cls)] = []
                        runs.setdefault((loc, cls), []).append(run)
                    run.append(entry)
            if deadline is not None:
                if count % 512 == 0:
                    for run in current.values():
                        run.sort()
                    current.clear()
                if count % 32 == 0 and deadline():
                    yield
        for run in current.values():
            run.sort()
        charge_of = operator.itemgetter(3)
        for key in sorted(runs, key=lambda k: (k[0], k[1].sort_key())):
            parts = runs[key]
            while len(parts) > 1:
                merged: list[list[Entry]] = []
                for k in range(0, len(parts), 2):
                    if k + 1 < len(parts):
                        pair = parts[k] + parts[k + 1]
                        pair.sort()  # two sorted runs: a linear merge
                        merged.append(pair)
                    else:
                        merged.append(parts[k])
                    if deadline is not None and deadline():
                        yield
                parts = merged
            bucket = self._bucket(*key)
            bucket.entries = parts[0]
            bucket.total_bytes = sum(map(charge_of, bucket.entries))
            counts = collections.Counter(self.locations[key[0]].charge_counts)
            counts.update(map(charge_of, bucket.entries))
            self.locations[key[0]].charge_counts = dict(counts)
            if deadline is not None and deadline():
                yield
        self._built = True
        # Values changed while this build yielded are dirty: fix them now.
        if self._dirty:
            yield from self.refresh_steps(deadline)

    def _bucket(self, loc: Location, cls: EvictionClass) -> Bucket:
        at = self.locations.get(loc)
        if at is None:
            at = self.locations[loc] = LocationCandidates()
        bucket = at.buckets.get(cls)
        if bucket is None:
            bucket = at.buckets[cls] = Bucket(cls)
        return bucket

    def _remove(self, handle: ValueHandle) -> None:
        old = self._where.pop(handle, None)
        if not old:
            return
        for loc, cls, entry in old:
            at = self.locations[loc]
            bucket = at.buckets[cls]
            entries = bucket.entries
            pos = bisect.bisect_left(entries, entry[:2])
            assert entries[pos] == entry, "candidate index out of step with its state"
            del entries[pos]
            bucket.total_bytes -= entry[3]
            if not entries:
                del at.buckets[cls]
            left = at.charge_counts[entry[3]] - 1
            if left:
                at.charge_counts[entry[3]] = left
            else:
                del at.charge_counts[entry[3]]
            if not at.buckets:
                del self.locations[loc]

    def _insert(
        self, handle: ValueHandle, found: list[tuple[Location, EvictionClass, Entry]]
    ) -> None:
        if not found:
            return
        self._where[handle] = found
        for loc, cls, entry in found:
            bucket = self._bucket(loc, cls)
            bisect.insort(bucket.entries, entry)
            bucket.total_bytes += entry[3]
            counts = self.locations[loc].charge_counts
            counts[entry[3]] = counts.get(entry[3], 0) + 1

    # -------------------------------------------------------------- reading

    def entries_of(self, handle: ValueHandle) -> list[tuple[Location, EvictionClass, Entry]]:
        return self._where.get(handle, [])

    def check(self) -> None:
        """Raise ``AssertionError`` unless the index equals one built from scratch (tests)."""
        assert self.state is not None
        fresh = CandidateIndex.for_state(self.state, self.graph)
        mine = {
            (loc, cls): list(b.entries)
            for loc, at in self.locations.items()
            for cls, b in at.buckets.items()
        }
        theirs = {
            (loc, cls): list(b.entries)
            for loc, at in fresh.locations.items()
            for cls, b in at.buckets.items()
        }
        assert mine == theirs, "candidate index differs from a fresh build"
        for loc, at in self.locations.items():
            assert at.charge_counts == fresh.locations[loc].charge_counts
            for bucket in at.buckets.values():
                assert bucket.total_bytes == sum(e[3] for e in bucket.entries)


class Slicer:
    """Says when the current slice of work is used up: ``slicer()`` is true once
    ``slice_seconds`` have passed since :meth:`restart` (the driver restarts it after every
    pause). A generator given a slicer yields when it is true."""

    __slots__ = ("slice_seconds", "started")

    def __init__(self, slice_seconds: float) -> None:
        self.slice_seconds = slice_seconds
        self.started = time.perf_counter()

    def __call__(self) -> bool:
        return time.perf_counter() - self.started >= self.slice_seconds

    def restart(self) -> None:
        self.started = time.perf_counter()
