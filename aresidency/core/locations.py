"""Locations: where a tensor can live.

A :class:`Location` is one of ``pageable-host``, ``pinned-host`` or ``cuda:N``. It is parsed from
those strings, from a ``torch.device`` (``cpu`` is ``pageable-host``), or from another
``Location``; it is hashable, totally ordered (pageable-host < pinned-host < cuda:0 < cuda:1 …)
and prints as the string it was parsed from. This module is pure: it never touches a device.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

__all__ = ["PAGEABLE_HOST", "PINNED_HOST", "Location", "LocationLike", "LocationMap"]

_CUDA_RE: Final = re.compile(r"cuda:(0|[1-9][0-9]*)")
_KIND_ORDER: Final = {"pageable-host": 0, "pinned-host": 1, "cuda": 2}


def _hint(value: str) -> str:
    """What an unknown location string should have been: torch's own device names get a
    sentence of their own (a user of torch writes them first)."""
    expected = "expected 'pageable-host', 'pinned-host' or 'cuda:N' (N a device index)"
    name = value.strip().lower()
    if name == "cuda":
        return f"{expected}; 'cuda' has no index: write 'cuda:0' (or another index), not guessed"
    if name == "cpu":
        return f"{expected}; host memory is 'pageable-host' (torch's 'cpu') or 'pinned-host'"
    return expected


@dataclass(frozen=True, slots=True, init=False, eq=False)
class Location:
    """One place a materialization can live.

    ``kind`` is ``"pageable-host"``, ``"pinned-host"`` or ``"cuda"``; ``index`` is the CUDA device
    ordinal for ``cuda`` and ``None`` for host kinds. Build one with :meth:`parse`; the
    constructor reads one argument as :meth:`parse` does, so ``Location('cuda:0')``, as a
    location prints its repr, is that location.

    Each location exists once: every way of making one (the constructor, :meth:`parse`,
    unpickling, ``copy``) returns the same object for the same place, so equality is identity
    and the hash is the object's (both computed in C: locations key every table of the
    runtime, and a method written in Python cost a call on each lookup).
    """

    kind: str
    index: int | None

    def __new__(cls, kind: Any, index: int | None = None) -> Location:
        if type(kind) is str and (index is None or type(index) is int):
            known = _INTERNED.get((kind, index))
            if known is not None:
                return known
        if index is None and not (isinstance(kind, str) and kind in _KIND_ORDER):
            # One argument, as the repr writes it ('cuda:0') or a torch.device: parsed.
            return cls.parse(kind)
        hash((kind, index))  # an unhashable argument is a TypeError, as it always was
        if kind not in _KIND_ORDER:
            raise ValueError(
                f"unknown location kind {kind!r}: expected 'pageable-host', 'pinned-host' or 'cuda'"
            )
        if kind == "cuda":
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                raise ValueError(f"a cuda location needs a device index >= 0, got {index!r}")
        elif index is not None:
            raise ValueError(f"a {kind} location takes no index, got {index!r}")
        made = object.__new__(cls)
        object.__setattr__(made, "kind", kind)
        object.__setattr__(made, "index", int(index) if index is not None else None)
        # The first one made is the location (two threads making it at once get the same).
        return _INTERNED.setdefault((made.kind, made.index), made)

    def __init__(self, kind: Any, index: int | None = None) -> None:
        """Nothing to do: :meth:`__new__` returned the location, complete."""

    @classmethod
    def parse(cls, value: LocationLike) -> Location:
        """Parse ``value`` (a string, a ``torch.device`` or a ``Location``).

        Raises ``ValueError`` naming the value for anything else. ``torch.device("cuda")`` without
        an index is refused rather than guessed.
        """
        if type(value) is str:  # the common case first: a string parsed before
            known = _PARSED.get(value)
            if known is not None:
                return known
        if isinstance(value, Location):
            return value
        if isinstance(value, str):
            known = _PARSED.get(value)
            if known is not None:
                return known
            if value in ("pageable-host", "pinned-host"):
                return _PARSED.setdefault(value, cls(value))
            match = _CUDA_RE.fullmatch(value)
            if match:
                parsed = cls("cuda", int(match.group(1)))
                if len(_PARSED) < 1024:  # a few strings name every location a program uses
                    _PARSED[value] = parsed
                return parsed
            raise ValueError(f"unknown location {value!r}: {_hint(value)}")
        # torch.device, duck-typed so that this module needs no torch import.
        device_type = getattr(value, "type", None)
        if isinstance(device_type, str) and hasattr(value, "index"):
            index = value.index
            if device_type == "cpu":
                return cls("pageable-host")
            if device_type == "cuda":
                if index is None:
                    raise ValueError(
                        f"torch device {value!r} has no index: write 'cuda:N' so the location "
                        "is exact"
                    )
                return cls("cuda", int(index))
            raise ValueError(f"unsupported torch device type {device_type!r} in {value!r}")
        raise ValueError(
            f"cannot parse a location from {value!r} (type {type(value).__name__}): expected a "
            "string such as 'cuda:0', a torch.device or a Location"
        )

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def is_host(self) -> bool:
        return self.kind != "cuda"

    @property
    def is_pinned(self) -> bool:
        return self.kind == "pinned-host"

    @property
    def device_index(self) -> int:
        """The CUDA ordinal; ``ValueError`` for a host location."""
        if self.index is None:
            raise ValueError(f"{self} is not a cuda location")
        return self.index

    def _key(self) -> tuple[int, int]:
        return (_KIND_ORDER[self.kind], -1 if self.index is None else self.index)

    def __lt__(self, other: Any) -> bool:
        if not isinstance(other, Location):
            return NotImplemented
        return self._key() < other._key()

    def __le__(self, other: Any) -> bool:
        if not isinstance(other, Location):
            return NotImplemented
        return self._key() <= other._key()

    def __gt__(self, other: Any) -> bool:
        if not isinstance(other, Location):
            return NotImplemented
        return self._key() > other._key()

    def __ge__(self, other: Any) -> bool:
        if not isinstance(other, Location):
            return NotImplemented
        return self._key() >= other._key()

    def __str__(self) -> str:
        return self.kind if self.index is None else f"cuda:{self.index}"

    def __repr__(self) -> str:
        return f"Location({str(self)!r})"

    def __format__(self, spec: str) -> str:
        # As its string: f"{location:<14}" pads it (object's own refuses every spec).
        return format(str(self), spec)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Location, (self.kind, self.index))


_PARSED: dict[str, Location] = {}  # string -> its Location (immutable: shared)
# (kind, index) -> the one Location of that place (see Location.__new__). Never trimmed: a
# program names a few places, and a location must stay the one object it was.
_INTERNED: dict[tuple[str, int | None], Location] = {}

LocationLike = Location | str | Any  # Any: a torch.device, checked at parse time

PAGEABLE_HOST: Final = Location("pageable-host")
PINNED_HOST: Final = Location("pinned-host")

_V = TypeVar("_V")


class LocationMap(Mapping[Location, _V]):
    """A read-only mapping keyed by :class:`Location` that is also indexed by what
    :meth:`Location.parse` reads: ``peaks["cuda:0"]`` is ``peaks[Location("cuda:0")]`` (a plain
    dict keyed by locations answered ``KeyError: 'cuda:0'``). Iterates and prints as the
    dict of locations it holds; equal to any mapping with the same items; hashable (when its
    values are)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[Location, _V] | None = None) -> None:
        self._data: dict[Location, _V] = dict(data) if data is not None else {}

    def __getitem__(self, key: LocationLike) -> _V:
        if not isinstance(key, Location):
            try:
                key = Location.parse(key)
            except ValueError:
                raise KeyError(key) from None
        return self._data[key]

    def __iter__(self) -> Iterator[Location]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LocationMap, (self._data,))

    # Read-only, so hashable (``Mapping`` is not): the frozen records that hold one (a plan's
    # explanation, a decision) hash as frozen records do.
    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))
