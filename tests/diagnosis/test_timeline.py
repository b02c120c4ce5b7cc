"""The trace as a Chrome trace-event file: checked against the format's rules (what Perfetto and
chrome://tracing need of each event), against the manager's own snapshot (the charge counters
end at the ledger's bytes and never pass the budget), and exported from a streamed module run on
the simulated backend (a simulation of CUDA devices in host memory)."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from integrations._models import sequential

from aresidency import (
    MemoryReservation,
    ReplicaMode,
    ResidencyManager,
    ResidencyPlan,
    stream_module,
)
from aresidency.diagnosis import timeline_document

pytestmark = pytest.mark.anyio

KiB = 1 << 10
PHASES = {"X", "B", "E", "C", "i", "M"}


def validate(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Check ``document`` against the trace-event format; return its events."""
    assert set(document) >= {"traceEvents"}
    events = document["traceEvents"]
    assert isinstance(events, list) and events
    for event in events:
        assert event["ph"] in PHASES, event
        assert isinstance(event["name"], str) and event["name"], event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int), event
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
        if event["ph"] == "C":
            assert event["args"] and all(
                isinstance(v, (int, float)) and not isinstance(v, bool)
                for v in event["args"].values()
            ), event
        if event["ph"] == "i":
            assert event.get("s", "t") in {"g", "p", "t"}, event
        if event["ph"] == "M":
            assert event["name"] in {
                "process_name",
                "process_sort_index",
                "thread_name",
                "thread_sort_index",
            }
            assert isinstance(event["args"], dict), event
    # Durations on one track nest or follow each other: never a partial overlap.
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            tracks[(event["pid"], event["tid"])].append((event["ts"], event["ts"] + event["dur"]))
    for spans in tracks.values():
        spans.sort()
        for (s1, e1), (s2, e2) in itertools.pairwise(spans):
            assert s2 >= e1 or e2 <= e1, (s1, e1, s2, e2)
    json.dumps(document)  # JSON all the way down
    return events


def counters(events: list[dict[str, Any]], location: str) -> list[dict[str, int]]:
    return [e["args"] for e in events if e["ph"] == "C" and e["name"] == f"{location} bytes"]


def durations(events: list[dict[str, Any]], category: str) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "X" and e.get("cat") == category]


def tensor(kib: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.full((kib * 256,), float(seed))


async def test_copies_leases_holds_reservations_and_counters_are_on_the_timeline(
    tmp_path: Path,
) -> None:
    async with ResidencyManager(budgets={"cuda:0": 16 * KiB}, backend="sim") as m:
        h = m.register(tensor(), name="w")
        await m.move(h, "cuda:0")
        async with m.acquire(h, "cuda:0"):
            pass
        m.hold(h, "cuda:0").release()
        async with m.scope(ResidencyPlan(reserve=[MemoryReservation("kv", "cuda:0", 8 * KiB)])):
            pass
        await m.move(h, "pinned-host")
        path = m.export_timeline(tmp_path / "timeline.json")
        snap = m.snapshot()
    events = validate(json.loads(path.read_text()))
    names = [e["name"] for e in durations(events, "transfer")]
    assert names == ["move pageable-host -> cuda:0", "move cuda:0 -> pinned-host"]
    assert all(e["args"]["outcome"] == "committed" for e in durations(events, "transfer"))
    assert [e["name"] for e in durations(events, "lease")] == ["lease @ cuda:0"]
    assert [e["name"] for e in durations(events, "hold")] == ["hold @ cuda:0"]
    (reservation,) = durations(events, "reservation")
    assert reservation["args"]["bytes"] == 8 * KiB and reservation["name"].startswith("kv ")
    cuda = counters(events, "cuda:0")
    assert max(c["used"] + c["reserved"] for c in cuda) == snap.location("cuda:0").peak_bytes
    assert max(c["reserved"] for c in cuda) == 8 * KiB
    for location, record in snap.locations.items():
        last = counters(events, str(location))[-1]
        assert (last["used"], last["reserved"]) == (record.used_bytes, record.reserved_bytes)
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert "w #1" in threads


async def test_a_trace_that_overwrote_its_start_still_gives_absolute_counters() -> None:
    async with ResidencyManager(backend="sim", trace_capacity=3) as m:
        values = [m.register(tensor(seed=i), name=f"v{i}") for i in range(3)]
        for h in values:
            await m.move(h, "cuda:0")
        trace, snap = m.trace(), m.snapshot()
    assert trace.overwritten
    events = validate(timeline_document(trace, snap))
    cuda = counters(events, "cuda:0")
    assert cuda[-1]["used"] == snap.location("cuda:0").used_bytes == 12 * KiB
    assert cuda[0]["used"] == 12 * KiB - sum(
        t.nbytes for t in trace.transitions if str(t.location) == "cuda:0"
    )
    # The move whose begin the ring dropped starts at the first kept entry, and says so.
    assert any(e["args"].get("begin_overwritten") for e in durations(events, "transfer"))


async def test_counters_drop_at_each_location_a_discarded_value_was_charged() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="r", replica_mode=ReplicaMode.REPLICABLE)
        await m.materialize(h, "cuda:0")
        await m.discard(h)
        trace, snap = m.trace(), m.snapshot()
    for document in (timeline_document(trace, snap), timeline_document(trace, None)):
        events = validate(document)
        for location in ("pageable-host", "cuda:0"):
            used = [c["used"] for c in counters(events, location)]
            assert max(used) == 4 * KiB and min(used) == 0 and used[-1] == 0, (location, used)


