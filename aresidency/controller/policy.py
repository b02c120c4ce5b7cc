"""Where victims may go (:class:`FallbackGraph`) and what an eviction costs (:class:`CostModel`).

Both are frozen, tensor-free and pure; the search reads them and nothing else about policy.

The fallback graph
------------------
For each location, the ordered tiers a victim evicted from it may move to. The default is the
usual hierarchy ``cuda:N -> pinned-host -> pageable-host``: a victim on any GPU may move to
pinned host memory or, skipping it, to pageable host memory; a victim in pinned memory may move
to pageable memory. A victim that has a source may also be *dropped* (``allow_drop``) and rebuilt
from its source when it is needed again; a victim with another resident replica may always be
released. The graph must be acyclic (tiers have an order), which keeps the search exact.

Moves into a tier need room there *when they begin*: a plan's reclaim phase begins all its moves
together and a move frees its source only when its copy completes (see ``core.plans``), so the
room at the next tier comes from its free bytes and from releases or drops there, never from
moves out of it in the same plan. The search accounts for exactly that.

The cost model
--------------
An eviction is scored in estimated seconds of transfer::

    cost = charge * (now_per_byte + reuse_weight * restore_per_byte)

``now_per_byte`` is what the eviction transfers now (``1 / bandwidth(location, destination)``
for a move, 0 for a release or drop); ``restore_per_byte`` what bringing it back would take (the
move back, a copy from the fastest remaining replica, or a load from the source plus the copy
from ``source_location``); ``reuse_weight = 2 ** -(age / recency_half_life)`` with ``age`` the
number of state versions since the value was last touched, so recently used values are expensive
to evict and are kept. The weight depends only on the state, so the search stays deterministic.

Default bandwidths are the measured anchors of an H200 on PCIe (docs/performance.md):
55 GB/s between pinned memory and a GPU, 30 GB/s between pageable memory and a GPU (through the
runtime's pinned staging pool), 50 GB/s between GPUs (a conservative PCIe-class peer copy; NVLink
reaches 380), 10 GB/s between the two host kinds, and 2 GB/s for a source load. Replace any of
them with configured or measured figures (:meth:`CostModel.with_bandwidth`,
:meth:`CostModel.with_measurement`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.locations import PAGEABLE_HOST, PINNED_HOST, Location, LocationLike

__all__ = ["CUDA_ANY", "CostModel", "FallbackGraph"]

#: Key of a :class:`FallbackGraph` entry that applies to every ``cuda:N`` without its own entry.
CUDA_ANY = "cuda:*"


def _parse_key(key: Any) -> str:
    if key == CUDA_ANY:
        return CUDA_ANY
    return str(Location.parse(key))


@dataclass(frozen=True, slots=True)
class FallbackGraph:
    """``edges`` maps a location (or ``"cuda:*"``, every GPU without its own entry) to the
    locations a victim evicted from it may move to, in order of preference.

    ``allow_drop``: a victim that has a source may be dropped and rebuilt later. Construction
    refuses self-loops, repeated destinations, a ``"cuda:*"`` entry that names a GPU, and cycles.
    """

    edges: tuple[tuple[str, tuple[Location, ...]], ...]
    allow_drop: bool = True
    _lookup: dict[str, tuple[Location, ...]] = field(
        default_factory=dict, compare=False, repr=False, hash=False
    )
    _cache: dict[Location, tuple[Location, ...]] = field(
        default_factory=dict, compare=False, repr=False, hash=False
    )

    def __init__(
        self,
        edges: Mapping[Any, Iterable[LocationLike]] | None = None,
        *,
        allow_drop: bool = True,
    ) -> None:
        if edges is None:
            edges = {CUDA_ANY: (PINNED_HOST, PAGEABLE_HOST), PINNED_HOST: (PAGEABLE_HOST,)}
        lookup: dict[str, tuple[Location, ...]] = {}
        for key, destinations in edges.items():
            name = _parse_key(key)
            if name in lookup:
                raise ValueError(f"fallback graph lists {name} twice")
            if isinstance(destinations, (str, Location)):
                destinations = (destinations,)
            parsed = tuple(Location.parse(d) for d in destinations)
            if len(set(parsed)) != len(parsed):
                raise ValueError(f"fallback graph entry {name} repeats a destination: {parsed}")
            if name == CUDA_ANY and any(d.is_cuda for d in parsed):
                raise ValueError(
                    f"the {CUDA_ANY!r} entry may only name host tiers (a GPU would be its own "
                    "fallback); give that GPU's edges under its own cuda:N key"
                )
            if any(str(d) == name for d in parsed):
                raise ValueError(f"fallback graph entry {name} names itself as a destination")
            lookup[name] = parsed
        object.__setattr__(self, "edges", tuple(sorted(lookup.items())))
        object.__setattr__(self, "allow_drop", bool(allow_drop))
        object.__setattr__(self, "_lookup", lookup)
        object.__setattr__(self, "_cache", {})
        self._check_acyclic()

    @classmethod
    def default(cls, *, allow_drop: bool = True) -> FallbackGraph:
        """``cuda:N -> pinned-host -> pageable-host`` (a GPU victim may skip pinned memory)."""
        return cls(None, allow_drop=allow_drop)

    def destinations(self, location: Location) -> tuple[Location, ...]:
        """The tiers a victim at ``location`` may move to, most preferred first."""
        cached = self._cache.get(location)
        if cached is not None:
            return cached
        found = self._lookup.get(str(location))
        if found is None:
            found = self._lookup.get(CUDA_ANY, ()) if location.is_cuda else ()
        self._cache[location] = found
        return found

    def _check_acyclic(self) -> None:
        nodes: set[Location] = set()
        for name, destinations in self._lookup.items():
            if name != CUDA_ANY:
                nodes.add(Location.parse(name))
            nodes.update(destinations)
        done: set[Location] = set()
        for start in sorted(nodes):
            path: list[Location] = []
            on_path: set[Location] = set()
            stack: list[tuple[Location, int]] = [(start, 0)]
            while stack:
                node, index = stack.pop()
                if index == 0:
                    if node in done:
                        continue
                    path.append(node)
                    on_path.add(node)
                successors = self.destinations(node)
                if index < len(successors):
                    stack.append((node, index + 1))
                    nxt = successors[index]
                    if nxt in on_path:
                        cycle = " -> ".join(str(n) for n in (*path[path.index(nxt) :], nxt))
                        raise ValueError(
                            f"fallback graph has a cycle ({cycle}); tiers must be ordered"
                        )
                    if nxt not in done:
                        stack.append((nxt, 0))
                else:
                    path.pop()
                    on_path.discard(node)
                    done.add(node)

    def __str__(self) -> str:
        parts = [f"{k} -> {' | '.join(str(d) for d in v)}" for k, v in self.edges]
        drop = "drop allowed" if self.allow_drop else "no drops"
        return f"FallbackGraph({'; '.join(parts)}; {drop})"


_GB = 1e9

_DEFAULT_BANDWIDTHS: tuple[tuple[str, str, float], ...] = (
    ("pinned-host", "cuda", 55 * _GB),
    ("cuda", "pinned-host", 55 * _GB),
    ("pageable-host", "cuda", 30 * _GB),
    ("cuda", "pageable-host", 30 * _GB),
    ("cuda", "cuda", 50 * _GB),
    ("pinned-host", "pageable-host", 10 * _GB),
    ("pageable-host", "pinned-host", 10 * _GB),
)


def _bandwidth_key(value: Any) -> str:
    """A location (``'cuda:0'``) or a kind (``'cuda'``, ``'pinned-host'``, ``'pageable-host'``)."""
    if value == "cuda":
        return "cuda"
    return str(Location.parse(value))


def _check_rate(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Estimated transfer seconds per eviction (see the module docstring).

    ``bandwidths``: ``(source, destination, bytes_per_second)`` entries; a source or destination
    is a location (``'cuda:1'``) or a kind (``'cuda'``, ``'pinned-host'``, ``'pageable-host'``).
    An exact location pair wins over a kind pair; a pair with no entry uses
    ``default_bandwidth``. ``source_bandwidth`` is the rate of a load from a value's source.
    ``recency_half_life`` is in state versions (every committed transition is one).
    """

    bandwidths: tuple[tuple[str, str, float], ...] = _DEFAULT_BANDWIDTHS
    source_bandwidth: float = 2 * _GB
    default_bandwidth: float = 10 * _GB
    recency_half_life: float = 1024.0
    _rates: dict[tuple[str, str], float] = field(
        default_factory=dict, compare=False, repr=False, hash=False
    )

    def __post_init__(self) -> None:
        rates: dict[tuple[str, str], float] = {}
        normalized: list[tuple[str, str, float]] = []
        for entry in self.bandwidths:
            src, dst, rate = entry
            key = (_bandwidth_key(src), _bandwidth_key(dst))
            rates[key] = _check_rate(rate, f"bandwidth {key[0]} -> {key[1]}")
        normalized = sorted((s, d, r) for (s, d), r in rates.items())
        object.__setattr__(self, "bandwidths", tuple(normalized))
        _check_rate(self.source_bandwidth, "source_bandwidth")
        _check_rate(self.default_bandwidth, "default_bandwidth")
        _check_rate(self.recency_half_life, "recency_half_life")
        object.__setattr__(self, "_rates", rates)

    # ------------------------------------------------------------- configuring

    def with_bandwidth(
        self, source: LocationLike, destination: LocationLike, bytes_per_second: float
    ) -> CostModel:
        """A copy with the rate from ``source`` to ``destination`` (locations or kinds) set."""
        key = (_bandwidth_key(source), _bandwidth_key(destination))
        rates = dict(self._rates)
        rates[key] = _check_rate(bytes_per_second, f"bandwidth {key[0]} -> {key[1]}")
        return CostModel(
            tuple((s, d, r) for (s, d), r in rates.items()),
            self.source_bandwidth,
            self.default_bandwidth,
            self.recency_half_life,
        )

    def with_measurement(
        self, source: LocationLike, destination: LocationLike, nbytes: int, seconds: float
    ) -> CostModel:
        """A copy using a measured transfer (``nbytes`` in ``seconds``) as that pair's rate."""
        if nbytes <= 0:
            raise ValueError(f"a measurement needs nbytes > 0, got {nbytes}")
        return self.with_bandwidth(source, destination, nbytes / _check_rate(seconds, "seconds"))

    # ----------------------------------------------------------------- reading

    def bandwidth(self, source: Location, destination: Location) -> float:
        """Bytes per second from ``source`` to ``destination`` (``inf`` when they are equal)."""
        if source == destination:
            return math.inf
        rates = self._rates
        for key in (
            (str(source), str(destination)),
            (str(source), destination.kind),
            (source.kind, str(destination)),
            (source.kind, destination.kind),
        ):
            rate = rates.get(key)
            if rate is not None:
                return rate
        return self.default_bandwidth

    def seconds_per_byte(self, source: Location, destination: Location) -> float:
        return 1.0 / self.bandwidth(source, destination)

    def reuse_weight(self, last_used_version: int, state_version: int) -> float:
        """``2 ** -(age / recency_half_life)``: 1 for a value touched by the latest transition."""
        age = max(0, state_version - last_used_version)
        return float(2.0 ** (-age / self.recency_half_life))

    # Per-byte coefficients of the three kinds of eviction (the search caches these per class).

    def move_coefficients(self, location: Location, destination: Location) -> tuple[float, float]:
        """``(now, restore)`` seconds per byte of moving a victim to ``destination``."""
        return self.seconds_per_byte(location, destination), self.seconds_per_byte(
            destination, location
        )

    def release_restore(
        self,
        location: Location,
        replicas: Iterable[Location] = (),
        source_location: Location | None = None,
    ) -> float:
        """Seconds per byte to bring back a released materialization at ``location``: from the
        fastest remaining replica, or by loading the source into ``source_location`` and copying
        it over; ``inf`` when neither exists."""
        best = math.inf
        for replica in replicas:
            best = min(best, self.seconds_per_byte(replica, location))
        if source_location is not None:
            rebuild = 1.0 / self.source_bandwidth
            if source_location != location:
                rebuild += self.seconds_per_byte(source_location, location)
            best = min(best, rebuild)
        return best

    @staticmethod
    def option_seconds(charge_bytes: int, now: float, restore: float, weight: float) -> float:
        """The cost formula (the only place it is written, so search and checks agree)."""
        return charge_bytes * (now + weight * restore)
