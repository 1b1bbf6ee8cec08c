"""Terminal rendering of comparison results (rich). Honors NO_COLOR and non-TTY output."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from tdiff.align.pairing import Alignment, SideAlignment
from tdiff.align.tokens import TokenAlignment
from tdiff.compare.engine import CompareReport, Comparison
from tdiff.store.record import MAIN_THREAD
from tdiff.text import printable
from tdiff.vocab.paths import ROOT_LABEL

if TYPE_CHECKING:  # the renderers' types; the commands that render them import the packages
    from tdiff.bisect.result import BisectResult, Divergence
    from tdiff.source_patcher.trial import TrialReport


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


def fmt_cosine(value: float | str | None, digits: int) -> str:
    """The cosine of two tensors that differ, with ``digits`` decimals, or its distance from 1
    where those would round it to 1: tensors whose elements all differ must not read as "cosine
    1.000000". Computed in float64, a cosine of 1 means within ~1e-15 of it."""
    if value is None or isinstance(value, str):   # a dump's JSON writes NaN as a string
        return value or "-"
    if value == 1:
        return "1-<1e-15"
    text = f"{value:.{digits}f}"
    return f"1-{1 - value:.2g}" if text == f"{1:.{digits}f}" else text


_NAME_BREAK = re.compile(r"(?<=\.)|(?=\[)")


def wrap_name(name: str, width: int) -> list[str]:
    """A module path in lines of at most ``width`` characters, broken after a dot or before a
    bracket (``model.layers.1.`` / ``mlp.down_proj``), never inside a word unless one word alone
    is wider than the column."""
    lines = [""]
    for piece in _NAME_BREAK.split(name):
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return [chunk for line in lines for chunk in (line[i:i + width] for i in range(0, len(line), width))] or [""]


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
            f"(raw max ULP {fmt_number(m.max_ulp)}), cosine {fmt_cosine(m.cosine, 9)}")
    if m.worst_index is not None:
        text += f", worst at {list(m.worst_index)}: {m.worst_a!r} vs {m.worst_b!r}"
    return f"{c.reason}; {text}" if c.reason else text


# columns of the compare table, most telling first: the narrower the terminal, the more of the
# last ones are left out (never "#", the tensor, its status and its share of mismatches)
_KEPT_COLUMNS = 3   # after "#" and the tensor: status, the mismatch share and ULP at scale
_NAME_MIN_WIDTH = 20
_TWO_LINE_LABELS = {"#": "#", "tensor": "tensor", "status": "status", "mismatch": "mismatch",
                    "outside tol.": "outside\ntol.", "ULP at scale": "ULP at\nscale"}


def _width_besides_names(cells: dict[str, list], headers: list[str], labels: dict[str, str]) -> int:
    """The width the table takes besides the tensor names: each other column's widest cell or
    label line, the columns' padding and rules, and the tensor column's."""
    widths = [max([*map(len, labels[header].splitlines()), *(len(str(cell)) for cell in cells[header])])
              for header in headers if header != "tensor"]
    return sum(width + 3 for width in widths) + 4


