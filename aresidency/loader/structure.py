"""Nested batch structures: take the tensors out of a batch, and put device tensors back in.

A batch is what a ``torch.utils.data.DataLoader`` yields: a tensor, or dicts, lists, tuples,
namedtuples and dataclass instances of tensors, nested to any depth, with non-tensor leaves
(strings, numbers, ``None``) among them. :func:`flatten` walks it once and returns its tensors in
a fixed order with a :class:`Structure` that rebuilds the same shape around new tensors
(:meth:`Structure.rebuild`), so the loader can hand out a batch of the same type holding device
tensors. Containers are rebuilt as the type they were: a ``dict`` subclass through its
constructor (an ``OrderedDict`` stays one; a ``defaultdict`` keeps its factory), a namedtuple
through its fields, another ``tuple`` or ``list`` subclass through its constructor given the
items (what ``torch.sort`` or ``torch.max`` return keeps ``.values`` and ``.indices``), a
dataclass as a shallow copy with its fields replaced (frozen ones too, ``init=False`` fields
kept). Other objects, tensors inside them included, are passed through
unchanged: the loader does not look inside them.

Pure: no device is touched and nothing waits.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Structure", "flatten"]

_Builder = Callable[[Sequence[Any]], Any]


class Structure:
    """The shape of one batch with its tensors taken out (see the module docstring).

    State: ``paths`` (a readable path per tensor, ``"['x']"`` or ``"[0].mask"``, for value names
    and errors), ``_build`` (rebuilds the batch from a sequence of tensors in ``paths`` order).
    Invariant: ``rebuild`` takes exactly ``len(paths)`` tensors.
    """

    __slots__ = ("_build", "paths")

    def __init__(self, build: _Builder, paths: list[str]) -> None:
        self._build = build
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def part_path(self, leaf_part: Sequence[int], part: int) -> str:
        """The path of the first tensor that is distinct tensor ``part`` of the batch
        (``leaf_part`` gives, for each tensor in ``paths`` order, the part it is)."""
        return self.paths[leaf_part.index(part)]

    def rebuild(self, tensors: Sequence[Any]) -> Any:
        """The batch again, with ``tensors`` (in ``paths`` order) in place of the originals."""
        if len(tensors) != len(self.paths):
            raise ValueError(
                f"this batch structure holds {len(self.paths)} tensor(s), got {len(tensors)}"
            )
        return self._build(tensors)

    def __repr__(self) -> str:
        shown = ", ".join(self.paths[:4]) + (", ..." if len(self.paths) > 4 else "")
        return f"<Structure {len(self.paths)} tensor(s): {shown}>"


def flatten(
    batch: Any, leaf: type | tuple[type, ...] = torch.Tensor
) -> tuple[list[Any], Structure]:
    """The leaves of ``batch`` (instances of ``leaf``: tensors by default) in a fixed order, and
    the :class:`Structure` that puts new leaves back. A tensor that appears twice is listed twice
    (the caller may notice it is the same object). Raises ``ValueError`` for a container that
    contains itself."""
    leaves: list[Any] = []
    paths: list[str] = []
    build = _walk(batch, "", leaf, leaves, paths, set())
    return leaves, Structure(build, paths)


def _constant(value: Any) -> _Builder:
    return lambda _tensors: value


def _walk(
    node: Any,
    path: str,
    leaf: type | tuple[type, ...],
    tensors: list[Any],
    paths: list[str],
    active: set[int],
) -> _Builder:
    if isinstance(node, leaf):
        position = len(tensors)
        tensors.append(node)
        paths.append(path or "<batch>")
        return lambda tensors_: tensors_[position]
    if not _is_container(node):
        return _constant(node)
    if id(node) in active:
        raise ValueError(f"the batch contains itself at {path or '<batch>'}: it cannot be copied")
    active.add(id(node))
    try:
        return _walk_container(node, path, leaf, tensors, paths, active)
    finally:
        active.discard(id(node))


def _is_container(node: Any) -> bool:
    if isinstance(node, (str, bytes, bytearray)):
        return False
    if isinstance(node, (Mapping, list, tuple)):
        return True
    return dataclasses.is_dataclass(node) and not isinstance(node, type)


def _walk_container(
    node: Any,
    path: str,
    leaf: type | tuple[type, ...],
    tensors: list[Any],
    paths: list[str],
    active: set[int],
) -> _Builder:
    start = len(tensors)
    if isinstance(node, Mapping):
        keys = list(node.keys())
        children = [_walk(node[k], f"{path}[{k!r}]", leaf, tensors, paths, active) for k in keys]
        if len(tensors) == start:
            return _constant(node)  # no tensor inside: hand the same object back
        return _mapping_builder(node, keys, children)
    if isinstance(node, (list, tuple)):
        children = [
            _walk(v, f"{path}[{i}]", leaf, tensors, paths, active) for i, v in enumerate(node)
        ]
        if len(tensors) == start:
            return _constant(node)
        kind = type(node)
        if isinstance(node, tuple) and hasattr(node, "_fields"):  # a namedtuple
            return lambda ts: kind(*(child(ts) for child in children))
        if kind is tuple or kind is list:
            return lambda ts: kind(child(ts) for child in children)
        try:
            # A subclass that rebuilds from an iterable of its items (tried with the items
            # themselves: a structseq such as torch.return_types.sort takes exactly as many
            # as it has fields, so an empty one would be refused).
            kind(list(node))
        except Exception:
            plain: type = tuple if isinstance(node, tuple) else list
            return lambda ts: plain(child(ts) for child in children)
        return lambda ts: kind(child(ts) for child in children)
    fields = [f for f in dataclasses.fields(node)]
    children = [
        _walk(getattr(node, f.name), f"{path}.{f.name}", leaf, tensors, paths, active)
        for f in fields
    ]
    if len(tensors) == start:
        return _constant(node)

    def build_dataclass(ts: Sequence[Any]) -> Any:
        # A shallow copy keeps fields with init=False and works for frozen dataclasses, where
        # dataclasses.replace would re-run __init__ and __post_init__ on device tensors.
        out = copy.copy(node)
        for f, child in zip(fields, children):
            object.__setattr__(out, f.name, child(ts))
        return out

    return build_dataclass


def _mapping_builder(
    node: Mapping[Any, Any], keys: list[Any], children: list[_Builder]
) -> _Builder:
    kind: Any = type(node)  # a Mapping subclass, called with what its constructor takes
    if isinstance(node, defaultdict):
        factory = node.default_factory

        def build_defaultdict(ts: Sequence[Any]) -> Any:
            out = kind(factory)
            for key, child in zip(keys, children):
                out[key] = child(ts)
            return out

        return build_defaultdict
    if kind is dict:
        return lambda ts: {key: child(ts) for key, child in zip(keys, children)}
    try:
        kind([])  # a Mapping type that builds from pairs (OrderedDict, most dict subclasses)
    except Exception:
        return lambda ts: {key: child(ts) for key, child in zip(keys, children)}
    return lambda ts: kind([(key, child(ts)) for key, child in zip(keys, children)])
