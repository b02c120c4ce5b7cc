"""What a loader measured: how fast the source produced batches, how fast they were copied, and
how long the consumer waited for them, so that a user sees which side is slow.

:class:`BusyClock` turns overlapping intervals of work (batches being produced by several threads,
copies in flight) into *busy time*: the length of their union, so that a rate computed from it is
the rate of that side alone. :class:`LoaderStats` is the immutable report a loader returns.
Timestamps are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

from ..core.sizes import format_nbytes

__all__ = ["BusyClock", "LoaderCounters", "LoaderStats"]


class BusyClock:
    """The total length of the union of the intervals added so far (any thread).

    Intervals arrive roughly in order (batches are produced and copied in order), so the clock
    keeps one open stretch and closes it when a new interval starts after its end; an interval
    that arrives late and overlaps nothing is added whole, which may over-count by the overlap
    with an already-closed stretch (never under-count the busy time).

    State (under ``_lock``): ``_start``/``_end`` (the open stretch, ``None`` before the first
    interval), ``_closed`` (seconds of the stretches already closed).
    """

    __slots__ = ("_closed", "_end", "_lock", "_start")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start: float | None = None
        self._end = 0.0
        self._closed = 0.0

    def add(self, start: float, end: float) -> None:
        if end < start:
            start, end = end, start
        with self._lock:
            if self._start is None:
                self._start, self._end = start, end
            elif start > self._end:
                self._closed += self._end - self._start
                self._start, self._end = start, end
            else:
                self._start = min(self._start, start)
                self._end = max(self._end, end)

    @property
    def seconds(self) -> float:
        with self._lock:
            open_part = 0.0 if self._start is None else self._end - self._start
            return self._closed + open_part


def _rate(nbytes: int, seconds: float) -> float | None:
    return None if seconds <= 0 else nbytes / seconds / 1e9


@dataclass(frozen=True, slots=True)
class LoaderStats:
    """A loader's measurements since it was made (every epoch), see ``DeviceLoader.stats``.

    * ``batches``, ``bytes``: batches handed to the consumer and the bytes copied to the device
      for them; ``epochs``: iterations begun.
    * ``wall_s``: seconds from the first request for a batch to the last hand-out.
    * ``wait_s``: seconds the consumer spent waiting for batches; split by what the next batch was
      waiting for at the time: ``wait_source_s`` (the source had not produced it),
      ``wait_budget_s`` (no room at the device), ``wait_copy_s`` (its copy was running).
    * ``source_batches``, ``source_bytes``, ``source_busy_s``: what the source produced and the
      time it was busy producing (the union over its threads), hence ``source_gbps``, the
      source's own rate; ``copy_bytes``, ``copy_busy_s``: the same for the copies to the device
      (``copy_gbps``).
    * ``host_copies``: tensors the loader had to copy on the host first (a view into a larger
      storage, or a storage shared with another tensor of the batch: a value must own its
      memory).
    * ``pinned_bytes``: the loader's own pinned staging buffers (a file-backed source), charged
      to ``pinned-host`` as a named reservation while the loader runs; 0 otherwise.
    * ``packed_bytes``: bytes of pageable batches the ring's thread packed into its slots'
      pinned twins (then copied with one DMA each); ``twin_peak_bytes``: the most pinned
      memory those twins held at once (each charged to ``pinned-host`` as a named
      reservation while its slot exists).
    * ``device_wait_s``: seconds the consumer was parked because the device still had more
      than ``run_ahead`` of its released steps to run (the consumer ahead of the device: not
      a wait for the loader, and not in ``wait_s``).
    * ``locked_file_bytes``, ``lock_s``: with ``pin_source``, the source's files page-locked
      in host memory (charged to ``pinned-host`` as a named reservation until the loader
      closes) and the seconds locking them took; ``direct_bytes``: bytes copied to the device
      straight out of them (no host copy; the source's own time is then none).
    * ``kept_after_release``: batches the ring handed out whose tensors the consumer still
      referred to two requests after their release (their memory is reused for later
      batches: ``.clone()`` what you keep; the first of a pass is also a ``RuntimeWarning``;
      see :mod:`~aresidency.loader.kept`).
    * ``released_shared_bytes``: bytes of batches in shared memory (a ``DataLoader``'s
      workers') the ring's thread gave back without holding the interpreter lock (see
      :mod:`~aresidency.loader.reclaim`).
    """

    batches: int = 0
    bytes: int = 0
    epochs: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    wait_source_s: float = 0.0
    wait_budget_s: float = 0.0
    wait_copy_s: float = 0.0
    source_batches: int = 0
    source_bytes: int = 0
    source_busy_s: float = 0.0
    copy_bytes: int = 0
    copy_busy_s: float = 0.0
    host_copies: int = 0
    pinned_bytes: int = 0
    packed_bytes: int = 0
    twin_peak_bytes: int = 0
    released_shared_bytes: int = 0
    device_wait_s: float = 0.0
    locked_file_bytes: int = 0
    lock_s: float = 0.0
    direct_bytes: int = 0
    kept_after_release: int = 0

    @property
    def batches_per_s(self) -> float | None:
        return None if self.wall_s <= 0 else self.batches / self.wall_s

    @property
    def gbps(self) -> float | None:
        """Bytes handed to the consumer per second of ``wall_s``, in GB/s."""
        return _rate(self.bytes, self.wall_s)

    @property
    def source_gbps(self) -> float | None:
        """The source's own rate: bytes produced per second it was busy, in GB/s."""
        return _rate(self.source_bytes, self.source_busy_s)

    @property
    def copy_gbps(self) -> float | None:
        """The copies' rate: bytes copied per second a copy was in flight, in GB/s."""
        return _rate(self.copy_bytes, self.copy_busy_s)

    @property
    def bottleneck(self) -> str:
        """``"consumer"`` when the consumer waited for the source, the budget and the copies
        together under 5% of the time (the loader kept up; the rest of a wait is the loop
        handing the batch over), else what it waited for most: ``"source"``, ``"budget"`` or
        ``"copy"``."""
        causes = {
            "source": self.wait_source_s,
            "budget": self.wait_budget_s,
            "copy": self.wait_copy_s,
        }
        if self.wall_s <= 0 or sum(causes.values()) < 0.05 * self.wall_s:
            return "consumer"
        return max(causes, key=lambda k: causes[k])

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            batches_per_s=self.batches_per_s,
            gbps=self.gbps,
            source_gbps=self.source_gbps,
            copy_gbps=self.copy_gbps,
            bottleneck=self.bottleneck,
        )
        return out

    def __str__(self) -> str:
        def gbps(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.2f} GB/s"

        per_s = self.batches_per_s
        lines = [
            f"{self.batches} batches, {format_nbytes(self.bytes)} in {self.wall_s:.3f} s "
            f"({'n/a' if per_s is None else f'{per_s:.1f}'} batches/s, {gbps(self.gbps)})",
            f"consumer waited {self.wait_s:.3f} s: source {self.wait_source_s:.3f} s, "
            f"budget {self.wait_budget_s:.3f} s, copy {self.wait_copy_s:.3f} s "
            f"(bottleneck: {self.bottleneck}); parked while the device caught up: "
            f"{self.device_wait_s:.3f} s",
            f"source: {self.source_batches} batches, {format_nbytes(self.source_bytes)} in "
            f"{self.source_busy_s:.3f} s busy ({gbps(self.source_gbps)})",
            f"copies: {format_nbytes(self.copy_bytes)} in {self.copy_busy_s:.3f} s busy "
            f"({gbps(self.copy_gbps)})",
        ]
        if self.host_copies:
            lines.append(f"host copies made by the loader: {self.host_copies}")
        if self.pinned_bytes:
            lines.append(f"pinned staging: {format_nbytes(self.pinned_bytes)}")
        if self.locked_file_bytes:
            lines.append(
                f"source files page-locked: {format_nbytes(self.locked_file_bytes)} in "
                f"{self.lock_s:.3f} s; copied straight out of them: "
                f"{format_nbytes(self.direct_bytes)}"
            )
        if self.packed_bytes:
            lines.append(
                f"packed into pinned twins: {format_nbytes(self.packed_bytes)} (twins at most "
                f"{format_nbytes(self.twin_peak_bytes)} pinned)"
            )
        if self.kept_after_release:
            lines.append(
                f"batches still referenced after their release: {self.kept_after_release} "
                "(their memory went to later batches: .clone() what you keep)"
            )
        if self.released_shared_bytes:
            lines.append(
                "shared memory given back without the interpreter lock: "
                f"{format_nbytes(self.released_shared_bytes)}"
            )
        return "\n".join(lines)


class LoaderCounters:
    """The mutable measurements behind :class:`LoaderStats` (loop thread, except the two
    clocks, which feeder and fill threads add to).

    State: the counts and sums named as in :class:`LoaderStats`; ``source_clock`` and
    ``copy_clock`` (busy time); ``first_request``/``last_hand_out`` (``perf_counter`` times
    bounding ``wall_s``).
    """

    def __init__(self) -> None:
        self.batches = 0
        self.bytes = 0
        self.epochs = 0
        self.wait_s = 0.0
        self.wait_by_cause = {"source": 0.0, "budget": 0.0, "copy": 0.0}
        self.source_batches = 0
        self.source_bytes = 0
        self.source_clock = BusyClock()
        self.copy_bytes = 0
        self.copy_clock = BusyClock()
        self.host_copies = 0
        self.pinned_bytes = 0
        self.packed_bytes = 0
        self.device_wait_s = 0.0
        self.locked_file_bytes = 0
        self.lock_s = 0.0
        self.direct_bytes = 0
        self.twin_bytes = 0  # the ring's pinned twins now (reserved at pinned-host)
        self.twin_peak = 0
        self.released_shared_bytes = 0
        self.kept_after_release = 0
        self.first_request: float | None = None
        self.last_hand_out: float | None = None

    def add_wait(self, cause: str, seconds: float) -> None:
        self.wait_by_cause[cause] = self.wait_by_cause.get(cause, 0.0) + seconds

    def snapshot(self) -> LoaderStats:
        wall = 0.0
        if self.first_request is not None and self.last_hand_out is not None:
            wall = max(0.0, self.last_hand_out - self.first_request)
        return LoaderStats(
            batches=self.batches,
            bytes=self.bytes,
            epochs=self.epochs,
            wall_s=wall,
            wait_s=self.wait_s,
            wait_source_s=self.wait_by_cause["source"],
            wait_budget_s=self.wait_by_cause["budget"],
            wait_copy_s=self.wait_by_cause["copy"],
            source_batches=self.source_batches,
            source_bytes=self.source_bytes,
            source_busy_s=self.source_clock.seconds,
            copy_bytes=self.copy_bytes,
            copy_busy_s=self.copy_clock.seconds,
            host_copies=self.host_copies,
            pinned_bytes=self.pinned_bytes,
            packed_bytes=self.packed_bytes,
            twin_peak_bytes=self.twin_peak,
            released_shared_bytes=self.released_shared_bytes,
            device_wait_s=self.device_wait_s,
            locked_file_bytes=self.locked_file_bytes,
            lock_s=self.lock_s,
            direct_bytes=self.direct_bytes,
            kept_after_release=self.kept_after_release,
        )