def render_compare(report: CompareReport, console: Console, top: int | None = None, wide: bool = False) -> None:
    """The comparison table, fitted to the console's width unless ``wide``: long tensor names wrap
    at their dots and brackets, and the least telling columns are left out first (said under the
    table, with how to see them)."""
    comparisons = report.comparisons
    first = report.first_divergence
    shown = _rows_to_show(comparisons, first, top)
    tolerance = report.options.tolerance
    by_token = any(c.tokens is not None for c in comparisons)
    count_column = "mismatch" if tolerance.exact else "outside tol."
    # header -> cell of one comparison, in order of value
    cells: dict[str, list[str | Text]] = {"#": [], "tensor": [], "status": [], count_column: [],
                                          "ULP at scale": []}
    if by_token:
        cells["tokens equal"] = []
    cells.update({"max abs": [], "step:call": [], "cosine": [], "role": []})
    for index in shown:
        c = comparisons[index]
        m = c.metrics if c.diverged else None
        style = "bold red" if c is first else ("red" if c.diverged else "green")
        row: dict[str, str | Text] = {"#": str(index), "tensor": printable(c.name),
               "status": Text(c.status + (" <- first" if c is first else ""), style=style),
               count_column: f"{100 * (m.mismatch_fraction if tolerance.exact else m.outside_fraction):.3g}%"
               if m else "",
               "ULP at scale": fmt_number(m.max_ulp_at_scale) if m else "",
               "tokens equal": f"{c.tokens.equal:,}/{c.tokens.compared:,}" if c.tokens is not None else "",
               "max abs": fmt_number(m.max_abs) if m else "", "step:call": f"{c.record.step}:{c.record.call}",
               "cosine": fmt_cosine(m.cosine, 6) if m else "", "role": c.record.role}
        for header, column in cells.items():
            column.append(row[header])
    headers = list(cells)
    name_width = max([len("tensor"), *(len(str(name)) for name in cells["tensor"])])
    # a name wraps between its words (module path parts); the column is no narrower than its longest
    longest_word = max([0, *(len(word) for name in cells["tensor"] for word in _NAME_BREAK.split(str(name)))])
    name_floor = min(name_width, max(_NAME_MIN_WIDTH, longest_word))
    labels = {header: header for header in cells}
    if not wide:
        while True:
            room = console.width - _width_besides_names(cells, headers, labels)
            if room >= name_floor:
                break
            if len(headers) > 2 + _KEPT_COLUMNS:
                headers.pop()
            elif labels != _TWO_LINE_LABELS:
                labels = _TWO_LINE_LABELS
            else:  # only a name that breaks inside a word fits
                break
        name_width = min(name_width, max(room, _NAME_MIN_WIDTH))
    left_out = [header for header in cells if header not in headers]
    table = Table(title=Text(printable(f"{report.a.side} vs {report.b.side} ({tolerance.describe()})")),
                  title_justify="left", show_lines=False)
    for header in headers:
        if header == "tensor":
            table.add_column(header, no_wrap=True, max_width=name_width)
        else:
            table.add_column(labels[header], justify="left" if header in ("role", "status") else "right", no_wrap=True)
    for position, index in enumerate(shown):
        c = comparisons[index]
        style = "bold red" if c is first else ("red" if c.diverged else "")
        row_cells = [cells[header][position] for header in headers]
        row_cells[1] = Text("\n".join(wrap_name(str(row_cells[1]), name_width)))
        table.add_row(*row_cells, style=style)
    if wide:
        console.width = max(console.width, _width_besides_names(cells, headers, labels) + name_width)
    console.print(table)
    if len(shown) < len(comparisons):
        console.print(f"({len(comparisons) - len(shown)} more rows; --top 0 shows all)")
    if left_out:
        console.print(f"(left out to fit the terminal: {', '.join(left_out)}; "
                      "--wide or --json shows all)", highlight=False)
    for label, dump in (("A", report.a), ("B", report.b)):
        for problem in dump.problems:
            console.print(f"[yellow]warning[/yellow]: side {label} incomplete: {escape(problem)}")
        for note in dump.notes:
            console.print(Text(f"note: side {label}: {printable(note)}"))
    console.print(Text(printable(summary_line(report))))
    if isinstance(report.alignment, TokenAlignment):
        render_token_alignment(report.alignment, console)
    elif isinstance(report.alignment, Alignment):
        render_alignment(report.alignment, console)


def render_alignment(alignment: Alignment, console: Console) -> None:
    """How two dumps of different frameworks or layouts were aligned (after the comparison table)."""
    a, b = alignment.a, alignment.b
    console.print(f"aligned by canonical boundary: A {escape(a.side)} ({a.adapter}, {a.canonical} tensors), "
                  f"B {escape(b.side)} ({b.adapter}, {b.canonical} tensors)")
    for label, side in (("A", a), ("B", b)):
        _render_side(label, side, console)
    unmapped = [f"{label} {len(side.unmapped)}" for label, side in (("A", a), ("B", b)) if side.unmapped]
    if unmapped:
        console.print(f"  not mapped to a canonical boundary (distinct names): {', '.join(unmapped)}; "
                      "--json lists them")
    for warning in alignment.warnings:
        console.print(f"[yellow]warning[/yellow]: {escape(warning)}")


