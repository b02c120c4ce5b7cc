"""Byte sizes: parse_nbytes's accepted and refused forms, format_nbytes against torch's own
memory_summary formatter, and accelerate's max_memory converted to budgets."""

from __future__ import annotations

import ast
import math
import re
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aresidency.core.sizes import (
    BINARY_UNITS,
    BYTE_UNITS,
    SI_UNITS,
    budgets_from_max_memory,
    format_nbytes,
    parse_nbytes,
)

GiB = 1024**3

# --- parse_nbytes: accepted forms ------------------------------------------------------------


def test_binary_units_are_powers_of_1024():
    assert dict(BINARY_UNITS) == {
        "KiB": 1024,
        "MiB": 1024**2,
        "GiB": 1024**3,
        "TiB": 1024**4,
        "PiB": 1024**5,
    }


def test_si_units_are_powers_of_1000():
    assert dict(SI_UNITS) == {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}


def test_byte_units_hold_bytes_and_every_si_and_binary_unit():
    assert dict(BYTE_UNITS) == {"B": 1, **SI_UNITS, **BINARY_UNITS}


def test_unit_tables_cannot_be_changed():
    with pytest.raises(TypeError):
        BYTE_UNITS["GB"] = 1  # type: ignore[index]


@pytest.mark.parametrize("value", [0, 1, 1024, 10 * GiB, 2**70 + 1, 10**30 + 7])
def test_a_non_negative_int_is_that_many_bytes(value):
    assert parse_nbytes(value) == value


def test_an_integer_type_with_index_such_as_numpy_int64_is_accepted():
    np = pytest.importorskip("numpy")
    result = parse_nbytes(np.int64(4096))
    assert result == 4096
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "expected"), [(10.5e9, 10_500_000_000), (1e6, 1_000_000), (0.0, 0), (4096.0, 4096)]
)
def test_a_whole_float_is_that_many_bytes(value, expected):
    result = parse_nbytes(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MB", 512 * 10**6),
        ("10 GiB", 10 * GiB),
        ("1.5GiB", 1_610_612_736),
        ("64gb", 64 * 10**9),
        ("1024", 1024),
        ("100 B", 100),
        ("  7 kib  ", 7 * 1024),
        ("3KB", 3000),
        ("2 TB", 2 * 10**12),
        ("1 TiB", 1024**4),
        ("1PB", 10**15),
        ("1 PiB", 1024**5),
        ("5 MiB", 5 * 1024**2),
        ("0.5 KiB", 512),
        ("0", 0),
        ("2.0 b", 2),
    ],
)
def test_a_string_with_a_number_and_a_unit_is_parsed(text, expected):
    result = parse_nbytes(text)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize("unit", ["gib", "GIB", "GiB", "gIb"])
def test_units_are_case_insensitive(unit):
    assert parse_nbytes(f"2{unit}") == 2 * GiB


def test_decimal_strings_are_evaluated_exactly_not_through_float():
    # 1.1 * 1e9 in float is 1100000000.0000002; the answer must be the exact integer.
    assert parse_nbytes("1.1GB") == 1_100_000_000
    assert parse_nbytes("0.1 KB") == 100
    assert parse_nbytes("123456789.123456789 GB") == 123_456_789_123_456_789


# --- parse_nbytes: refused forms -------------------------------------------------------------


@pytest.mark.parametrize("value", [True, False])
def test_a_bool_is_not_a_size(value):
    with pytest.raises(TypeError, match=r"size must be a byte count.*got (True|False) \(a bool"):
        parse_nbytes(value)


@pytest.mark.parametrize("value", [None, [1024], b"10GB", {"GB": 1}, 1j])
def test_a_value_of_another_type_is_a_type_error_naming_it(value):
    with pytest.raises(TypeError, match=r"size must be a byte count: an int >= 0.*'512MB'.*got"):
        parse_nbytes(value)


