"""Byte sizes as users write them: parsing, printing, and accelerate's ``max_memory`` form.

:func:`parse_nbytes` turns ``10 * 2**30``, ``10.5e9``, ``"512MB"`` or ``"10 GiB"`` into an exact
number of bytes; :func:`format_nbytes` prints a byte count the way
``torch.cuda.memory_summary`` does; :func:`budgets_from_max_memory` converts accelerate's
``max_memory={0: "10GiB", "cpu": "30GiB"}`` into an aresidency budgets mapping keyed by location
strings. This module is pure: it imports only the standard library and never touches a device.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import Final, SupportsIndex, TypeAlias

__all__ = [
    "BINARY_UNITS",
    "BYTE_UNITS",
    "SI_UNITS",
    "ByteSize",
    "budgets_from_max_memory",
    "format_nbytes",
    "parse_nbytes",
]

#: What the API accepts wherever it takes a byte count (budgets, reservations, charges):
#: anything :func:`parse_nbytes` reads, such as ``8 << 30``, ``10.5e9`` or ``"512MB"``.
ByteSize: TypeAlias = SupportsIndex | float | str

#: Decimal (SI) units, powers of 1000, as accelerate and disk vendors use them.
SI_UNITS: Final[Mapping[str, int]] = MappingProxyType(
    {"KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4, "PB": 1000**5}
)
#: Binary (IEC) units, powers of 1024, as PyTorch's memory reports use them.
BINARY_UNITS: Final[Mapping[str, int]] = MappingProxyType(
    {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4, "PiB": 1024**5}
)
#: Every unit :func:`parse_nbytes` accepts (matched case-insensitively), with its size in bytes.
BYTE_UNITS: Final[Mapping[str, int]] = MappingProxyType({"B": 1, **SI_UNITS, **BINARY_UNITS})

# Units are matched case-insensitively, so "64gb" is 64 GB. (accelerate reads a lowercase "b" as
# bits; we do not, because a budget off by 8x silently is worse than one spelled strictly.)
_UNIT_BY_LOWER: Final[Mapping[str, int]] = {name.lower(): size for name, size in BYTE_UNITS.items()}

# A plain decimal number, then an optional unit. No sign, no exponent, no underscores: a budget
# string is read by people, and the smaller the grammar the clearer the error for a typo.
_SIZE_RE: Final = re.compile(
    r"\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*", flags=re.ASCII
)
# Only to explain a refusal: "1e9" looks like a number but is not in the grammar above.
_EXPONENT_RE: Final = re.compile(r"[0-9.]+[eE][+-]?[0-9]", flags=re.ASCII)

_ACCEPTED: Final = (
    "an int >= 0, a float with no fractional part, or a string such as '512MB', '10 GiB' or "
    "'1.5GiB' (units B, KB, MB, GB, TB, PB in powers of 1000 and KiB, MiB, GiB, TiB, PiB in "
    "powers of 1024, any case; a bare number is bytes)"
)

# torch.cuda.memory_summary's prefixes, without the padding it adds to "B".
_TORCH_PREFIXES: Final = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
# torch moves to the next prefix once the value is at least 768 of it.
_TORCH_THRESHOLD: Final = 768 * 1024

_HOST_LOCATIONS: Final = ("pageable-host", "pinned-host")
_CUDA_KEY_RE: Final = re.compile(r"(?:cuda:)?(?P<index>0|[1-9][0-9]*)", flags=re.ASCII)
_ACCEPTED_KEYS: Final = (
    "a CUDA device as an int N, a string 'N' or 'cuda:N'; 'cpu'; 'pageable-host' or 'pinned-host'"
)


def _refuse(what: str, value: object, problem: str) -> str:
    return f"{what} must be a byte count: {_ACCEPTED}; got {value!r} ({problem})"


def parse_nbytes(value: object, what: str = "size", *, allow_zero: bool = True) -> int:
    """Return the exact number of bytes that ``value`` spells.

    Accepts an ``int`` >= 0 (or any integer type with ``__index__``, such as a numpy integer, but
    not a ``bool``); a finite ``float`` >= 0 with no fractional part (``10.5e9``); or a string
    holding a decimal number and an optional unit, with optional whitespace (``"512MB"``,
    ``"10 GiB"``, ``"1.5GiB"``, ``"1024"``). Units are ``B``, the SI units ``KB MB GB TB PB``
    (powers of 1000) and the binary units ``KiB MiB GiB TiB PiB`` (powers of 1024), in any case.
    The string is evaluated exactly (``"1.1GB"`` is 1100000000), and must come to a whole number
    of bytes. ``what`` names the value in error messages, e.g. ``"budget for cuda:0"``.

    Raises ``TypeError`` if ``value`` is of another type (``None``, a ``bool``, a list...), and
    ``ValueError`` if it is negative, not a whole number of bytes, NaN or infinite, a string that
    is not a number with a known unit, or 0 when ``allow_zero`` is false.
    """
    nbytes: int
    if type(value) is int and value > 0:
        # The common case, on hot paths (a reservation per scope): no further checks needed.
        return value
    if isinstance(value, bool):
        # bool is an int subclass, but True is a mistake, not a one-byte budget.
        raise TypeError(_refuse(what, value, "a bool is not a size"))
    if isinstance(value, str):
        nbytes = _parse_string(value, what)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(_refuse(what, value, "not a finite number"))
        if value < 0:
            raise ValueError(_refuse(what, value, "negative"))
        if not value.is_integer():
            raise ValueError(_refuse(what, value, "not a whole number of bytes"))
        nbytes = int(value)
    elif isinstance(value, SupportsIndex):
        try:
            nbytes = operator.index(value)
        except TypeError:
            # A type whose __index__ refuses this value (a float torch tensor): torch's own
            # "only integer tensors ... can be converted to an index" names nothing.
            raise TypeError(
                _refuse(what, value, f"this {type(value).__name__} is not an integer")
            ) from None
        if nbytes < 0:
            raise ValueError(_refuse(what, value, "negative"))
    else:
        raise TypeError(_refuse(what, value, f"a {type(value).__name__} is not a size"))
    if nbytes == 0 and not allow_zero:
        # (not the list of accepted forms: it says an int >= 0, and 0 is one of them)
        raise ValueError(
            f"{what} must be a byte count greater than 0 here, such as '512MB', '1 GiB' or "
            f"4096; got {value!r}"
        )
    return nbytes


def _parse_string(text: str, what: str) -> int:
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        stripped = text.strip()
        if stripped.startswith("-") and _SIZE_RE.fullmatch(stripped[1:]):
            problem = "negative"
        elif _EXPONENT_RE.match(stripped):
            problem = "a string takes no exponent; pass the float itself, or write e.g. '1GB'"
        else:
            problem = "not a number followed by a unit"
        raise ValueError(_refuse(what, text, problem))
    unit = match["unit"]
    multiplier = _UNIT_BY_LOWER.get(unit.lower()) if unit else 1
    if multiplier is None:
        raise ValueError(_refuse(what, text, f"unknown unit {unit!r}"))
    # Fraction, not float: "1.1GB" must be exactly 1100000000 bytes, and "0.3B" must be refused
    # rather than rounded.
    exact = Fraction(match["number"]) * multiplier
    if exact.denominator != 1:
        raise ValueError(_refuse(what, text, f"that is {exact} bytes, not a whole number"))
    return exact.numerator


def format_nbytes(nbytes: int) -> str:
    """Return ``nbytes`` as ``torch.cuda.memory_summary`` prints sizes, without its padding.

    This is torch's rule (``_format_size`` inside ``torch.cuda.memory.memory_summary``): the unit
    is the largest of B, KiB, MiB, GiB, TiB, PiB that the value reaches 768 of, and the number is
    rounded down to a whole count of that unit. So ``512`` is ``"512 B"``, ``768 * 1024`` is
    ``"768 KiB"``, ``767 * 1024`` is ``"785408 B"`` and ``10 * 2**30`` is ``"10240 MiB"``. A
    negative count is printed as its magnitude with a leading ``-`` (torch never sees one).

    Accepts an ``int`` (not a ``bool``); raises ``TypeError`` for anything else.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"format_nbytes needs an int number of bytes, got {nbytes!r}")
    sign = "-" if nbytes < 0 else ""
    size = abs(nbytes)
    # Copied step for step from torch, float division included, so that even counts near a
    # threshold above 2**53 bytes pick the unit torch picks.
    preferred: float = size
    prefix = _TORCH_PREFIXES[0]
    for new_prefix in _TORCH_PREFIXES[1:]:
        if preferred < _TORCH_THRESHOLD:
            break
        prefix = new_prefix
        size //= 1024
        preferred /= 1024
    return f"{sign}{size} {prefix}"