def _render_side(label: str, side: SideAlignment, console: Console) -> None:
    for boundary, entry in side.not_exposed.items():
        console.print(f"  not exposed by {label} ({side.adapter}), {entry['skipped']} not compared: "
                      f"{boundary}: {escape(entry['reason'])}")
    for name, reason in side.uncertain:
        console.print(f"  only on {label}, not compared: {name}: {escape(reason)}")
    for name, reason in side.unresolved:
        console.print(f"  [yellow]cannot build on {label}[/yellow]: {name}: {escape(reason)}")
    if side.unmatched:
        more = len(side.unmatched) - 8
        shown = ", ".join(side.unmatched[:8]) + (f" and {more} more" if more > 0 else "")
        console.print(f"  [red]only on {label}[/red] (the other side could expose them): {shown}")


def render_token_alignment(alignment: TokenAlignment, console: Console) -> None:
    """How two dumps were aligned token by token (after the comparison table)."""
    pairs = alignment.sequences
    shared = sum(p.shared for p in pairs)
    console.print(f"aligned by token: {len(pairs)} sequence pair(s) matched by token ids, {shared:,} positions "
                  "fed by both")
    one_sided = [(label, p.a, p.b, positions) for p in pairs
                 for label, positions in (("A", p.only_a), ("B", p.only_b)) if positions]
    for label, a, b, positions in one_sided[:8]:
        shown = ", ".join(map(str, positions[:6])) + (" ..." if len(positions) > 6 else "")
        console.print(f"  only on {label} (not compared): sequence {a} (A) / {b} (B), position(s) {shown}")
    if len(one_sided) > 8:
        console.print(f"  ... and {len(one_sided) - 8} more sequence(s) with one-sided positions; --json lists them")
    for label, unmatched in (("A", alignment.unmatched_a), ("B", alignment.unmatched_b)):
        if unmatched:
            shown = ", ".join(f"{u['seq']} ({u['tokens']} tokens)" for u in unmatched[:8])
            console.print(f"  [yellow]sequences only on {label}[/yellow] (no partner by token ids): {shown}")
    for parting in alignment.partings[:4]:
        console.print(f"  [red]diverged[/red]: {parting.describe()} (the positions before it compared)")
    if len(alignment.partings) > 4:
        console.print(f"  ... and {len(alignment.partings) - 4} more sequence pairs that part; --json lists them")
    if alignment.uncompared.count:
        console.print(f"  [yellow]not compared[/yellow]: {escape(alignment.uncompared.note())}")
    if alignment.one_sided_inputs:
        names = ", ".join(f"{escape(name)} ({side})" for name, side in alignment.one_sided_inputs[:6])
        more = f" and {len(alignment.one_sided_inputs) - 6} more" if len(alignment.one_sided_inputs) > 6 else ""
        console.print(f"  inputs one run alone passes, not compared (not a divergence): {names}{more}")
    if alignment.not_aligned:
        names = ", ".join(escape(name) for name, _ in alignment.not_aligned[:6])
        more = f" and {len(alignment.not_aligned) - 6} more" if len(alignment.not_aligned) > 6 else ""
        console.print(f"  not token-aligned, not compared (no row per token): {names}{more}; --json says why")
    for name, reason in alignment.partly[:6]:
        console.print(f"  [yellow]partly token-aligned[/yellow]: {escape(name)}: {escape(reason)}")
    if len(alignment.partly) > 6:
        console.print(f"  ... and {len(alignment.partly) - 6} more partly token-aligned tensors; --json lists them")
    if alignment.boundaries is not None:
        render_alignment(alignment.boundaries, console)


