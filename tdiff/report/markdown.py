"""The Markdown report, for a pull request: always within GitHub's comment size limit.

    >>> text = render_markdown(report)                  # len(text) <= COMMENT_LIMIT
    >>> text = render_markdown(report, gh_comment=True)  # with a marker to find the comment again

Large reports are summarised, never cut blindly: tables keep their most important rows (the
first divergence, then the worst) and say how many rows they left out.
"""

from __future__ import annotations

import html
import re

from tdiff.report.document import Code, Document, Heading, Inline, Paragraph, Plots, Strong, Table, build_document
from tdiff.report.model import Report
from tdiff.text import printable

COMMENT_LIMIT = 65_536          # GitHub's limit on an issue or pull-request comment, in characters
GH_MARKER = "<!-- tdiff-report -->"
CELL_CHARS = 160                # longer cell text is elided in the middle
PROSE_CHARS = 1_000             # so is longer text in a paragraph (a name, a label)
MIN_ROWS = 5


def render_markdown(report: Report, *, limit: int = COMMENT_LIMIT, gh_comment: bool = False) -> str:
    doc = build_document(report)
    prefix = GH_MARKER + "\n" if gh_comment else ""
    budget = limit - len(prefix)
    caps: dict[int, int | None] = {id(t): None for t in doc.tables}
    text = _render(doc, caps)
    while len(text) > budget:
        shrinkable = [t for t in doc.tables if len(t.kept(caps[id(t)])) > _floor(t)]
        if not shrinkable:
            break
        # folded detail tables give way first, then the largest
        table = max(shrinkable, key=lambda t: (t.folded, len(t.kept(caps[id(t)]))))
        caps[id(table)] = max(_floor(table), len(table.kept(caps[id(table)])) // 2)
        text = _render(doc, caps)
    if len(text) > budget:  # only pathological reports (thousands of columns) get here
        note = "\n\n_(report cut at GitHub's comment size limit; see `tdiff report --format json`)_\n"
        text = text[:budget - len(note)].rsplit("\n", 1)[0] + note
    return prefix + text


def _floor(table: Table) -> int:
    return 0 if table.folded else min(MIN_ROWS, len(table.rows))


def _render(doc: Document, caps: dict[int, int | None]) -> str:
    out = [f"## {_escape(doc.title)}", ""]
    for block in doc.blocks:
        if isinstance(block, Heading):
            out += [f"### {_escape(block.text)}", ""]
        elif isinstance(block, Paragraph):
            out += [inline(block.parts), ""]
        elif isinstance(block, Table):
            out += _table(block, caps[id(block)])
        elif isinstance(block, Plots):
            continue
    return "\n".join(out).rstrip() + "\n"


def _table(table: Table, cap: int | None) -> list[str]:
    kept = table.kept(cap)
    lines = []
    if table.folded:
        lines += ["<details>", f"<summary>{html.escape(printable(table.title or table.key))}</summary>", ""]
    elif table.title:
        lines += [f"### {_escape(table.title)}", ""]
    if kept:
        lines.append("| " + " | ".join(_escape(c).replace("|", "\\|") or " " for c in table.columns) + " |")
        lines.append("|" + "|".join("--:" if i in table.numeric else ":--" for i in range(len(table.columns))) + "|")
        lines += ["| " + " | ".join(inline(cell, table_cell=True) for cell in table.rows[i]) + " |" for i in kept]
        lines.append("")
    left_out = len(table.rows) - len(kept)
    if left_out:
        lines += [(f"_{left_out:,} more rows not shown (the most telling are kept); all rows: "
                   "`tdiff report A B --format json`._"), ""]
    if table.note:
        lines += [f"<sub>{_escape(table.note)}</sub>", ""]
    if table.folded:
        lines += ["</details>", ""]
    return lines


def inline(parts: Inline, *, table_cell: bool = False) -> str:
    parts = (parts,) if isinstance(parts, str) else parts
    out = []
    for part in parts:
        text = _elide(part, CELL_CHARS if table_cell else PROSE_CHARS)
        if isinstance(part, Code):
            out.append(_code(text))
        elif isinstance(part, Strong):
            out.append(f"**{_escape(text)}**")
        else:
            out.append(_escape(text))
    text = "".join(out)
    return text.replace("|", "\\|") if table_cell else text


def _code(text: str) -> str:
    """A code span that shows ``text`` as written: its fence is longer than any run of backticks
    inside, so a name cannot close it early; on one line, so it cannot start a block."""
    text = printable(_elide(text, PROSE_CHARS))
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _escape(text: str) -> str:
    """Plain text that Markdown (and GitHub's HTML filter) shows as written, on one line: a name
    holding a line break cannot start a heading, a list or an HTML block."""
    text = printable(_elide(text, PROSE_CHARS))
    for char in "\\`*_[]<>#&~":
        text = text.replace(char, "\\" + char)
    return text


def _elide(text: str, limit: int) -> str:
    """Text over ``limit`` characters, cut in the middle: a 200,000-character tensor name leaves
    room for the verdict within the comment size limit."""
    text = str(text)
    if len(text) <= limit:
        return text
    half = (limit - 1) // 2
    return f"{text[:half]}…{text[-half:]}"
