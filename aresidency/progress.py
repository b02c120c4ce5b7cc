"""Progress reports for work that takes seconds, so a slow start can be told from a hang.

Registering gigabytes into pinned memory, loading a checkpoint or running a long benchmark can
take many seconds with nothing else to show for it. :func:`progress` wraps such work: it logs a
record when the work starts and one when it ends (or fails), and, when the output stream is a
terminal and ``tqdm`` is installed, draws a progress bar in between. ``tqdm`` is optional: without
it, or when the output is not a terminal (a log file, CI), nothing is drawn and only the log
records are written. Callers count work done with :meth:`Progress.update`, from any thread.

:func:`progress_if_large` is the form the package itself uses around work measured in bytes
(registering a value that is copied into pinned memory, packing and pinning a streamed
module's blocks): it reports only work of at least :data:`LARGE_WORK_BYTES`, so that small,
fast work stays silent. A block nested inside another (each value registered while a whole
module is) draws no bar of its own and logs at DEBUG level: the outer block reports the work.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Protocol, TextIO

from .core.sizes import format_nbytes

__all__ = ["LARGE_WORK_BYTES", "Progress", "progress", "progress_if_large"]

_LOGGER_NAME = "aresidency"

#: :func:`progress_if_large` reports work of at least this many bytes (256 MiB: copying that much
#: into pinned memory takes a noticeable fraction of a second). Read at every call, so a program
#: (or a test) may change it: ``aresidency.progress.LARGE_WORK_BYTES = 1 << 30``.
LARGE_WORK_BYTES = 256 * 1024**2

# How many progress blocks enclose the current code (per thread and per task): only the
# outermost draws a bar and logs at INFO, so nested reports do not fight over the terminal.
_DEPTH: ContextVar[int] = ContextVar("aresidency_progress_depth", default=0)


class _Bar(Protocol):
    """The part of ``tqdm.tqdm`` this module uses."""

    def update(self, n: float | None = 1) -> bool | None: ...

    def close(self) -> None: ...


class Progress:
    """How far one :func:`progress` block has got: ``done`` units out of ``total``.

    Made by :func:`progress`, not by hand. ``description`` and ``total`` (``None`` when unknown)
    are as given to :func:`progress`; ``done`` is the sum of every :meth:`update` so far.
    """

    __slots__ = ("_bar", "_description", "_done", "_lock", "_total", "_unit")

    def __init__(self, description: str, total: int | None, unit: str, bar: _Bar | None) -> None:
        self._description = description
        self._total = total
        self._unit = unit
        self._bar = bar
        self._done = 0
        # update() may be called from a worker thread while the event loop thread also calls it;
        # "+=" on an attribute and tqdm's own counter are not atomic.
        self._lock = threading.Lock()

    @property
    def description(self) -> str:
        """What is being done, as given to :func:`progress`."""
        return self._description

    @property
    def total(self) -> int | None:
        """How many units the work will take, or ``None`` when that is not known."""
        return self._total

    @property
    def unit(self) -> str:
        """The unit ``done`` and ``total`` count (``"B"`` for bytes)."""
        return self._unit

    @property
    def done(self) -> int:
        """How many units have been reported done so far."""
        return self._done

    def update(self, n: int = 1) -> None:
        """Record ``n`` more units done (an int; 1 by default) and advance the bar, if any.

        Safe to call from any thread, and cheap enough to call per block or per tensor: the bar
        redraws at most every tenth of a second. ``n`` is not checked, to keep the call cheap.
        Calls after the block has ended still count in ``done`` but draw nothing. Raises nothing.
        """
        with self._lock:
            self._done += n
            if self._bar is not None:
                self._bar.update(n)

    def __repr__(self) -> str:
        total = "?" if self._total is None else self._total
        return f"Progress({self._description!r}, {self._done}/{total} {self._unit})"


def _amount(count: int, unit: str) -> str:
    return format_nbytes(count) if unit == "B" else f"{count} {unit}"


def _rate(count: int, seconds: float, unit: str) -> str:
    if seconds <= 0:
        return "rate unknown"
    per_second = count / seconds
    if unit == "B":
        return f"{format_nbytes(int(per_second))}/s"
    return f"{per_second:.1f} {unit}/s"


def _is_terminal(stream: TextIO | None) -> bool:
    if stream is None:  # sys.stderr is None under pythonw and some embedders
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        # No isatty, or a closed stream: not a terminal we can draw on.
        return False


def _open_bar(
    description: str, total: int | None, unit: str, stream: TextIO | None, min_seconds: float
) -> _Bar | None:
    """A tqdm bar on ``stream``, or ``None`` when it is not a terminal or tqdm is missing."""
    if not _is_terminal(stream):
        return None
    try:
        # Imported here, not at the top: tqdm is optional, and only a terminal needs it.
        from tqdm import tqdm  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        return None
    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    bar: _Bar = tqdm(
        desc=description,
        total=total,
        unit=unit,
        file=stream,
        # tqdm draws nothing at all, not even on close, if the bar ends before this delay.
        delay=min_seconds,
        dynamic_ncols=True,
        **scale,
    )
    return bar


def _check_arguments(
    description: object, total: object, unit: object, logger: object, min_seconds: object
) -> None:
    if not isinstance(description, str):
        raise TypeError(f"progress description must be a str, got {description!r}")
    if total is not None:
        if isinstance(total, bool) or not isinstance(total, int):
            raise TypeError(f"progress total must be an int or None (unknown), got {total!r}")
        if total < 0:
            raise ValueError(f"progress total must be >= 0 or None (unknown), got {total!r}")
    if not isinstance(unit, str) or not unit:
        raise ValueError(f"progress unit must be a non-empty str such as 'B' or 'it', got {unit!r}")
    if logger is not None and not isinstance(logger, logging.Logger):
        raise TypeError(f"progress logger must be a logging.Logger or None, got {logger!r}")
    if (
        isinstance(min_seconds, bool)
        or not isinstance(min_seconds, int | float)
        or not math.isfinite(min_seconds)
        or min_seconds < 0
    ):
        raise ValueError(
            f"progress min_seconds must be a finite number of seconds >= 0, got {min_seconds!r}"
        )


@contextmanager
def progress(
    description: str,
    total: int | None = None,
    *,
    unit: str = "B",
    logger: logging.Logger | None = None,
    stream: TextIO | None = None,
    min_seconds: float = 0.0,
) -> Iterator[Progress]:
    """Report the progress of the work in the ``with`` block; yield a :class:`Progress` to count it.

    ``description`` says what is being done (``"register 12 tensors in pinned memory"``);
    ``total`` is how many ``unit`` the work will take, or ``None`` if unknown; ``unit`` is
    ``"B"`` (bytes, the default: amounts print like ``torch.cuda.memory_summary``) or any other
    name (``"it"``, ``"tensor"``). Two INFO records go to ``logger`` (``aresidency`` by default):
    ``"<description>: started (<total>)"`` on entry and
    ``"<description>: done, <amount> in <seconds> s (<rate>/s)"`` on exit; if the block raises,
    the exit record is a WARNING that says it failed, and the exception propagates unchanged.

    If ``stream`` (``sys.stderr`` by default) is a terminal and ``tqdm`` is installed, a bar is
    drawn on it, unless the block finishes within ``min_seconds`` (quick work needs no bar).
    Otherwise nothing is written to ``stream``. A block entered inside another one (in the same
    thread or task) draws no bar and logs its records at DEBUG instead of INFO (its failure
    record stays a WARNING): the outer block is the one the user follows.

    Raises ``TypeError`` if ``description`` is not a str, ``total`` is not an int or ``None``, or
    ``logger`` is not a ``logging.Logger``; ``ValueError`` if ``total`` is negative, ``unit`` is
    empty, or ``min_seconds`` is negative or not finite.
    """
    _check_arguments(description, total, unit, logger, min_seconds)
    log = logging.getLogger(_LOGGER_NAME) if logger is None else logger
    out = sys.stderr if stream is None else stream
    depth = _DEPTH.get()
    level = logging.INFO if depth == 0 else logging.DEBUG
    log.log(
        level,
        "%s: started (%s)",
        description,
        "total unknown" if total is None else _amount(total, unit),
    )
    bar = _open_bar(description, total, unit, out, float(min_seconds)) if depth == 0 else None
    report = Progress(description, total, unit, bar)
    token = _DEPTH.set(depth + 1)
    started = time.perf_counter()
    try:
        yield report
    except BaseException as exc:
        elapsed = time.perf_counter() - started
        if bar is not None:
            bar.close()
        done = report.done
        so_far = _amount(done, unit)
        if total is not None:
            so_far = f"{so_far} of {_amount(total, unit)}"
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        # No traceback here: the exception propagates, and whoever handles it decides whether it
        # is worth one. This record only says where the work stopped.
        log.warning("%s: failed after %.2f s, %s done (%s)", description, elapsed, so_far, reason)
        raise
    finally:
        _leave(token)
    elapsed = time.perf_counter() - started
    if bar is not None:
        bar.close()
    done = report.done
    log.log(
        level,
        "%s: done, %s in %.2f s (%s)",
        description,
        _amount(done, unit),
        elapsed,
        _rate(done, elapsed, unit),
    )


def _leave(token: Token[int]) -> None:
    try:
        _DEPTH.reset(token)
    except ValueError:
        # Left in another context than it was entered in (a generator finished elsewhere):
        # that context's depth was never raised, so there is nothing to undo.
        pass


@contextmanager
def progress_if_large(
    description: str,
    nbytes: int,
    *,
    threshold: int | None = None,
    logger: logging.Logger | None = None,
    stream: TextIO | None = None,
    min_seconds: float = 0.0,
) -> Iterator[Progress]:
    """:func:`progress` for work of ``nbytes`` bytes when it is at least ``threshold``
    (:data:`LARGE_WORK_BYTES` by default); smaller work is counted silently (no record, no bar).

    Yields a :class:`Progress` either way, so the caller counts the same way in both cases.
    The arguments are checked as :func:`progress` checks them, whatever the size.
    """
    _check_arguments(description, nbytes, "B", logger, min_seconds)
    limit = LARGE_WORK_BYTES if threshold is None else threshold
    if nbytes < limit:
        yield Progress(description, nbytes, "B", None)
        return
    with progress(
        description, nbytes, logger=logger, stream=stream, min_seconds=min_seconds
    ) as report:
        yield report
