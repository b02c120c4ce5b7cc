"""The driver: one phase of a plan carried out on the live state.

``core.plans.run_phase`` decides (it applies a phase's actions to the model and yields the
device work they need); :class:`PhaseRun` does: it issues the copies, loads values from their
sources, waits for what the model asked to wait for, and answers the generator. It is the
runtime's only driver: direct operations, ``materialize_nowait``, scopes and ``execute`` all
carry out their actions through it, so cancellation is handled here and nowhere else.

A run is a synchronous state machine with a thin async wrapper (trio's ``*_nowait`` style):

* :meth:`PhaseRun.start` advances the phase now: every action begins (charging its
  destination) and every copy is enqueued before it returns (a long phase: the copies begun
  before each checkpoint start there, so the device works while the rest are being begun, and
  the rest follow on later turns of the loop); the host waits for nothing;
* copies go to the backend ``ISSUE_BATCH`` at a time (:meth:`Backend.copy_many`): those it
  issues on one stream share one completion event, watched once;
* completions arrive as callbacks on the loop (the reaper's) and advance it further: a copy
  that completed commits at once, with the others of its batch, while later batches are in
  flight (a move only when no other copy of the phase reads its source); a move commits only
  once its source's readers completed; a failed copy is aborted only once nothing uses, holds
  or reads its destination any more (a run whose only work left is such aborts waiting for a
  lease or hold is finished already: its outcome is known, and its awaiter may be the task
  holding the lease; see :meth:`PhaseRun._decide_early`);
* :meth:`PhaseRun.wait` parks the calling task until the run finished and raises its error
  (after one turn of the loop first: a small copy has usually completed by then, and the run
  finishes without an event to wait on).

A phase of one Materialize or Move (a scope's entry or exit, ``materialize``, ``move``) takes
a shorter path through the same machinery: its one ticket is begun with
:func:`~aresidency.core.plans.begin_placement` and committed or aborted by the run itself,
without the phase generator, with the same transitions, errors and cancellation.

Cancellation (:meth:`PhaseRun.cancel`, or the awaiting task being cancelled): every transfer
in flight whose destination nobody has leased or held yet is cancelled (it stops issuing
chunks; its enqueued device work completes; then it is aborted); the others complete and
commit, because a lease entered on an incoming copy is reading it (and still is after it
exited, until the reader events it recorded complete). A run still beginning its
actions (or waiting to release a value) also gives up beginning: what it began but did not
issue is aborted at once. Either way the run ends with every begun transfer committed or
aborted, and the awaiting task then sees its cancellation: nothing is left incoming, charged
or protected by a cancelled operation.

Why this module is long: every operation of the runtime that moves data goes through this one
state machine, and cancellation, failed copies and commits that must wait for readers are
handled here and nowhere else; splitting it would spread one invariant (every begun ticket
ends committed or aborted before the run finishes) over several modules.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from ..backends.base import CopyRequest, Transfer, TransferCancelledError
from ..core.errors import ResidencyError
from ..core.locations import Location
from ..core.plans import (
    Action,
    ActionFailed,
    Checkpoint,
    CommitNow,
    Materialize,
    Move,
    Release,
    SettleRequest,
    TransferRequest,
    begin_placement,
    run_phase,
)
from ..core.trace import Transition
from ..core.values import CopyTicket, ValueHandle
from .payloads import Payload
from .shield import wait_shielded
from .signal import ManagerClosedError
from .sources import CallableSource, check_loaded, note_load_failure

if TYPE_CHECKING:
    from .context import Runtime

__all__ = ["PhaseCancelledError", "PhaseRun"]


class PhaseCancelledError(Exception):
    """The run was cancelled before it finished (what a cancelled run's error is)."""


_START = object()
#: ``_request`` of a run of one action while its transfer is open (see ``_start_single``).
_SINGLE: Any = object()

#: Host time a run spends issuing copies before it lets the loop run other work.
ISSUE_SLICE_S = 0.0005
#: Copies handed to the backend at once (:meth:`Backend.copy_many`): those it issues
#: together share one completion event, so they complete together too.
ISSUE_BATCH = 16


_log = logging.getLogger("aresidency")


def _call_done_callback(callback: Callable[[PhaseRun], None], run: PhaseRun) -> None:
    """Run one done callback of ``run``; one that raises is logged, as ``concurrent.futures``
    does, and never keeps the others (a streamed call's pipeline among them) from running nor
    escapes into the completion that finished the run."""
    try:
        callback(run)
    except Exception:
        _log.exception("a done callback of %r raised", run)


class PhaseRun:
    """One phase of a plan on the live state (see the module docstring).

    State: ``_gen`` (the model's phase generator), ``_request`` (what it asked for last),
    ``_open`` (ticket id -> ticket, transfers not complete yet), ``_transfers`` (ticket id ->
    the backend's transfer, while open), ``_errors`` (ticket id -> outcome), ``_unlisten``
    (set while the run waits for a state change), ``transitions`` (what this run committed,
    in order), ``finished``/``error``, ``cancel_requested``.
    Invariants: while not finished, every begun ticket is either open or has its outcome in
    ``_errors``; the run ends (``_ended``) only after the generator ended, so every ticket it
    began is committed or aborted by then. It finishes (``finished``: its outcome is known, its
    awaiters are woken) when it ends, or earlier when all that is left is aborting failed
    copies that a lease or hold protects (see :meth:`_decide_early`).
    """

    __slots__ = (
        "__weakref__",
        "_blocking",
        "_callbacks",
        "_done",
        "_ended",
        "_errors",
        "_gen",
        "_known",
        "_open",
        "_reads",
        "_ready",
        "_records",
        "_request",
        "_rt",
        "_single",
        "_thrown",
        "_ticket",
        "_transfers",
        "_unlisten",
        "actions",
        "cancel_requested",
        "error",
        "finished",
        "phase",
        "started",
        "transitions",
    )

    def __init__(
        self, runtime: Runtime, phase: str, actions: Sequence[Action], *, record: bool = True
    ) -> None:
        self._rt = runtime
        self.phase = phase
        self.actions = actions
        # A phase of one Materialize or Move (a scope's entry or exit, a direct operation)
        # skips the phase generator: its one ticket is begun, issued and committed here.
        # A phase of one Release whose materialization has no readers to wait for commits in
        # start(), without the generator either (one that has readers takes the generator).
        self._single: Materialize | Move | None = None
        self._ticket: CopyTicket | None = None
        self._gen: Any = None
        if len(actions) == 1 and type(actions[0]) in (Materialize, Move):
            self._single = actions[0]  # type: ignore[assignment]
        elif not (len(actions) == 1 and type(actions[0]) is Release):
            self._gen = run_phase(runtime.state, phase, actions)
        self._request: SettleRequest | TransferRequest | Checkpoint | None = None
        self._open: dict[int, CopyTicket] = {}
        self._transfers: dict[int, Transfer] = {}
        self._errors: dict[int, BaseException | None] = {}
        self._blocking: set[int] = set()  # completed tickets that may not commit yet
        self._ready: list[CopyTicket] = []  # completed, may commit before the others complete
        self._known: set[int] = set()  # tickets handed to _issue_tickets (early or not)
        self._reads: dict[tuple[Any, Any], int] = {}
        self._unlisten: Callable[[], None] | None = None
        self._done: anyio.Event | None = None
        self._callbacks: list[Callable[[PhaseRun], None]] = []
        # ``transitions`` lists what the run committed (a scope reports it); a run whose caller
        # reads nothing of it (a direct operation) records nothing there: its commits are
        # made with no origin, so that none is counted as another run's either.
        self.transitions: list[Transition] = []
        self._records = record  # (a flag, not the run itself: no cycle to leave to the collector)
        self.started = False
        self.finished = False
        self._ended = False
        self._thrown: BaseException | None = None  # the cancellation thrown into the generator
        self.error: BaseException | None = None
        self.cancel_requested = False

    def __repr__(self) -> str:
        state = "finished" if self.finished else "running" if self.started else "new"
        return (
            f"<PhaseRun {self.phase} {state} [{len(self.actions)} actions, "
            f"{len(self._open)} transfers open]>"
        )

    # ------------------------------------------------------------------ the core

    def start(self) -> PhaseRun:
        """Advance the phase now, synchronously: begin every action and enqueue every copy.
        Errors of the actions are the run's (see :attr:`error`), never raised here."""
        assert not self.started, "a run starts once"
        self.started = True
        if self._rt.frozen:
            # The manager closed while the caller was between two steps (the completion that
            # woke it woke the close first): the state is final and the backend closed, so
            # nothing begins and the caller gets ManagerClosedError.
            self.finished = True
            self.error = ManagerClosedError(
                f"the manager closed before this {self.phase} phase began; the state is "
                "final, so nothing was changed"
            )
            return self
        if self._records:
            self._rt.state.origin_recorders[self] = self.transitions
        self._rt.begin_work()
        if self._single is not None:
            self._start_single(self._single)
        elif self._gen is None:
            self._release_single(self.actions[0])  # type: ignore[arg-type]
        else:
            self._advance(_START)
        return self

    def _release_single(self, action: Release) -> None:
        """A phase of one Release: commit it now if its materialization has no readers to wait
        for (what the phase generator would do, without it); otherwise run the generator."""
        state = self._rt.state
        previous, state.origin = state.origin, (self if self._records else None)
        outcome: BaseException | None = None
        try:
            # (state.release validates the handle and location, and raises what this lookup
            # would: it looks only where they are valid)
            value = state.find_value(action.handle) if type(action.handle) is ValueHandle else None
            mat = None if value is None else value.materializations.get(action.location)
            if (
                mat is not None
                and mat.pending_event_count
                and not (mat.use_count or mat.hold_count)
            ):
                self._gen = run_phase(state, self.phase, self.actions)
            else:
                state.release(action.handle, action.location)
        except (ResidencyError, ValueError) as error:
            outcome = ActionFailed(0, action, error)
        except BaseException as error:  # as the generator's run would end with it
            outcome = error
        finally:
            state.origin = previous
        if self._gen is not None:
            self._advance(_START)
            return
        self._rt.settle()
        self._finish(outcome)

    def _start_single(self, action: Materialize | Move) -> None:
        """Begin the phase's one action and issue its transfer (what the phase generator and
        :meth:`_issue` do for a phase of one action, without them)."""
        rt = self._rt
        state = rt.state
        previous, state.origin = state.origin, (self if self._records else None)
        outcome: BaseException | None = None
        ticket: CopyTicket | None = None
        try:
            ticket = begin_placement(state, action, {action.location})
        except (ResidencyError, ValueError) as error:
            outcome = ActionFailed(0, action, error)
        finally:
            state.origin = previous
        rt.settle()
        if ticket is None:
            try:
                self._finish(outcome)
            finally:
                # (the error's traceback holds this frame: a local kept here would be a cycle
                # through the error that only the garbage collector frees)
                outcome = None
            return
        self._ticket = ticket
        self._request = _SINGLE
        self._issue_single(ticket)

    def _issue_single(self, ticket: CopyTicket) -> None:
        """:meth:`_issue_tickets` and :meth:`_copy` for the one ticket of a run of one action
        (the same bookkeeping and the same backend call, a ``copy_many`` of one request,
        without the batching loop); its completion goes to :meth:`_single_done`."""
        rt = self._rt
        ticket_id = ticket.ticket_id
        self._open[ticket_id] = ticket
        self._reads[(ticket.handle, ticket.source)] = 1  # the phase's one read of its source
        if ticket.source is None:
            rt.begin_work()
            self._load(ticket)
            return
        if self.cancel_requested:
            error = TransferCancelledError(
                f"the copy of {ticket.handle} was cancelled before it began"
            )
            self._complete(ticket, error)
            return
        payloads = rt.payloads
        source = payloads.get(ticket.handle, ticket.source)
        assert source is not None, "a resident materialization without data"
        request = CopyRequest(source.tensor, ticket.source, ticket.destination, source.readers)
        del source
        result = rt.backend.copy_many([request])[0]
        del request
        if not isinstance(result, Transfer):
            self._complete(ticket, result)
            return
        self._transfers[ticket_id] = result
        payloads.put(ticket.handle, ticket.destination, Payload(result.tensor, result))
        rt.reaper.watch(result, functools.partial(self._single_done, ticket))

    def _single_done(self, ticket: CopyTicket, error: BaseException | None) -> None:
        """The reaper: the one transfer of a run of one action completed (or the backend
        closed): :meth:`_transfer_done` without a request's other tickets to commit."""
        transfer = self._transfers.get(ticket.ticket_id)
        if error is None and transfer is not None:
            error = transfer.outcome()
        del transfer  # completing may free its destination (an abort): hold nothing of it
        self._complete(ticket, error)

    def _end_single(self) -> None:
        """The one transfer completed and may commit: commit it (or abort it if it failed)
        and finish, with the error the phase generator would end with."""
        ticket = self._ticket
        assert ticket is not None
        self._ticket = None
        self._request = None
        if self._unlisten is not None:
            self._unlisten_now()
        error = self._errors.get(ticket.ticket_id)
        state = self._rt.state
        previous, state.origin = state.origin, (self if self._records else None)
        try:
            if error is None:
                state.commit_copy(ticket)
            else:
                state.abort_copy(ticket)
        finally:
            state.origin = previous
        self._rt.settle()
        self._finish(None if error is None else ActionFailed(0, None, error))

    def _advance(self, response: Any, throw: BaseException | None = None) -> None:
        """Answer the generator (or throw into it) and act on its next request; repeats while
        a request can be answered at once."""
        state = self._rt.state
        gen = self._gen
        assert gen is not None, "a run of one action has no phase generator"
        while True:
            previous, state.origin = state.origin, (self if self._records else None)
            request: SettleRequest | TransferRequest | Checkpoint | None = None
            outcome: BaseException | None = None
            ended = False
            try:
                if throw is not None:
                    request = gen.throw(throw)
                elif response is _START:
                    request = next(gen)
                else:
                    request = gen.send(response)
            except StopIteration:
                ended = True
            except BaseException as error:  # ActionFailed, or a cancellation thrown in
                ended, outcome = True, error
            finally:
                state.origin = previous
            self._rt.settle()
            if ended:
                self._finish(outcome)
                return
            if isinstance(response, CommitNow):
                return  # the same request again: the rest of its transfers are in flight
            throw = None
            self._request = request
            if isinstance(request, Checkpoint):
                # A long phase: continue on a later turn of the loop, so other work runs; the
                # transfers begun so far start now, while the rest are being begun.
                if request.issue:
                    self._issue_tickets(request.issue)
                self._rt.bridge.call_soon(self._resume)
                return
            if isinstance(request, SettleRequest):
                if not self._settled(request):
                    self._listen(self._poll_settle)
                    return
                response = None
                continue
            assert isinstance(request, TransferRequest)
            self._issue(request)  # completions (even immediate failures) come back later
            return

    def _resume(self) -> None:
        """The loop came back to a run paused at a checkpoint."""
        if not self.finished and isinstance(self._request, Checkpoint):
            self._advance(None)

    def _settled(self, request: SettleRequest) -> bool:
        value = self._rt.state.find_value(request.handle)
        mat = None if value is None else value.materializations.get(request.location)
        return mat is None or mat.pending_event_count == 0

    def _poll_settle(self) -> None:
        request = self._request
        if isinstance(request, SettleRequest) and self._settled(request):
            self._unlisten_now()
            self._advance(None)

    def _issue(self, request: TransferRequest) -> None:
        """Start the transfers of ``request`` that a checkpoint did not start already; answer
        at once if every transfer of the request has completed meanwhile."""
        fresh = tuple(t for t in request.tickets if t.ticket_id not in self._known)
        if fresh:
            self._issue_tickets(fresh)
        elif not self._open:
            self._poll_commit()
            return
        self._commit_ready()

    def _issue_tickets(self, tickets: tuple[CopyTicket, ...]) -> None:
        """Every ticket is open from now on; copies are enqueued ``ISSUE_BATCH`` at a time,
        for at most ``ISSUE_SLICE_S`` per turn of the loop (a phase of thousands of copies
        never holds the loop for long); loads go to a worker thread."""
        for ticket in tickets:
            self._known.add(ticket.ticket_id)
            self._open[ticket.ticket_id] = ticket
            key = (ticket.handle, ticket.source)  # the phase's copies per source
            self._reads[key] = self._reads.get(key, 0) + 1
        self._issue_from(tickets, 0)

    def _issue_from(self, tickets: tuple[CopyTicket, ...], start: int) -> None:
        rt = self._rt
        # Issue for at most ISSUE_SLICE_S of host time per turn of the loop (a CUDA copy is
        # enqueued in tens of microseconds; the simulation's take longer), ISSUE_BATCH copies
        # to the backend at a time.
        until = time.perf_counter() + ISSUE_SLICE_S
        stop = start
        while stop < len(tickets):
            if stop > start and time.perf_counter() > until:
                break
            batch: list[CopyTicket] = []
            for ticket in tickets[stop : stop + ISSUE_BATCH]:
                stop += 1
                if self.finished:
                    return
                if ticket.source is None:
                    rt.begin_work()
                    self._load(ticket)
                elif self.cancel_requested:
                    self._complete(
                        ticket,
                        TransferCancelledError(
                            f"the copy of {ticket.handle} was cancelled before it began"
                        ),
                    )
                else:
                    batch.append(ticket)
            if batch:
                self._copy(batch)
        if stop < len(tickets) and not self.finished:
            rt.bridge.call_soon(self._issue_from, tickets, stop)

    def _copy(self, tickets: list[CopyTicket]) -> None:
        """Enqueue the copies of begun tickets (one :meth:`Backend.copy_many`), record each
        destination's payload and watch the transfers: one watch for the transfers that share
        a completion event. A copy that could not start (its allocation failed) completes
        with that error."""
        rt = self._rt
        payloads = rt.payloads
        requests = []
        for ticket in tickets:
            assert ticket.source is not None
            source = payloads.get(ticket.handle, ticket.source)
            assert source is not None, "a resident materialization without data"
            requests.append(
                CopyRequest(source.tensor, ticket.source, ticket.destination, source.readers)
            )
        del source
        results = rt.backend.copy_many(requests)
        del requests
        failed: list[tuple[CopyTicket, BaseException]] = []
        sharing: list[CopyTicket] = []  # consecutive tickets whose transfers share an event
        shared: Transfer | None = None
        for ticket, result in zip(tickets, results, strict=True):
            if not isinstance(result, Transfer):
                failed.append((ticket, result))
                continue
            self._transfers[ticket.ticket_id] = result
            payloads.put(ticket.handle, ticket.destination, Payload(result.tensor, result))
            if shared is not None and result.event is not None and result.event is shared.event:
                sharing.append(ticket)
                continue
            if shared is not None:
                self._watch(shared, sharing)
            shared, sharing = result, [ticket]
        if shared is not None:
            self._watch(shared, sharing)
        del results, shared, result
        for ticket, error in failed:
            self._complete(ticket, error)

    def _watch(self, transfer: Transfer, tickets: list[CopyTicket]) -> None:
        """Complete ``tickets`` (whose transfers share ``transfer``'s event, or just its own)
        once ``transfer`` completed."""
        if len(tickets) == 1:
            done = functools.partial(self._transfer_done, tickets[0])
        else:
            done = functools.partial(self._transfers_done, tickets)
        self._rt.reaper.watch(transfer, done)

    def _transfers_done(self, tickets: list[CopyTicket], error: BaseException | None) -> None:
        for ticket in tickets:
            if self.finished:
                return
            self._deliver(ticket, error)
        self._commit_ready()

    def _transfer_done(self, ticket: CopyTicket, error: BaseException | None) -> None:
        """The reaper: the transfer of ``ticket`` completed (or the backend closed)."""
        self._deliver(ticket, error)
        self._commit_ready()

    def _deliver(self, ticket: CopyTicket, error: BaseException | None) -> None:
        transfer = self._transfers.get(ticket.ticket_id)
        if error is None and transfer is not None:
            error = transfer.outcome()
        del transfer  # completing may free its destination (an abort): hold nothing of it
        self._complete(ticket, error)

    def _complete(self, ticket: CopyTicket, error: BaseException | None) -> None:
        """One transfer of the current request completed (O(1): the checks for the commit
        are made per ticket as they complete, not over the whole request at the end)."""
        self._errors[ticket.ticket_id] = error
        self._open.pop(ticket.ticket_id, None)
        # A finished transfer is only needed for cancelling an open one: dropped here, so that
        # the run (and an operation object a caller keeps) never holds its tensor alive.
        self._transfers.pop(ticket.ticket_id, None)
        payload = self._rt.payloads.get(ticket.handle, ticket.destination)
        if payload is not None:
            if error is not None:
                payload.failure = error  # leases entered on the incoming copy report it
            else:
                payload.transfer = None  # its data is there (committed with the request)
        elif error is not None:
            # Failed before its data existed (a load, a copy that could not start): a lease
            # waiting for that data must stop waiting (the abort waits for it to end).
            value = self._rt.state.find_value(ticket.handle)
            mat = None if value is None else value.materializations.get(ticket.destination)
            if mat is not None and mat.protected:
                mat.fill_failure = error
                self._rt.signal.notify()
        del payload  # the commit below may free it (an abort): hold nothing of it
        if not self._may_commit(ticket):
            self._blocking.add(ticket.ticket_id)
        elif error is None and self._open and self._commits_alone(ticket):
            self._ready.append(ticket)
        if not self._open:
            self._poll_commit()

    def _commits_alone(self, ticket: CopyTicket) -> bool:
        """May this completed copy commit before the rest of its request? A copy that keeps
        its source may (its commit ends its read of the source); a move only when no other
        copy of the request reads its source (its commit frees the source)."""
        if not ticket.move or ticket.source is None:
            return True
        return self._reads.get((ticket.handle, ticket.source), 0) == 1

    def _commit_ready(self) -> None:
        """Commit the copies that completed and may commit alone (one answer for all of
        them), while the rest of the request's transfers are still in flight: when the last
        one completes, only its own commits are left to do."""
        if (
            self.finished
            or not self._ready
            or not self._open
            or not isinstance(self._request, TransferRequest)  # still beginning actions
        ):
            return
        ready, self._ready = self._ready, []
        for ticket in ready:
            if ticket.source is not None and not ticket.move:
                self._reads[(ticket.handle, ticket.source)] -= 1  # its read ends here
        self._advance(CommitNow(tuple(t.ticket_id for t in ready)))

    def _may_commit(self, ticket: CopyTicket) -> bool:
        """May the generator commit (or abort) this completed transfer now? A failed copy's
        destination must be unused, unheld and unread (it is freed at the abort); a move's
        source must have no consumer events left but the copies of this request."""
        failed = self._errors.get(ticket.ticket_id) is not None
        if not failed and not (ticket.move and ticket.source is not None):
            return True  # a copy that keeps its source, or a load, commits when it completed
        value = self._rt.state.find_value(ticket.handle)
        if value is None:
            return True
        if failed:
            mat = value.materializations.get(ticket.destination)
            return mat is None or not mat.protected
        if ticket.move and ticket.source is not None:
            src = value.materializations.get(ticket.source)
            if src is None:
                return True
            if self._request is _SINGLE:
                ours = 1  # a run of one action: its one copy reads the source (_issue_single)
            else:
                ours = self._reads.get((ticket.handle, ticket.source), 0)
            return src.pending_event_count <= ours
        return True

    def _poll_commit(self) -> None:
        request = self._request
        if request is _SINGLE:
            if self._ended or self._open:
                return
            if self._blocking:
                ticket = self._ticket
                assert ticket is not None
                if not self._may_commit(ticket):
                    self._listen(self._poll_commit)
                    self._decide_early([ticket], ActionFailed)
                    return
                self._blocking.clear()
            self._end_single()
            return
        if self._ended or self._open or not isinstance(request, TransferRequest):
            return
        if self._blocking:
            tickets = {t.ticket_id: t for t in request.tickets if t.ticket_id in self._blocking}
            self._blocking = {i for i, t in tickets.items() if not self._may_commit(t)}
            if self._blocking:
                self._listen(self._poll_commit)
                self._decide_early([tickets[i] for i in self._blocking], request)
                return
        self._unlisten_now()
        self._ready = []  # the final answer commits them with the rest
        self._advance(dict(self._errors))

    def _decide_early(
        self, blocked: list[CopyTicket], request: TransferRequest | type[ActionFailed]
    ) -> None:
        """Every transfer completed and what is left is aborting failed copies whose
        destinations a lease or hold protects (the task that entered it decides when that
        ends, and may be the one awaiting this run): the outcome is known, so the run is
        finished now, its awaiters get the error and closing the manager does not wait for
        it. The aborts follow when the protections end (:meth:`_poll_commit` still listens),
        or never, if the manager closes first (its state is final then). A copy still read
        by the device (consumer events) or a move waiting for its source's readers keeps the
        run unfinished: those end by themselves."""
        if self.finished:
            return
        state = self._rt.state
        errors: list[BaseException] = []
        for ticket in blocked:
            error = self._errors.get(ticket.ticket_id)
            value = state.find_value(ticket.handle)
            mat = None if value is None else value.materializations.get(ticket.destination)
            if error is None or mat is None or mat.pending_event_count:
                return
            errors.append(error)
        if isinstance(request, TransferRequest):
            if self.cancel_requested and self._thrown is None:
                return  # cannot happen (cancel() throws or finds no open transfer) but is safe
            # What the phase generator will end with (see core.plans._carry_out): a
            # cancellation thrown in, else the first action that failed to begin, else the
            # first failed copy in the request's order.
            outcome: BaseException
            if self._thrown is not None:
                outcome = self._thrown
            elif request.failure is not None:
                outcome = request.failure
            else:
                first = next(
                    i
                    for i, t in enumerate(request.tickets)
                    if self._errors.get(t.ticket_id) is not None
                )
                outcome = ActionFailed(
                    request.action_indexes[first],
                    None,
                    self._errors[request.tickets[first].ticket_id],  # type: ignore[arg-type]
                )
        else:
            outcome = ActionFailed(0, None, errors[0])
        self._announce(outcome)

    def _listen(self, poll: Callable[[], None]) -> None:
        if self._unlisten is None:
            self._unlisten = self._rt.signal.add_listener(poll)

    def _unlisten_now(self) -> None:
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None

    def _finish(self, error: BaseException | None) -> None:
        """Every ticket the run began is committed or aborted."""
        self._ended = True
        if self._unlisten is not None:
            self._unlisten_now()
        if self._records:
            self._rt.state.origin_recorders.pop(self, None)
        if not self.finished:  # else finished early (see _decide_early), with this outcome
            self._announce(error)

    def _announce(self, error: BaseException | None) -> None:
        """The outcome is known: wake the awaiters, call the done callbacks."""
        self.finished = True
        self.error = error
        self._rt.end_work()
        if self._done is not None:
            self._done.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _call_done_callback(callback, self)

    # ------------------------------------------------------------------ loads

    def _load(self, ticket: CopyTicket) -> None:
        """Rebuild a value from its source: load (and place) in a worker thread, never on the
        loop; then, when the destination is a device, copy it there like any other transfer.
        Every step after the thread's runs on the loop, as a callback (no task)."""
        rt = self._rt
        source = rt.sources[ticket.handle]
        first = ticket.via if ticket.via is not None else ticket.destination
        place_at = first if first.is_pinned else None
        if ticket.via is not None and ticket.destination.is_host:
            place_at = ticket.destination  # a host destination is filled in the thread too
        future = rt.loads.submit(
            _load_checked, source, rt.backend, place_at, ticket.handle, ticket.destination
        )
        future.add_done_callback(
            lambda done: rt.bridge.call_soon_quietly(self._loaded, ticket, done)
        )

    def _loaded(self, ticket: CopyTicket, future: Any) -> None:
        """The loop: the worker thread loaded the source."""
        rt = self._rt
        rt.end_work()
        if self.finished:
            return
        error = future.exception()
        if error is not None:
            self._complete(ticket, error)
            return
        tensor = future.result()
        if ticket.via is None or ticket.destination.is_host:
            rt.payloads.put(ticket.handle, ticket.destination, Payload(tensor))
            self._complete(ticket, None)
            return
        if self.cancel_requested:
            self._complete(
                ticket, TransferCancelledError(f"the load of {ticket.handle} was cancelled")
            )
            return
        try:
            transfer = rt.backend.copy(tensor, ticket.via, ticket.destination)
        except BaseException as exc:
            self._complete(ticket, exc)
            return
        self._transfers[ticket.ticket_id] = transfer
        rt.payloads.put(ticket.handle, ticket.destination, Payload(transfer.tensor, transfer))
        rt.signal.notify()  # its data exists now: a lease waiting for the load may enter
        rt.reaper.watch(transfer, functools.partial(self._transfer_done, ticket))

    # ------------------------------------------------------------------ cancellation

    def cancel(self) -> None:
        """Cancel the run (synchronous; see the module docstring). It still finishes through
        the normal path; :attr:`error` is then :class:`PhaseCancelledError` (or the cause of a
        failure that happened first)."""
        if self.finished or self.cancel_requested:
            return
        self.cancel_requested = True
        self._cancel_transfers()
        request = self._request
        if isinstance(request, SettleRequest) or (
            isinstance(request, Checkpoint) and request.stage == "begin"
        ):
            # Still beginning actions: give up now. The generator aborts what it began and
            # carries out (cancelled above) what a checkpoint had handed out already.
            self._unlisten_now()
            self._request = None  # a pending resume of the checkpoint does nothing
            self._thrown = PhaseCancelledError(f"{self.phase} was cancelled")
            self._advance(None, throw=self._thrown)

    def _cancel_transfers(self) -> None:
        """Cancel every open transfer whose destination no lease or hold reads, and no
        consumer event either: a lease that exited on the incoming copy left its kernels,
        ordered after the copy on the device, to read it."""
        state = self._rt.state
        for ticket_id, ticket in list(self._open.items()):
            transfer = self._transfers.get(ticket_id)
            if transfer is None:
                continue  # a load still reading its source: it stops before its copy
            value = state.find_value(ticket.handle)
            mat = None if value is None else value.materializations.get(ticket.destination)
            if mat is not None and (mat.use_count or mat.hold_count or mat.pending_event_count):
                continue  # a lease reads (or has read) the incoming copy: let it arrive
            payload = self._rt.payloads.get(ticket.handle, ticket.destination)
            if payload is not None:
                payload.aborting = True
            transfer.cancel()

    # ------------------------------------------------------------------ the async wrapper

    def add_done_callback(self, callback: Callable[[PhaseRun], None]) -> None:
        """Call ``callback(run)`` on the loop when the run finished (now if it has)."""
        if self.finished:
            _call_done_callback(callback, self)
        else:
            self._callbacks.append(callback)

    def _done_event(self) -> anyio.Event:
        """The event set when the run finishes (made on first need: most runs are never
        waited on that way)."""
        if self._done is None:
            self._done = self._rt.new_event()
        return self._done

    async def wait_finished_shielded(self) -> BaseException | None:
        """Park until the run finished, whatever cancels the task meanwhile (the run is not
        cancelled); returns the cancellation that arrived, for the caller to raise once it
        has dealt with the run's outcome (see :func:`~aresidency.runtime.shield.wait_shielded`)."""
        if not self.started:
            self.start()
        if self.finished:
            return None
        caught: BaseException | None = None
        later: BaseException | None = None
        with self._rt.shielded_scope():  # one shield for both waits
            try:
                # As in wait(): a copy that completed while being issued is delivered in this
                # turn of the loop, and no event is needed.
                await self._rt.checkpoint()
            except anyio.get_cancelled_exc_class() as cancelled:
                caught = cancelled  # a native asyncio cancellation (the shield holds anyio's)
            if not self.finished:
                # wait_shielded(self._done_event()), inside the shield already entered
                event = self._done_event()
                while not event.is_set():
                    try:
                        await event.wait()
                    except anyio.get_cancelled_exc_class() as cancelled:
                        later = cancelled  # (native asyncio, as above: kept, raised later)
        return caught if caught is not None else later

    async def wait_finished(self) -> None:
        """Park until the run finished, raising nothing; cancelling this wait leaves the run
        going (unlike :meth:`wait`)."""
        if not self.finished:
            await self._done_event().wait()

    async def wait(self) -> None:
        """Park until the run finished; raise its error. If the awaiting task is cancelled
        meanwhile, the run is cancelled, the task waits (shielded, also from further native
        asyncio cancellations: see :mod:`~aresidency.runtime.shield`) until the run finished,
        and then the cancellation propagates."""
        if not self.started:
            self.start()
        if not self.finished:
            try:
                # One turn of the loop first: a copy that completed while it was being issued
                # (a small one usually has) is delivered in that turn, ahead of this task, and
                # the run then finishes without an event to wait on.
                await self._rt.checkpoint()
                if not self.finished:
                    await self._done_event().wait()
            except anyio.get_cancelled_exc_class():
                self.cancel()
                if not self.finished:
                    # Held on through further cancellations, native asyncio ones included (a
                    # shield alone lets those through): the run must end before the task goes
                    # on.
                    await wait_shielded(self._done_event())
                raise
        if self.error is not None:
            raise self.error


def _load_checked(
    source: Any,
    backend: Any,
    place_at: Location | None,
    handle: ValueHandle,
    destination: Location,
) -> Any:
    """``source.load()``, checked against what the source declared (an error naming the value,
    what was expected and what came back), contiguous, in memory of its own (not a view of a
    larger storage), and placed at ``place_at`` when given (a worker thread: loading and
    pinning block it, not the loop). An exception ``load()`` itself raises is the caller's own
    (an ``OSError`` of a file gone): it keeps its type, with a note naming the value and
    ``destination``, where it was being rebuilt (:func:`note_load_failure`)."""
    what = str(handle)
    if isinstance(source, CallableSource):
        # it checks, naming the value, and notes an exception of the load function's
        tensor = source.load(what=what, rebuilding_at=destination)
    else:
        try:
            loaded = source.load()
        except Exception as error:
            note_load_failure(error, what, destination, source)
            raise
        tensor = check_loaded(loaded, source.shape, source.dtype, what=what)
    # Detached: what the manager keeps carries no autograd state (a load that returns a
    # module's parameter would otherwise be copied with a CopyBackwards, requires_grad on).
    tensor = tensor.detach().contiguous()
    if place_at is not None:
        tensor = backend.place(tensor, place_at)
    elif tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        # A view of a larger storage (load() sliced a bigger tensor): kept as it is, that whole
        # storage would stay alive behind the value's charge. Its own memory instead.
        tensor = tensor.clone()
    return tensor
