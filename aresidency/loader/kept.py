"""Batches the consumer still refers to after their release, found and reported.

Through the ring a batch's tensors are views of a device slot that a later batch is copied
into once the batch was released (at the next request, or the end of ``async with batch``).
A consumer that keeps one of those tensors past that point (``labels.append(batch["y"])``)
sees it change under it on CUDA (nothing is written at the release there; the simulated
backend poisons it). The loader cannot tell a kept tensor from the loop's own variables at
the release itself (``async for batch in loader`` still refers to the batch it releases while
it asks for the next one), but two requests later every variable of the loop body has been
bound again: a released batch whose tensors are still alive then was kept.

:class:`KeptAfterRelease` holds a weak reference to each released batch's tensors and looks
at them at the second request after the release: a batch still referenced is counted
(``LoaderStats.kept_after_release``) and the first one of a pass is reported with a
``RuntimeWarning`` that names the loader, the pass, the batch and what to do. It never changes
what the loader does: the slot is reused as documented.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["KeptAfterRelease"]


class KeptAfterRelease:
    """The check of one pass (loop thread only).

    State: ``_recent`` (batches released since the last request: index, weak references to
    their tensors), ``_older`` (those released before the request before), ``count`` (kept
    batches found), ``warned`` (this pass reported one).
    """

    __slots__ = ("_older", "_recent", "count", "warned")

    def __init__(self) -> None:
        self._recent: list[tuple[int, list[weakref.ref[Any]]]] = []
        self._older: list[tuple[int, list[weakref.ref[Any]]]] = []
        self.count = 0
        self.warned = False

    def released(self, index: int, tensors: Iterable[Any]) -> None:
        """Batch ``index`` was released; ``tensors`` are what the consumer was handed."""
        refs = [weakref.ref(t) for t in tensors]
        if refs:
            self._recent.append((index, refs))

    def requested(self, loader: str, number: int) -> int:
        """The consumer asks for a batch: the batches released before the request before
        this one that are still referenced are counted (and the first of the pass reported);
        returns how many."""
        kept = [index for index, refs in self._older if any(r() is not None for r in refs)]
        self._older, self._recent = self._recent, []
        if kept:
            self.count += len(kept)
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"DeviceLoader {loader!r}, pass {number}: batch {kept[0]} is still "
                    "referenced two requests after its release, and its device memory is "
                    "being reused for later batches, so the tensors kept will change under "
                    "you. .clone() what you keep past the step, or keep the batch with "
                    "`async for batch in loader.batches(): async with batch as data:` "
                    "(stats().kept_after_release counts these batches)",
                    RuntimeWarning,
                    stacklevel=5,  # the consumer's `async for`
                )
        return len(kept)
