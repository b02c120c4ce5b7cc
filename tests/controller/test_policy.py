"""Fallback graphs, the cost model, and the request records."""

from __future__ import annotations

import math

import pytest

from aresidency.controller import (
    CostModel,
    Eviction,
    FallbackGraph,
    ResidencyRequest,
    ResidencyRequirement,
)
from aresidency.core import Location, MemoryReservation, ResidencyState

CUDA0 = Location.parse("cuda:0")
CUDA3 = Location.parse("cuda:3")
PINNED = Location.parse("pinned-host")
PAGEABLE = Location.parse("pageable-host")


def test_default_graph_is_the_memory_hierarchy() -> None:
    graph = FallbackGraph.default()
    assert graph.destinations(CUDA0) == (PINNED, PAGEABLE)
    assert graph.destinations(CUDA3) == (PINNED, PAGEABLE)
    assert graph.destinations(PINNED) == (PAGEABLE,)
    assert graph.destinations(PAGEABLE) == ()
    assert graph.allow_drop
    assert graph == FallbackGraph.default()
    assert graph != FallbackGraph.default(allow_drop=False)
    assert "cuda:* -> pinned-host | pageable-host" in str(graph)
    hash(graph)


def test_graph_entries_for_one_gpu_override_the_wildcard() -> None:
    graph = FallbackGraph({"cuda:*": ["pinned-host"], "cuda:1": ["cuda:0", "pinned-host"]})
    assert graph.destinations(Location.parse("cuda:1")) == (CUDA0, PINNED)
    assert graph.destinations(CUDA0) == (PINNED,)


@pytest.mark.parametrize(
    ("edges", "match"),
    [
        ({"cuda:0": ["cuda:1"], "cuda:1": ["cuda:0"]}, "cycle"),
        ({"pinned-host": ["pageable-host"], "pageable-host": ["pinned-host"]}, "cycle"),
        ({"cuda:*": ["cuda:0"]}, "host tiers"),
        ({"cuda:0": ["cuda:0"]}, "itself"),
        ({"cuda:0": ["pinned-host", "pinned-host"]}, "repeats"),
        ({"gpu": ["pinned-host"]}, "unknown location"),
    ],
)
def test_bad_graphs_are_refused(edges: dict[str, list[str]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FallbackGraph(edges)


def test_cycle_through_the_wildcard_is_refused() -> None:
    with pytest.raises(ValueError, match="cycle"):
        FallbackGraph({"cuda:*": ["pinned-host"], "pinned-host": ["cuda:0"]})


def test_bandwidth_lookup_prefers_exact_pairs_then_kinds() -> None:
    cost = CostModel()
    assert cost.bandwidth(PINNED, CUDA0) == 55e9
    assert cost.bandwidth(CUDA0, CUDA0) == math.inf
    tuned = cost.with_bandwidth("pinned-host", "cuda:0", 20e9)
    assert tuned.bandwidth(PINNED, CUDA0) == 20e9
    assert tuned.bandwidth(PINNED, CUDA3) == 55e9
    measured = cost.with_measurement("cuda", "pinned-host", 1 << 30, 0.5)
    assert measured.bandwidth(CUDA3, PINNED) == (1 << 30) / 0.5
    assert cost.bandwidth(CUDA0, CUDA3) == 50e9
    with pytest.raises(ValueError):
        cost.with_bandwidth("cuda", "pinned-host", 0)
    with pytest.raises(ValueError):
        CostModel(recency_half_life=-1)


def test_reuse_weight_halves_every_half_life_and_costs_grow_with_it() -> None:
    cost = CostModel(recency_half_life=10)
    assert cost.reuse_weight(100, 100) == 1.0
    assert cost.reuse_weight(90, 100) == 0.5
    assert cost.reuse_weight(80, 100) == 0.25
    now, restore = cost.move_coefficients(CUDA0, PINNED)
    recent = CostModel.option_seconds(1 << 20, now, restore, 1.0)
    old = CostModel.option_seconds(1 << 20, now, restore, 0.25)
    assert recent > old > 0
    rebuild = cost.release_restore(CUDA0, (), PAGEABLE)
    assert rebuild == pytest.approx(1 / 2e9 + 1 / 30e9)
    assert cost.release_restore(CUDA0, (PINNED,), PAGEABLE) == pytest.approx(1 / 55e9)
    assert cost.release_restore(CUDA0) == math.inf


def test_requirement_and_request_validate_their_shape() -> None:
    state = ResidencyState()
    handle = state.register(name="w", charge_bytes=512, location="pageable-host")
    req = ResidencyRequirement(handle, "cuda:0", ["pinned-host"])
    assert req.alternatives == (CUDA0, PINNED)
    assert str(req) == "(w, cuda:0 | pinned-host)"
    assert ResidencyRequirement(handle, "cuda:0", "pinned-host").fallbacks == (PINNED,)
    with pytest.raises(ValueError, match="twice"):
        ResidencyRequirement(handle, "cuda:0", ["cuda:0"])
    with pytest.raises(TypeError):
        ResidencyRequirement("w", "cuda:0")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ResidencyRequirement(handle, "gpu0")
    request = ResidencyRequest("r", [(handle, "cuda:0")])
    assert request.requirements == (ResidencyRequirement(handle, "cuda:0"),)
    assert request.handles() == (handle,)
    with pytest.raises(ValueError, match="non-empty"):
        ResidencyRequest("")
    with pytest.raises(TypeError):
        ResidencyRequest("r", ["cuda:0"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="twice"):
        ResidencyRequest(
            "r",
            reservations=[
                MemoryReservation("kv", "cuda:0", 1),
                MemoryReservation("kv", "cuda:0", 2),
            ],
        )
    with pytest.raises(AttributeError):
        request.name = "other"  # type: ignore[misc]
    hash(request)


def test_eviction_says_whether_it_dropped() -> None:
    state = ResidencyState()
    handle = state.register(name="w", charge_bytes=512, location="cuda:0")
    dropped = Eviction(handle, CUDA0, 512, None, "because")
    moved = Eviction(handle, CUDA0, 512, PINNED, "because")
    assert dropped.dropped and not moved.dropped
    assert "dropped" in str(dropped) and "-> pinned-host" in str(moved)