def _location_for_key(key: object, cpu: str) -> str:
    if isinstance(key, bool):
        raise TypeError(f"max_memory key {key!r} is a bool; expected {_ACCEPTED_KEYS}")
    if isinstance(key, int):
        if key < 0:
            raise ValueError(
                f"max_memory key {key!r} is not a device index; expected {_ACCEPTED_KEYS}"
            )
        return f"cuda:{key}"
    if not isinstance(key, str):
        raise TypeError(
            f"max_memory key {key!r} is a {type(key).__name__}; expected {_ACCEPTED_KEYS}"
        )
    if key == "cpu":
        return cpu
    if key in _HOST_LOCATIONS:
        return key
    match = _CUDA_KEY_RE.fullmatch(key)
    if match is not None:
        return f"cuda:{int(match['index'])}"
    hint = ""
    if key == "disk":
        hint = "; disk offload is done with a checkpoint source instead"
    elif key == "cuda":
        hint = "; name the device, e.g. 'cuda:0'"
    raise ValueError(
        f"max_memory key {key!r} is not a location aresidency manages: it manages only host "
        f"memory and CUDA devices, so a key must be {_ACCEPTED_KEYS}{hint}"
    )


def _location_order(location: str) -> tuple[int, int]:
    if location in _HOST_LOCATIONS:
        return (_HOST_LOCATIONS.index(location), 0)
    return (len(_HOST_LOCATIONS), int(location.removeprefix("cuda:")))