def summary_line(report: CompareReport) -> str:
    counts = report.counts()
    first = report.first_divergence
    if first is None and report.same_dump:
        return (f"match: A and B are the same dump ({report.a.path}), so its {counts['compared']} tensors "
                "equal themselves; give two different runs to compare")
    if first is None and report.partings:
        return f"diverged: {report.partings[0].describe()}{_token_totals(report)}"
    if first is None:
        # a filter may have left out where the runs part: say so next to the match
        left_out = f"; {report.left_out} tensor(s) left out by --layers/--select/--exclude" if report.left_out else ""
        return (f"match: all {counts['compared']} tensors equal ({report.options.tolerance.describe()})"
                f"{_token_totals(report)}{left_out}")
    diverged = counts["compared"] - counts["match"]
    where = f" (module {first.record.module or ROOT_LABEL}, {first.record.role})" if first.record.role != "explicit" else ""
    token = first.tokens.first_differing if first.tokens is not None else None
    at_token = (f" (first at position {token.position} of sequence {token.seq_a}, B's step {token.step_b})"
                if token is not None else "")
    return (f"diverged: {diverged} of {counts['compared']} tensors differ{_token_totals(report)}; first: "
            f"{first.name}{where}{_thread(first.record)} step {first.record.step} call {first.record.call}{at_token}: "
            f"{describe(first, report.options.tolerance.describe())}")


def _thread(record) -> str:
    """Which thread recorded it, where it was not the process's first."""
    return f" thread {record.thread}" if record.thread != MAIN_THREAD else ""


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


def render_bisect(result: BisectResult, console: Console) -> None:
    from tdiff.bisect.search import BinarySearch

    def say(text: str) -> None:
        # long module paths stay on one line, and a name holding a line break cannot add one
        console.print(printable(text), soft_wrap=True)

    for note in result.notes:
        say(f"[yellow]note[/yellow]: {escape(note)}")
    if result.repeats is not None:
        repeats = result.repeats
        say(f"repeats: {len(repeats.runs)} runs against {repeats.reference}; "
            f"not bitwise repeatable: {escape(', '.join(repeats.differing)) or 'none'}")
    d = result.first_divergence
    if d is None and result.status == "diverged":
        say(f"[bold red]diverged[/bold red]: tensors are missing on one side, or the runs sampled different "
            f"tokens (see the notes); the "
            f"{result.checked:,} events compared on both sides are equal ({result.tolerance}), so no op is named")
    elif d is None:
        say(f"[green]match[/green]: all {result.checked:,} events compared are equal "
            f"({result.tolerance})")
    else:
        where = d.module if d.module else (ROOT_LABEL if d.module is not None else "outside any module")
        layer = f", layer {d.layer}" if d.layer is not None else ""
        verb = "introduced" if d.introduced else "first seen"
        say(f"[bold red]diverged[/bold red]: {verb} at [bold]{escape(where)}[/bold] "
            f"({d.kind}{layer}), step {d.step} call {d.call}, event {d.event}")
        say(f"  {escape(d.description)}")
        if d.op is not None:
            say(f"  {escape(d.op.describe())}")
        # the full verdict where this process compared the tensor; read back from JSON, its figures
        figures = describe(d.first, result.tolerance) if d.first is not None else _describe_metrics(d)
        say(f"  first differing tensor {escape(d.name)}: {escape(figures)}")
        if d.token is not None:
            t = d.token
            tokens = d.first.tokens if d.first is not None else None
            equal = f"; {tokens.equal:,}/{tokens.compared:,} tokens equal" if tokens is not None else ""
            say(f"  first differing token: position {t['position']} of sequence {t['seq_a']} (A, step "
                f"{t['step_a']}) / {t['seq_b']} (B, step {t['step_b']}){equal}")
        if d.cause is not None:
            say(f"  {escape(d.cause.line())}")
        for line in d.swap.lines() if d.swap is not None else []:
            say(f"  {escape(line)}")
        if result.trail:
            chain = " > ".join(f"{escape(t.module or ROOT_LABEL)} (ULP at scale "
                               f"{fmt_number(t.metrics.max_ulp_at_scale)})" for t in result.trail)
            say(f"  enclosing modules that diverged too: {chain}")
        say(f"  {result.checked:,} events compared ({result.tolerance})")
    if result.graft is not None:
        say(f"graft: {escape(result.graft.description)}")
    if result.trials is not None and d is not None:
        trials = result.trials
        best = trials.best
        verdict = (f"[green]{escape(best.name)} closes the gap[/green]" if trials.matched and best
                   else f"none closes the gap; closest: {escape(best.name) if best else '-'}")
        say(f"try: {len(trials.candidates)} candidate fix(es) for kind {d.kind}: {verdict}")
        for trial in [trials.control, *trials.candidates]:
            where = trial.first_divergence.name if trial.first_divergence else ""
            say(f"  {escape(trial.name)}: {trial.status}" + (f", first divergence {escape(where)}" if where else "")
                + (f" ({escape(trial.reason)})" if trial.reason else ""))
    if result.runs is not None:
        log = result.runs
        say(log.summary())
        if log.boundaries is not None:
            bound = BinarySearch.max_probes(log.boundaries) + 2
            say(f"  binary search over {log.boundaries} boundaries: at most {bound} runs per side "
                f"(ceil(log2({log.boundaries} + 1)) probes, one discovery, one final capture)")
        for run in log.runs:
            outcome = f" -> {run.outcome}" if run.outcome else ""
            say(f"  {run.label} {run.purpose}: {escape(run.why)}{escape(outcome)}")


