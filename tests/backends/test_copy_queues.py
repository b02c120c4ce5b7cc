"""``CopyQueues``: the backends' estimate of when queued copies end, made when each copy is
issued and again when its wait begins (plain Python events stand in for device events)."""

from __future__ import annotations

import pytest

from aresidency.backends.polling import EventNotes
from aresidency.backends.prediction import CopyQueues

RATE = 1e9  # bytes per second: 1 MB takes 1 ms
MB = 1_000_000


class Event:
    """Completes when told; takes the waiter's notes as CUDA events do."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def issue(queues: CopyQueues, key: int, nbytes: int, now: float) -> Event:
    event = Event()
    queues.recorded(key, event, RATE, queues.expect(key, nbytes, RATE, now=now))
    return event


def notes(event: Event) -> EventNotes:
    found = EventNotes.of(event)
    assert found is not None
    return found


def test_a_launch_latency_is_added_only_where_the_stream_was_idle() -> None:
    queues = CopyQueues(latency_s=0.5e-3)
    first = queues.expect(1, MB, RATE, now=10.0)
    second = queues.expect(1, MB, RATE, now=10.0)
    assert first == pytest.approx(10.0015)
    assert second == pytest.approx(10.0025), "a queued copy starts when the one before ends"
    assert queues.expect(2, MB, RATE, now=10.0) == pytest.approx(10.0015), "streams apart"
    later = queues.expect(1, MB, RATE, now=20.0)  # the stream went idle meanwhile
    assert later == pytest.approx(20.0015)


def test_a_wait_is_estimated_again_from_the_bytes_still_queued_before_it() -> None:
    """64 copies queued at once, the rate assumed 20% too slow: a wait for the last one that
    begins once 63 are done expects only the last copy's bytes, not the whole queue's."""
    queues = CopyQueues(latency_s=0.0)
    events = [issue(queues, 7, MB, now=0.0) for _ in range(64)]
    assert notes(events[-1]).expected_at == pytest.approx(0.064)
    for event in events[:-1]:
        event.done = True
    queues.reestimate(7, events[-1], now=0.052)  # the copies really ran at 1.2 MB per ms
    assert notes(events[-1]).expected_at == pytest.approx(0.053)
    assert "1 events not seen complete" in repr(queues)


def test_a_wait_that_begins_mid_queue_counts_the_copies_still_pending_before_it() -> None:
    queues = CopyQueues(latency_s=0.0)
    events = [issue(queues, 3, 2 * MB, now=0.0) for _ in range(4)]
    events[0].done = True
    queues.reestimate(3, events[3], now=0.001)  # two copies pending before it, and itself
    assert notes(events[3]).expected_at == pytest.approx(0.007)
    assert events[2].queries == 0, "the search stops at the stream's first pending event"


def test_an_estimate_never_moves_later_when_its_wait_begins() -> None:
    queues = CopyQueues(latency_s=0.0)
    event = issue(queues, 1, 10 * MB, now=0.0)
    queues.reestimate(1, event, now=0.005)  # half the time gone, nothing seen complete
    assert notes(event).expected_at == pytest.approx(0.010)


def test_events_seen_complete_are_dropped_as_new_ones_are_recorded() -> None:
    """Events never awaited do not pile up: each recording drops up to two completed ones."""
    queues = CopyQueues(latency_s=0.0)
    for _ in range(100):
        issue(queues, 1, MB, now=0.0).done = True
    assert repr(queues) == "<CopyQueues 1 streams, 1 events not seen complete>"


def test_an_event_that_takes_no_notes_is_left_alone() -> None:
    class Bare:
        __slots__ = ()

        def query(self) -> bool:
            return False

    queues = CopyQueues(latency_s=0.0)
    bare = Bare()
    queues.recorded(1, bare, RATE, queues.expect(1, MB, RATE, now=0.0))
    queues.reestimate(1, bare, now=0.0)
    assert EventNotes.of(bare) is None
    assert "0 events" in repr(queues)