@pytest.mark.parametrize("value", [-1, -1.0, "-5MB", " -1 ", -(2**40)])
def test_a_negative_size_is_refused(value):
    with pytest.raises(ValueError, match=r"must be a byte count.*\(negative\)"):
        parse_nbytes(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused(value):
    with pytest.raises(ValueError, match=r"got (nan|inf|-inf) \(not a finite number\)"):
        parse_nbytes(value)


@pytest.mark.parametrize("value", [1.5, 0.1, 1e-9])
def test_a_fractional_float_is_refused(value):
    with pytest.raises(ValueError, match=r"not a whole number of bytes"):
        parse_nbytes(value)


@pytest.mark.parametrize(
    ("text", "fraction"), [("0.3B", "3/10"), ("1.5", "3/2"), ("0.0001KB", "1/10")]
)
def test_a_string_that_is_not_a_whole_number_of_bytes_is_refused(text, fraction):
    with pytest.raises(ValueError, match=rf"that is {fraction} bytes, not a whole number"):
        parse_nbytes(text)


def test_a_decimal_string_that_comes_to_whole_bytes_is_accepted():
    assert parse_nbytes("0.001KB") == 1
    assert parse_nbytes("0.25 KiB") == 256


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("10GiBs", "unknown unit 'GiBs'"),
        ("10 gigs", "unknown unit 'gigs'"),
        ("10G", "unknown unit 'G'"),
        ("1.5 kB/s", "not a number followed by a unit"),
        ("G", "not a number followed by a unit"),
        ("ten GB", "not a number followed by a unit"),
        ("", "not a number followed by a unit"),
        ("1e9", "a string takes no exponent; pass the float itself, or write e.g. '1GB'"),
        ("1.5E+3 MB", "a string takes no exponent"),
        ("10 G iB", "not a number followed by a unit"),
        ("1,024", "not a number followed by a unit"),
        ("-ten GB", "not a number followed by a unit"),
    ],
)
def test_a_string_that_is_not_a_number_and_a_known_unit_is_refused(text, problem):
    with pytest.raises(ValueError, match=re.escape(f"got {text!r} ({problem}")):
        parse_nbytes(text)


def test_the_error_names_what_and_the_value_and_lists_what_is_accepted():
    with pytest.raises(ValueError) as caught:
        parse_nbytes("10 gigs", "budget for cuda:0")
    message = str(caught.value)
    assert message.startswith("budget for cuda:0 must be a byte count: an int >= 0")
    for accepted in (
        "'512MB'",
        "'10 GiB'",
        "KB",
        "GiB",
        "powers of 1024",
        "a bare number is bytes",
    ):
        assert accepted in message
    assert message.endswith("got '10 gigs' (unknown unit 'gigs')")


@pytest.mark.parametrize("value", [0, 0.0, "0", "0 GiB", "0.0MB"])
def test_zero_is_refused_when_not_allowed(value):
    assert parse_nbytes(value) == 0
    with pytest.raises(ValueError) as refused:
        parse_nbytes(value, "chunk", allow_zero=False)
    # Said plainly: not the accepted forms' list, whose "an int >= 0" would contradict it.
    assert str(refused.value) == (
        f"chunk must be a byte count greater than 0 here, such as '512MB', '1 GiB' or 4096; "
        f"got {value!r}"
    )


def test_a_positive_size_is_accepted_when_zero_is_not_allowed():
    assert parse_nbytes("1B", allow_zero=False) == 1


@given(st.integers(min_value=0, max_value=2**80))
def test_an_integer_string_with_a_unit_round_trips(n):
    assert parse_nbytes(f"{n}B") == n
    assert parse_nbytes(f"{n}KiB") == n * 1024
    assert parse_nbytes(f"{n} gb") == n * 10**9
    assert parse_nbytes(str(n)) == n


@given(st.integers(min_value=0, max_value=10**12), st.integers(min_value=0, max_value=999))
def test_a_three_decimal_kb_string_is_exact(whole, thousandths):
    assert parse_nbytes(f"{whole}.{thousandths:03d}KB") == whole * 1000 + thousandths


# --- format_nbytes ---------------------------------------------------------------------------