def _describe_metrics(d: Divergence) -> str:
    m = d.metrics
    text = (f"max abs {fmt_number(m.max_abs)}, ULP at scale {fmt_number(m.max_ulp_at_scale)} "
            f"(raw max ULP {fmt_number(m.max_ulp)}), cosine {fmt_cosine(m.cosine, 9)}")
    return f"{d.reason}; {text}" if d.reason else text


def render_trials(report: TrialReport, console: Console) -> None:
    """`tdiff patch try`: the control and the ranked candidates, then the verdict."""
    control = report.control
    console.print(f"baseline {report.baseline}; runs and logs in {report.workdir} ({report.tolerance})",
                  highlight=False)
    table = Table(title_justify="left", show_lines=False)
    for column in ("rank", "candidate", "status", "first divergence", "moved", "mismatched", "ULP at scale"):
        table.add_column(column, justify="right" if column in ("rank", "moved", "mismatched", "ULP at scale") else "left",
                         overflow="fold")
    rows = [("-", control)] + [(str(i), r) for i, r in enumerate(report.candidates, 1)]
    for rank, r in rows:
        style = {"match": "green", "diverged": "", "error": "red"}[r.status]
        name = "(control, unpatched)" if r is control else r.name
        if r is not control and r.patches and not r.applied and r.status != "error":
            name += " (never applied)"
        first = (r.first_divergence.name + (f" ({r.first_divergence.reason})" if r.first_divergence.reason else "")
                 if r.first_divergence else (r.reason or ""))
        moved = "" if r is control else (f"{r.moved_by:+d}" if r.moved_by is not None else "")
        table.add_row(rank, Text(name), Text(r.status, style=style), Text(first), moved,
                      fmt_number(r.mismatched), fmt_number(r.max_ulp_at_scale))
    console.print(table)
    best = report.best
    if best is None:
        console.print("no candidate ran to the end: see the logs", highlight=False)
    elif best.status == "match":
        console.print(f"best: {best.name} (matches the baseline; the unpatched control {control.status})",
                      highlight=False)
    else:
        console.print(f"no candidate matches; closest: {best.name} (first divergence moved "
                      f"{best.moved_by:+d} tensors)" if best.moved_by is not None else
                      f"no candidate matches; closest: {best.name}", highlight=False)