def budgets_from_max_memory(
    max_memory: Mapping[object, object], *, cpu: str = "pinned-host"
) -> dict[str, int | None]:
    """Convert accelerate's ``max_memory`` mapping into an aresidency budgets mapping.

    Keys may be a CUDA device as an int ``N``, a digit string ``"N"`` or ``"cuda:N"`` (all become
    ``"cuda:N"``); ``"cpu"``, which becomes the host location named by ``cpu``
    (``"pinned-host"`` by default, or ``"pageable-host"``); or ``"pageable-host"`` /
    ``"pinned-host"`` themselves. Values are anything :func:`parse_nbytes` accepts, or ``None`` for
    no strict budget. Returns a new dict keyed by location strings, ordered pageable-host,
    pinned-host, cuda:0, cuda:1, ... ``{0: "10GiB", "cpu": "30GiB"}`` becomes
    ``{"pinned-host": 32212254720, "cuda:0": 10737418240}``.

    Raises ``TypeError`` if ``max_memory`` is not a mapping, or a key or value is of the wrong
    type; ``ValueError`` if ``cpu`` is not a host location, a key names something aresidency does
    not manage (``"disk"``, ``"mps"``, ``"xpu"``...), two keys name the same location (``0`` and
    ``"cuda:0"``), or a value is not a valid byte count.
    """
    if cpu not in _HOST_LOCATIONS:
        raise ValueError(
            f"cpu must be 'pinned-host' or 'pageable-host' (the host memory that accelerate's "
            f"'cpu' budget applies to); got {cpu!r}"
        )
    if not isinstance(max_memory, Mapping):
        raise TypeError(
            f"max_memory must be a mapping such as {{0: '10GiB', 'cpu': '30GiB'}}; "
            f"got {max_memory!r}"
        )
    budgets: dict[str, int | None] = {}
    key_for: dict[str, object] = {}
    for key, value in max_memory.items():
        location = _location_for_key(key, cpu)
        if location in key_for:
            raise ValueError(
                f"max_memory keys {key_for[location]!r} and {key!r} both name {location}; "
                "give each location one budget"
            )
        key_for[location] = key
        what = f"budget for {location} (max_memory[{key!r}])"
        budgets[location] = None if value is None else parse_nbytes(value, what)
    return {location: budgets[location] for location in sorted(budgets, key=_location_order)}
