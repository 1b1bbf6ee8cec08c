"""Terminal rendering of comparison results (rich). Honors NO_COLOR and non-TTY output."""

from __future__ import annotations

import os
from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from tdiff.compare.engine import CompareReport, Comparison
from tdiff.text import printable
from tdiff.vocab.paths import ROOT_LABEL


class _PlainConsole(Console):
    """A console that writes no control character it was not asked to: a tensor name or side label
    holding terminal escapes prints as text (rich's own styles and cursor moves still pass)."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            s if s.control else Segment(printable(s.text, keep_newlines=True), s.style) for s in buffer)

    def on_broken_pipe(self) -> None:
        """The reader left (``tdiff compare A B | head``): print nothing more, and let the command
        exit with its verdict. Rich would exit 1, which means "diverged"."""
        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.file.fileno())


def make_console(stderr: bool = False, quiet: bool = False) -> Console:
    """``quiet``: a console that prints nothing (informational lines under --quiet)."""
    console = _PlainConsole(stderr=stderr, highlight=False, soft_wrap=False, quiet=quiet)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 140  # logs and CI: wide enough for full tensor names
    return console


def fmt_number(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value:,}"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}" if abs(value) >= 1e-3 and abs(value) < 1e4 else f"{value:.{digits - 1}e}"


def describe(c: Comparison, tolerance: str = "bitwise") -> str:
    """One line for one result: what differs and by how much. ``tolerance`` is the verdict's
    (``Tolerance.describe()``): under a tolerance the elements outside it are counted."""
    if c.metrics is None:
        return c.reason or c.status
    m = c.metrics
    if tolerance == "bitwise":
        count = f"{m.mismatched:,}/{m.numel:,} elements differ ({100 * m.mismatch_fraction:.3g}%)"
    else:
        count = (f"{m.outside_tolerance:,}/{m.numel:,} elements outside {tolerance} "
                 f"({100 * m.outside_fraction:.3g}%; {m.mismatched:,} differ bitwise)")
    text = (f"{count}, max abs {fmt_number(m.max_abs)}, ULP at scale {fmt_number(m.max_ulp_at_scale)} "
            f"(raw max ULP {fmt_number(m.max_ulp)}), cosine {m.cosine:.9f}")
    if m.worst_index is not None:
        text += f", worst at {list(m.worst_index)}: {m.worst_a!r} vs {m.worst_b!r}"
    return f"{c.reason}; {text}" if c.reason else text


def render_compare(report: CompareReport, console: Console, top: int | None = None) -> None:
    comparisons = report.comparisons
    first = report.first_divergence
    shown = _rows_to_show(comparisons, first, top)
    tolerance = report.options.tolerance
    table = Table(title=Text(printable(f"{report.a.side} vs {report.b.side} ({tolerance.describe()})")),
                  title_justify="left", show_lines=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("tensor", overflow="fold", min_width=24, ratio=1)
    count_column = "mismatch" if tolerance.exact else "outside tol."
    by_token = any(c.tokens is not None for c in comparisons)
    columns = ["role", "step:call", "status", count_column, "max abs", "ULP at scale", "cosine"]
    if by_token:
        columns.insert(3, "tokens equal")
    for column in columns:
        table.add_column(column, justify="left" if column in ("role", "status") else "right", no_wrap=True)
    for index in shown:
        c = comparisons[index]
        r = c.record
        m = c.metrics if c.diverged else None
        style = "bold red" if c is first else ("red" if c.diverged else "")
        status = Text(c.status + (" <- first" if c is first else ""), style=style or "green")
        cells: list[str | Text] = [str(index), Text(printable(c.name)), r.role, f"{r.step}:{r.call}", status,
                 f"{100 * (m.mismatch_fraction if tolerance.exact else m.outside_fraction):.3g}%" if m else "",
                 fmt_number(m.max_abs) if m else "", fmt_number(m.max_ulp_at_scale) if m else "",
                 f"{m.cosine:.6f}" if m else ""]
        if by_token:
            cells.insert(4, f"{c.tokens.equal:,}/{c.tokens.compared:,}" if c.tokens is not None else "")
        table.add_row(*cells, style=style)
    console.print(table)
    if len(shown) < len(comparisons):
        console.print(f"({len(comparisons) - len(shown)} more rows; --top 0 shows all)")
    for label, dump in (("A", report.a), ("B", report.b)):
        for problem in dump.problems:
            console.print(f"[yellow]warning[/yellow]: side {label} incomplete: {escape(problem)}")
        for note in dump.notes:
            console.print(Text(f"note: side {label}: {printable(note)}"))
    console.print(Text(printable(summary_line(report))))


def summary_line(report: CompareReport) -> str:
    counts = report.counts()
    first = report.first_divergence
    if first is None and report.same_dump:
        return (f"match: A and B are the same dump ({report.a.path}), so its {counts['compared']} tensors "
                "equal themselves; give two different runs to compare")
    if first is None:
        # a filter may have left out where the runs part: say so next to the match
        left_out = f"; {report.left_out} tensor(s) left out by --layer/--select/--exclude" if report.left_out else ""
        return (f"match: all {counts['compared']} tensors equal ({report.options.tolerance.describe()})"
                f"{_token_totals(report)}{left_out}")
    diverged = counts["compared"] - counts["match"]
    where = f" (module {first.record.module or ROOT_LABEL}, {first.record.role})" if first.record.role != "explicit" else ""
    token = first.tokens.first_differing if first.tokens is not None else None
    at_token = (f" (first at position {token.position} of sequence {token.seq_a}, B's step {token.step_b})"
                if token is not None else "")
    return (f"diverged: {diverged} of {counts['compared']} tensors differ{_token_totals(report)}; first: "
            f"{first.name}{where} step {first.record.step} call {first.record.call}{at_token}: "
            f"{describe(first, report.options.tolerance.describe())}")


def _token_totals(report: CompareReport) -> str:
    """Tokens compared and equal over the token-aligned tensors (empty when none is)."""
    verdicts = [c.tokens for c in report.comparisons if c.tokens is not None]
    if not verdicts:
        return ""
    return (f"; {sum(v.equal for v in verdicts):,}/{sum(v.compared for v in verdicts):,} tensor-tokens equal "
            f"over {len(verdicts)} token-aligned tensors")


def _rows_to_show(comparisons: list[Comparison], first: Comparison | None, top: int | None) -> list[int]:
    if not top or len(comparisons) <= top:
        return list(range(len(comparisons)))
    # the worst `top` divergences, plus the first one, in execution order
    diverged = [i for i, c in enumerate(comparisons) if c.diverged]
    diverged.sort(key=lambda i: _severity(comparisons[i]), reverse=True)
    keep = set(diverged[:top])
    if first is not None:
        keep.add(comparisons.index(first))
    return sorted(keep) or list(range(min(top, len(comparisons))))


def _severity(c: Comparison) -> tuple:
    m = c.metrics
    if m is None:
        return (1, 0.0, 0.0)
    return (0, float(m.max_ulp_at_scale or 0), m.max_abs)