async def test_a_timeline_of_a_disabled_trace_says_what_it_lacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """With trace_capacity=0 the file held the charges and no transition, and nothing said
    why: export_timeline logs a warning, and the command line prints a note."""
    from aresidency.diagnosis.cli import main

    async with ResidencyManager(backend="sim", trace_capacity=0) as m:
        await m.move(m.register(tensor(), name="w"), "cuda:0")
        with caplog.at_level("WARNING", logger="aresidency"):
            path = m.export_timeline(tmp_path / "timeline.json")
        dump = m.dump(tmp_path / "dump.json")
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "trace was disabled (trace_capacity=0)" in caplog.records[0].getMessage()
    assert counters(validate(json.loads(path.read_text())), "cuda:0")[-1]["used"] == 4 * KiB
    assert main(["timeline", str(dump), str(tmp_path / "again.json")]) == 0
    assert "note: the trace was disabled (trace_capacity=0)" in capsys.readouterr().out


async def test_an_aborted_copy_is_a_duration_that_says_so() -> None:
    async with ResidencyManager(backend="sim") as m:
        h = m.register(tensor(), name="w")
        m.backend.faults.fail_transfer_at = 1
        with pytest.raises(Exception, match="injected"):
            await m.move(h, "cuda:0")
        events = validate(timeline_document(m.trace(), m.snapshot()))
    (copy,) = durations(events, "transfer")
    assert copy["args"]["outcome"] == "aborted" and copy["name"].endswith("(aborted)")


async def test_a_streamed_module_run_exports_a_valid_timeline_within_its_budget(
    tmp_path: Path,
) -> None:
    model = sequential(n=8)
    x = torch.randn(4, 32)
    budget = 16 * KiB
    async with ResidencyManager(budgets={"cuda:0": budget}, backend="sim") as m:
        streamed = stream_module(m, model, "cuda:0", prefetch=2, ring=False)  # values: tracks
        with torch.no_grad():
            await streamed(x)
        await streamed.drain()
        path = m.export_timeline(tmp_path / "stream.json")
        trace, snap = m.trace(), m.snapshot()
        handles = streamed.handles
    assert trace.overwritten == 0
    events = validate(json.loads(path.read_text()))
    # Values as tracks: one named track per block's value, and each block's copies on its own.
    tracks = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert {f"{h.name} #{h.value_id}" for h in handles} <= set(tracks.values())
    for h in handles:
        track = f"{h.name} #{h.value_id}"  # more lanes, " [2]" ..., where intervals overlap
        mine = [
            e
            for e in durations(events, "transfer")
            if tracks[(e["pid"], e["tid"])].partition(" [")[0] == track
        ]
        assert len(mine) == sum(
            1 for t in trace.transitions if t.handle == h and t.kind.endswith("_begin")
        )
    # Microseconds from the first kept transition, as the format wants.
    by_seq = {t.seq: t for t in trace.transitions}
    t0 = trace.transitions[0].time_ns
    for e in durations(events, "transfer"):
        begin, end = by_seq[e["args"]["begin_seq"]], by_seq[e["args"]["end_seq"]]
        assert e["ts"] == pytest.approx((begin.time_ns - t0) / 1000)
        assert e["dur"] == pytest.approx((end.time_ns - begin.time_ns) / 1000)
    # A counter per location the manager knows, ending at its charge.
    assert {e["name"] for e in events if e["ph"] == "C"} == {
        f"{location} bytes" for location in snap.locations
    }
    copies = durations(events, "transfer")
    begun = [t for t in trace.transitions if t.kind in ("copy_begin", "move_begin", "load_begin")]
    assert len(copies) == len(begun) >= 4  # every block came to the device
    assert all(e["name"].endswith("-> cuda:0") or "cuda:0 ->" in e["name"] for e in copies)
    assert durations(events, "lease")  # the blocks were read under leases
    charged = [c["used"] + c["reserved"] for c in counters(events, "cuda:0")]
    assert max(charged) <= budget
    assert max(charged) == snap.location("cuda:0").peak_bytes
    assert charged[-1] == snap.location("cuda:0").charged_bytes
