"""Location: parsing, ordering, hashing, printing, and clear refusals."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aresidency.core import PAGEABLE_HOST, PINNED_HOST, Location


@pytest.mark.parametrize(
    ("text", "kind", "index"),
    [
        ("pageable-host", "pageable-host", None),
        ("pinned-host", "pinned-host", None),
        ("cuda:0", "cuda", 0),
        ("cuda:1", "cuda", 1),
        ("cuda:15", "cuda", 15),
    ],
)
def test_location_parses_from_its_string_and_prints_the_same_string(text, kind, index):
    location = Location.parse(text)
    assert (location.kind, location.index) == (kind, index)
    assert str(location) == text
    assert Location.parse(str(location)) == location
    assert repr(location) == f"Location({text!r})"


@pytest.mark.parametrize("text", ["pageable-host", "pinned-host", "cuda:0", "cuda:12"])
def test_a_locations_repr_builds_the_same_location(text):
    """Snapshots, explanations and errors print ``Location('cuda:0')``: pasting that back gives
    the location (it was refused as an "unknown location kind 'cuda:0'")."""
    location = Location.parse(text)
    again = eval(repr(location), {"Location": Location})
    assert again == location and hash(again) == hash(location)
    assert (again.kind, again.index) == (location.kind, location.index)
    assert Location(torch.device("cuda:3")) == Location("cuda", 3)
    assert Location(torch.device("cpu")) == PAGEABLE_HOST


@pytest.mark.parametrize(("value", "words"), [("cpu", "torch's 'cpu'"), ("gpu:0", "cuda:N")])
def test_one_bad_argument_to_the_constructor_is_refused_as_parse_refuses_it(value, words):
    with pytest.raises(ValueError, match=words):
        Location(value)


def test_torch_cpu_device_is_pageable_host():
    assert Location.parse(torch.device("cpu")) == PAGEABLE_HOST


@pytest.mark.parametrize("index", [0, 1, 7])
def test_torch_cuda_device_with_index_is_cuda_n(index):
    assert Location.parse(torch.device("cuda", index)) == Location("cuda", index)
    assert Location.parse(torch.device(f"cuda:{index}")) == Location.parse(f"cuda:{index}")


def test_torch_cuda_device_without_index_is_refused_rather_than_guessed():
    with pytest.raises(ValueError, match="no index"):
        Location.parse(torch.device("cuda"))


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_unsupported_torch_device_type_is_a_value_error_naming_the_type(device):
    with pytest.raises(ValueError, match=device):
        Location.parse(torch.device(device))


def test_parsing_a_location_returns_it_unchanged():
    location = Location.parse("cuda:3")
    assert Location.parse(location) is location


@pytest.mark.parametrize(
    "text",
    [
        "",
        # an explicit id: a bare "cuda" id would count as the `cuda` marker in tests/conftest.py
        pytest.param("cuda", id="bare-cuda-word"),
        "cuda:",
        "cuda:-1",
        "cuda:01",
        "cuda:1.0",
        "cuda:x",
        "CUDA:0",
        "Cuda:0",
        " cuda:0",
        "cuda:0 ",
        "cuda: 0",
        "cpu",
        "host",
        "pinned_host",
        "pageable",
        "Pinned-Host",
        "gpu:0",
    ],
)
def test_bad_location_string_is_a_value_error_that_names_the_value(text):
    with pytest.raises(ValueError) as info:
        Location.parse(text)
    assert repr(text) in str(info.value)
    assert "cuda:N" in str(info.value)  # says what would have been accepted


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        pytest.param("cuda", "write 'cuda:0'", id="bare-cuda-word"),
        ("CUDA", "write 'cuda:0'"),
        ("cpu", "'pageable-host' (torch's 'cpu')"),
        (" CPU", "'pageable-host' (torch's 'cpu')"),
    ],
)
def test_torchs_device_names_get_a_hint_at_the_location_meant(text, hint):
    with pytest.raises(ValueError, match="unknown location") as info:
        Location.parse(text)
    assert hint in str(info.value)


def test_other_bad_strings_get_no_torch_hint():
    with pytest.raises(ValueError) as info:
        Location.parse("gpu:0")
    assert "torch" not in str(info.value) and "write" not in str(info.value)


@pytest.mark.parametrize("value", [0, 1.5, None, b"cuda:0", ("cuda", 0), object()])
def test_non_location_objects_are_a_value_error_that_names_the_value(value):
    with pytest.raises(ValueError) as info:
        Location.parse(value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("kind", "index"),
    [("cuda", None), ("cuda", -1), ("cuda", True), ("cuda", 1.0), ("pinned-host", 0), ("gpu", 0)],
)
def test_direct_construction_with_an_invalid_kind_or_index_is_refused(kind, index):
    with pytest.raises(ValueError):
        Location(kind, index)


def test_locations_are_totally_ordered_host_kinds_first_then_cuda_by_index():
    parsed = [Location.parse(t) for t in ["cuda:10", "pinned-host", "cuda:2", "pageable-host"]]
    assert [str(loc) for loc in sorted(parsed)] == [
        "pageable-host",
        "pinned-host",
        "cuda:2",
        "cuda:10",  # by index, not by string
    ]
    a, b = Location.parse("cuda:0"), Location.parse("cuda:1")
    assert a < b and a <= b and b > a and b >= a and a <= a and a >= a
    assert not (a < a) and not (a > a)
    assert PAGEABLE_HOST < PINNED_HOST < a


def test_comparing_a_location_with_a_non_location_is_a_type_error():
    with pytest.raises(TypeError):
        _ = Location.parse("cuda:0") < "cuda:1"


def test_equal_locations_hash_equal_and_work_as_dict_keys():
    a = Location.parse("cuda:1")
    b = Location.parse(torch.device("cuda:1"))
    assert a == b and hash(a) == hash(b)
    assert len({a, b, Location.parse("cuda:0")}) == 2
    assert {a: 1}[b] == 1
    assert Location.parse("pinned-host") != Location.parse("pageable-host")


def test_a_location_formats_as_its_string_with_any_str_format_spec():
    """It prints as its string, so a table row (``f"{loc:<14}{used:>12}"``, a log format)
    pads it as that string; a format spec was ``TypeError: unsupported format string passed
    to Location.__format__``."""
    location = Location.parse("cuda:0")
    assert f"{location}" == "cuda:0" and f"{location!s:>8}" == "  cuda:0"
    assert f"{location:<14}|" == "cuda:0        |"
    assert f"{PINNED_HOST:^15}" == "  pinned-host  "
    assert format(PAGEABLE_HOST, ".4") == "page"
    with pytest.raises(ValueError):
        format(location, "d")  # not a spec a str takes


def test_a_location_is_immutable_and_pickles_to_an_equal_location():
    location = Location.parse("cuda:2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        location.index = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(location)) == location


def test_kind_predicates_and_device_index():
    cuda = Location.parse("cuda:4")
    assert cuda.is_cuda and not cuda.is_host and not cuda.is_pinned and cuda.device_index == 4
    assert PINNED_HOST.is_host and PINNED_HOST.is_pinned and not PINNED_HOST.is_cuda
    assert PAGEABLE_HOST.is_host and not PAGEABLE_HOST.is_pinned
    with pytest.raises(ValueError, match="not a cuda location"):
        _ = PAGEABLE_HOST.device_index


@given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=0, max_value=10**6))
def test_cuda_locations_round_trip_and_order_by_index(i, j):
    a, b = Location.parse(f"cuda:{i}"), Location.parse(f"cuda:{j}")
    assert str(a) == f"cuda:{i}"
    assert (a < b) == (i < j) and (a == b) == (i == j)
    assert a > PINNED_HOST