def _torch_format_size() -> Callable[[int, int], str]:
    """torch's own formatter. In the supported torch versions it is a closure-free function
    nested in ``torch.cuda.memory.memory_summary``; rebuild it from that function's code."""
    import torch.cuda.memory as memory

    found = getattr(memory, "_format_size", None)
    if found is not None:
        return found  # type: ignore[no-any-return]
    for const in memory.memory_summary.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "_format_size":
            assert not const.co_freevars, "torch's _format_size now uses a closure"
            return types.FunctionType(const, {})  # type: ignore[return-value]
    raise AssertionError("torch.cuda.memory.memory_summary no longer has a _format_size")


def _interesting_sizes() -> list[int]:
    sizes = set(range(0, 2049))
    for power in range(1, 6):
        unit = 1024**power
        for base in (1, 767, 768, 769, 1000, 1023, 1024, 786431, 786432, 786433):
            for delta in (-1, 0, 1, unit // 2):
                sizes.add(max(0, base * unit + delta))
    sizes.update({10**n for n in range(25)} | {10**n - 1 for n in range(1, 25)})
    sizes.update({3 * 2**58 - 1, 3 * 2**58, 3 * 2**58 + 1, 2**70, 2**80})
    return sorted(sizes)


def test_format_nbytes_matches_torch_memory_summary_over_many_sizes():
    torch_format = _torch_format_size()
    sizes = _interesting_sizes()
    assert len(sizes) > 2000
    mismatches = [
        (n, format_nbytes(n), torch_format(n, n))
        for n in sizes
        if format_nbytes(n) != " ".join(torch_format(n, n).split())
    ]
    assert not mismatches


@given(st.integers(min_value=0, max_value=2**64))
def test_format_nbytes_matches_torch_for_random_sizes(n):
    assert format_nbytes(n) == " ".join(_torch_format_size()(n, n).split())


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (767 * 1024, "785408 B"),
        (768 * 1024, "768 KiB"),
        (768 * 1024 + 1023, "768 KiB"),
        (10 * GiB, "10240 MiB"),
        (768 * GiB, "768 GiB"),
        (2048 * 1024**5, "2048 PiB"),
    ],
)
def test_format_nbytes_switches_unit_at_768_of_it_and_rounds_down(nbytes, text):
    assert format_nbytes(nbytes) == text


@pytest.mark.parametrize("nbytes", [1, 512, 768 * 1024, 10 * GiB])
def test_format_nbytes_keeps_the_sign_of_a_negative_count(nbytes):
    assert format_nbytes(-nbytes) == "-" + format_nbytes(nbytes)


@pytest.mark.parametrize("value", [1.0, "512", True, None])
def test_format_nbytes_refuses_anything_but_an_int(value):
    with pytest.raises(TypeError, match=r"format_nbytes needs an int number of bytes, got"):
        format_nbytes(value)


# --- budgets_from_max_memory -----------------------------------------------------------------


def test_accelerate_max_memory_becomes_budgets_by_location():
    budgets = budgets_from_max_memory({0: "10GiB", "cpu": "30GiB"})
    assert budgets == {"pinned-host": 32_212_254_720, "cuda:0": 10_737_418_240}
    assert list(budgets) == ["pinned-host", "cuda:0"]


def test_cpu_can_mean_pageable_host():
    assert budgets_from_max_memory({"cpu": "1GB"}, cpu="pageable-host") == {"pageable-host": 10**9}


@pytest.mark.parametrize("key", [3, "3", "cuda:3"])
def test_every_spelling_of_a_cuda_device_becomes_cuda_n(key):
    assert budgets_from_max_memory({key: 1024}) == {"cuda:3": 1024}


