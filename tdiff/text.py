"""Text from dumps and users (tensor names, side labels, error messages) made safe to print:
no terminal escape sequence, no control character, no bidirectional override, on one line.

Examples:
    >>> printable("layer\\x1b[31m.0\\nmlp")
    'layer[31m.0 mlp'
"""

from __future__ import annotations

_SPACES = {ord(c): " " for c in "\n\r\t\v\f"}
_DROPPED = {c: None for c in [*range(0x20), 0x7F, *range(0x80, 0xA0),
                              *range(0x202A, 0x202F), *range(0x2066, 0x206A)]}
_ONE_LINE = {**_DROPPED, **_SPACES}
_KEEP_NEWLINES = {c: None for c in _DROPPED if c != ord("\n")}


def printable(text: object, *, keep_newlines: bool = False) -> str:
    """``text`` without control characters; line breaks become spaces unless ``keep_newlines``."""
    return str(text).translate(_KEEP_NEWLINES if keep_newlines else _ONE_LINE)
