"""What users write in options and configuration: ranges, sizes, regular expressions.

Examples:
    >>> parse_ranges("0-3,7")
    frozenset({0, 1, 2, 3, 7})
    >>> parse_size("2GiB", "--max-pending")
    2147483648
    >>> format_size(2147483648)
    '2GiB'
"""

from __future__ import annotations

import re

from tdiff.errors import TdiffError

_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", re.IGNORECASE)


def parse_ranges(text: str | None, what: str = "range") -> frozenset[int] | None:
    """Parse "0-3,7" into a set of integers; None or "" means no restriction."""
    if text is None or str(text).strip() in ("", "all"):
        return None
    values: set[int] = set()
    for piece in str(text).split(","):
        match = _RANGE.fullmatch(piece)
        if not match:
            raise TdiffError(f"{what} {text!r} is not a list of ranges like 0-3,7")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise TdiffError(f"{what} {text!r}: range {piece.strip()!r} runs backwards")
        values.update(range(lo, hi + 1))
    return frozenset(values)


def format_ranges(values) -> str:
    """The inverse of :func:`parse_ranges`: {0, 1, 2, 3, 7} reads "0-3,7"."""
    runs: list[list[int]] = []
    for value in sorted(values):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def compile_patterns(patterns, what: str) -> tuple[re.Pattern, ...]:
    compiled = []
    for pattern in patterns or ():
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise TdiffError(f"{what} {pattern!r} is not a valid regular expression: {exc}") from None
    return tuple(compiled)


def parse_size(text: str, what: str) -> int:
    """'2GiB', '512M', '4096' style sizes in bytes (k/m/g/t are powers of 1024)."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise TdiffError(f"{what} {text!r} is not a size like 512M or 2GiB")
    scale = 1024 ** "_kmgt".index(match.group(2).lower() or "_")
    return int(float(match.group(1)) * scale)


def format_size(nbytes: int) -> str:
    """A size as :func:`parse_size` reads it, in the largest unit that divides it: 2 << 30 reads "2GiB"."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes and not nbytes % (1 << shift):
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)