def test_budgets_are_sorted_host_first_then_cuda_by_index():
    budgets = budgets_from_max_memory(
        {
            "cuda:10": "1GB",
            2: 2.0e9,
            "pinned-host": None,
            "1": 5,
            "pageable-host": "1 KiB",
            0: "0",
        }
    )
    assert list(budgets) == [
        "pageable-host",
        "pinned-host",
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:10",
    ]
    assert budgets == {
        "pageable-host": 1024,
        "pinned-host": None,
        "cuda:0": 0,
        "cuda:1": 5,
        "cuda:2": 2 * 10**9,
        "cuda:10": 10**9,
    }


def test_none_means_no_strict_budget():
    assert budgets_from_max_memory({0: None}) == {"cuda:0": None}


def test_the_input_mapping_is_left_alone_and_a_new_dict_returned():
    max_memory: dict[object, object] = {0: "1GiB"}
    budgets = budgets_from_max_memory(max_memory)
    budgets["cuda:1"] = 1
    assert max_memory == {0: "1GiB"}


@pytest.mark.parametrize(
    ("max_memory", "first", "second", "location"),
    [
        ({0: "1GB", "cuda:0": "2GB"}, "0", "'cuda:0'", "cuda:0"),
        ({"1": "1GB", 1: "2GB"}, "'1'", "1", "cuda:1"),
        ({"cpu": "1GB", "pinned-host": "2GB"}, "'cpu'", "'pinned-host'", "pinned-host"),
    ],
)
def test_two_keys_for_one_location_are_refused_naming_both(max_memory, first, second, location):
    with pytest.raises(
        ValueError, match=rf"max_memory keys {first} and {second} both name {location};"
    ):
        budgets_from_max_memory(max_memory)


def test_disk_is_refused_pointing_at_checkpoint_sources():
    with pytest.raises(
        ValueError,
        match=r"key 'disk' is not a location aresidency manages: it manages only host memory "
        r"and CUDA devices.*checkpoint source instead",
    ):
        budgets_from_max_memory({0: "10GiB", "disk": "100GiB"})


@pytest.mark.parametrize("key", ["mps", "xpu", "npu", "cuda", "CPU", "cuda:01", "cuda:-1", ""])
def test_a_key_for_a_place_aresidency_does_not_manage_is_refused(key):
    with pytest.raises(ValueError, match=rf"max_memory key {key!r} is not a location aresidency"):
        budgets_from_max_memory({key: "1GB"})


@pytest.mark.parametrize(("key", "error"), [(-1, ValueError), (True, TypeError), (1.0, TypeError)])
def test_a_key_that_is_not_a_device_index_is_refused(key, error):
    with pytest.raises(error, match=rf"max_memory key {key!r} .*expected a CUDA device as an int"):
        budgets_from_max_memory({key: "1GB"})


def test_a_bad_budget_value_is_refused_naming_its_location_and_key():
    with pytest.raises(
        ValueError, match=r"budget for cuda:0 \(max_memory\[0\]\) must be a byte count.*'10 gigs'"
    ):
        budgets_from_max_memory({0: "10 gigs"})
    with pytest.raises(TypeError, match=r"budget for pinned-host \(max_memory\['cpu'\]\)"):
        budgets_from_max_memory({"cpu": [1]})


@pytest.mark.parametrize("cpu", ["cpu", "cuda:0", "disk", "host"])
def test_cpu_must_name_a_host_location(cpu):
    with pytest.raises(ValueError, match=rf"cpu must be 'pinned-host' or 'pageable-host'.*{cpu!r}"):
        budgets_from_max_memory({"cpu": "1GB"}, cpu=cpu)


def test_max_memory_must_be_a_mapping():
    with pytest.raises(TypeError, match=r"max_memory must be a mapping.*got \[\('cpu', '1GB'\)\]"):
        budgets_from_max_memory([("cpu", "1GB")])  # type: ignore[arg-type]


# --- purity ----------------------------------------------------------------------------------


def test_the_sizes_module_imports_only_the_standard_library():
    import sys

    path = Path(__file__).resolve().parents[2] / "aresidency" / "core" / "sizes.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"sizes.py imports from its own package: {node.module}"
            imported.add((node.module or "").split(".")[0])
    assert imported, "found no imports at all: the check is not looking at sizes.py"
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
