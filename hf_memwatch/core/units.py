"""Byte quantities: parse what users type (``"20GiB"``, ``"500MB"``, ``0.8``) and print them back."""

from __future__ import annotations

import re

from .errors import MemWatchConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


#: Sizes above this are no device's or host's memory: 1 PiB. The largest accelerators hold
#: 288 GB (2025-26 HBM parts) and the largest single hosts tens of TiB, so a budget of 2**50 bytes or
#: more is a typo ("1e30", a number of bits, a unit pasted twice), rejected with this reason.
MAX_PLAUSIBLE_BYTES = 2**50
_FRACTION = re.compile(r"^\s*(0?\.[0-9]+|1(?:\.0*)?)\s*$")  # "0.5", ".8", "1.0": a fraction as text


def parse_bytes(value: int | float | str, *, capacity: int | None = None, what: str = "budget") -> int:
    """Turn ``value`` into a byte count.

    Integers are bytes; strings carry a unit (decimal ``MB``/``GB`` or binary ``MiB``/``GiB``);
    a float in (0, 1] — or a string such as ``"0.5"`` — is a fraction of ``capacity``. Sizes of
    :data:`MAX_PLAUSIBLE_BYTES` or more are rejected (no device or host has that much).

    Example:
        >>> parse_bytes("1.5GiB")
        1610612736
        >>> parse_bytes(0.5, capacity=1000), parse_bytes("0.5", capacity=1000)
        (500, 500)
        >>> parse_bytes("1e30")
        Traceback (most recent call last):
        ...
        hf_memwatch.core.errors.MemWatchConfigError: budget '1e30' is 1e+30 bytes, more than any device or host has (1 PiB); give a size such as '20GiB'
    """
    if isinstance(value, bool):
        raise MemWatchConfigError(f"{what} must be bytes, a size such as '20GiB', or a fraction; got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise MemWatchConfigError(f"{what} must be positive; got {value}")
        return _plausible(value, value, what)
    if isinstance(value, str) and _FRACTION.match(value):
        value = float(value)
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:  # NaN fails this too
            raise MemWatchConfigError(
                f"{what} as a float is a fraction of device memory in (0, 1]; got {value}. "
                "Pass an int for bytes or a string such as '20GiB'."
            )
        if capacity is None:
            raise MemWatchConfigError(f"{what} fraction {value} needs a known device capacity")
        return max(1, int(value * capacity))
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise MemWatchConfigError(
                f"cannot parse {what} {value!r}: expected a number with an optional unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '20GiB', or a fraction such as '0.8'"
            )
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if not number >= 1:
            raise MemWatchConfigError(f"{what} must be at least 1 byte; got {value!r}")
        return _plausible(number, value, what)
    raise MemWatchConfigError(f"{what} must be bytes, a size such as '20GiB', or a fraction; got {value!r}")


def fraction_of(value: object) -> float | None:
    """``value`` as a fraction when it is one (a float, or text such as ``"0.5"``), else None.

    Example:
        >>> fraction_of(0.8), fraction_of("0.5"), fraction_of("20GiB"), fraction_of(3)
        (0.8, 0.5, None, None)
    """
    if isinstance(value, float):
        return value
    if isinstance(value, str) and _FRACTION.match(value):
        return float(value)
    return None


def _plausible(number: float, given: object, what: str) -> int:
    if number >= MAX_PLAUSIBLE_BYTES:
        raise MemWatchConfigError(
            f"{what} {given!r} is {number:.3g} bytes, more than any device or host has (1 PiB); "
            "give a size such as '20GiB'"
        )
    return int(number)


def format_bytes(n: int | float | None, precision: int = 2) -> str:
    """Human-readable binary size.

    Example:
        >>> format_bytes(3 * 2**30)
        '3.00 GiB'
    """
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.{precision}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
