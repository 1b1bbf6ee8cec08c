"""Terminal rendering of comparison results (rich). Honors NO_COLOR and non-TTY output."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tdiff.compare.engine import CompareReport, Comparison


def make_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr, highlight=False, soft_wrap=False)
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
    text = (f"{count}, max abs {fmt_number(m.max_abs)}, max ULP {fmt_number(m.max_ulp)}, "
            f"cosine {m.cosine:.9f}")
    if m.worst_index is not None:
        text += f", worst at {list(m.worst_index)}: {m.worst_a!r} vs {m.worst_b!r}"
    return f"{c.reason}; {text}" if c.reason else text


def render_compare(report: CompareReport, console: Console, top: int | None = None) -> None:
    comparisons = report.comparisons
    first = report.first_divergence
    shown = _rows_to_show(comparisons, first, top)
    tolerance = report.options.tolerance
    table = Table(title=f"{report.a.side} vs {report.b.side} ({tolerance.describe()})",
                  title_justify="left", show_lines=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("tensor", overflow="fold", min_width=24, ratio=1)
    count_column = "mismatch" if tolerance.exact else "outside tol."
    for column in ("role", "step:call", "status", count_column, "max abs", "max ULP", "cosine"):
        table.add_column(column, justify="left" if column in ("role", "status") else "right", no_wrap=True)
    for index in shown:
        c = comparisons[index]
        r = c.record
        m = c.metrics if c.diverged else None
        style = "bold red" if c is first else ("red" if c.diverged else "")
        status = Text(c.status + (" <- first" if c is first else ""), style=style or "green")
        table.add_row(str(index), Text(c.name), r.role, f"{r.step}:{r.call}", status,
                      f"{100 * (m.mismatch_fraction if tolerance.exact else m.outside_fraction):.3g}%" if m else "",
                      fmt_number(m.max_abs) if m else "", fmt_number(m.max_ulp) if m else "",
                      f"{m.cosine:.6f}" if m else "", style=style)
    console.print(table)
    if len(shown) < len(comparisons):
        console.print(f"({len(comparisons) - len(shown)} more rows; --top 0 shows all)")
    for label, dump in (("A", report.a), ("B", report.b)):
        for problem in dump.problems:
            console.print(f"[yellow]warning[/yellow]: side {label} incomplete: {problem}")
    console.print(summary_line(report))


def summary_line(report: CompareReport) -> str:
    counts = report.counts()
    first = report.first_divergence
    if first is None:
        return f"match: all {counts['compared']} tensors equal ({report.options.tolerance.describe()})"
    diverged = counts["compared"] - counts["match"]
    where = f" (module {first.record.module or '(model)'}, {first.record.role})" if first.record.role != "explicit" else ""
    return (f"diverged: {diverged} of {counts['compared']} tensors differ; first: {first.name}{where} "
            f"step {first.record.step} call {first.record.call}: "
            f"{describe(first, report.options.tolerance.describe())}")


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
    return (0, float(m.max_ulp or 0), m.max_abs)
