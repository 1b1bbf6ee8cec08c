"""The edit engine: exact, whitespace-tolerant, line-based edits of a function's source text.

A ``match`` is one or more whole lines. Lines are compared with their leading and trailing
whitespace removed and inner runs of whitespace collapsed, so indentation and spacing need not
be copied exactly; everything else must be. A match must occur exactly once. The new lines are
indented like the first matched line (their own relative indentation is kept). Edits apply in
order, each to the text the previous one left.

    >>> apply_edits("def f(x):\\n    y = x + 1\\n    return y\\n",
    ...             [Edit(match="y  =  x + 1", action="replacement", text="y = x + 2")])
    'def f(x):\\n    y = x + 2\\n    return y\\n'
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from tdiff.source_patcher.spec import Edit


class EditError(ValueError):
    pass


def normalize(line: str) -> str:
    return " ".join(line.split())


def apply_edits(text: str, edits: Sequence[Edit], *, first_line: int = 1) -> str:
    """Apply ``edits`` to ``text``; ``first_line`` is the text's line number in its file, for messages."""
    lines = text.splitlines()
    for index, edit in enumerate(edits, 1):
        pattern = [normalize(line) for line in edit.match.strip("\n").splitlines()]
        while pattern and not pattern[-1]:
            pattern.pop()
        while pattern and not pattern[0]:
            pattern.pop(0)
        if not pattern:
            raise EditError(f"edit {index}: match is blank")
        starts = find(lines, pattern)
        shown = edit.match.strip().splitlines()[0]
        if not starts:
            raise EditError(f"edit {index}: match not found: {shown!r}")
        if len(starts) > 1:
            where = ", ".join(str(first_line + s) for s in starts)
            raise EditError(f"edit {index}: match found {len(starts)} times (lines {where}): {shown!r}; "
                            "match more lines to make it unique")
        start, end = starts[0], starts[0] + len(pattern)
        first = lines[start]
        new = indent(edit.text, first[: len(first) - len(first.lstrip())])
        if edit.action == "replacement":
            lines[start:end] = new
        elif edit.action == "prepend":
            lines[start:start] = new
        else:
            lines[end:end] = new
    return "\n".join(lines) + "\n"


def find(lines: list[str], pattern: list[str]) -> list[int]:
    normalized = [normalize(line) for line in lines]
    size = len(pattern)
    return [s for s in range(len(lines) - size + 1) if normalized[s:s + size] == pattern]


def indent(text: str, prefix: str) -> list[str]:
    body = textwrap.dedent(text.strip("\n"))
    return [prefix + line if line.strip() else "" for line in body.splitlines()] if body.strip() else []
