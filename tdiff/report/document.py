"""The report as a document: headings, paragraphs and tables of text, shared by the Markdown and
HTML renderers so both say the same thing. Numbers are formatted here, once (with the terminal
table's :func:`fmt_number`).

Inline text is a tuple of plain strings, :class:`Code` (names) and :class:`Strong` (verdicts).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tdiff.report.console import describe, fmt_cosine, fmt_number
from tdiff.report.environment import PACKAGES, SideEnvironment
from tdiff.report.model import BoundaryRow, Report
from tdiff.version import __version__
from tdiff.vocab.paths import ROOT_LABEL

if TYPE_CHECKING:  # the results the report shows; `tdiff report` makes them
    from tdiff.bisect.result import BisectResult
    from tdiff.source_patcher.trial import TrialReport, TrialResult

TRAIL_SHOWN = 20


class Code(str):
    """A name shown as code."""


class Strong(str):
    """Text shown in bold."""


Inline = str | tuple  # a str (plain, Code or Strong), or a tuple of them


@dataclass
class Heading:
    text: str
    key: str                    # anchor id in HTML


@dataclass
class Paragraph:
    parts: Inline


@dataclass
class Table:
    key: str
    title: str | None           # a heading (the summary line of a folded table)
    columns: list[str]
    rows: list[list[Inline]]
    numeric: frozenset[int] = frozenset()   # right-aligned columns
    priority: list[int] | None = None       # row indices, most important first (default: in order)
    folded: bool = False                    # in a <details> block
    note: str | None = None                 # a caption under the table

    def kept(self, limit: int | None) -> list[int]:
        """The rows shown when at most ``limit`` fit: the most important ones, in table order."""
        order = self.priority if self.priority is not None else list(range(len(self.rows)))
        return sorted(order[:limit] if limit is not None else order)


@dataclass
class Plots:
    """Where the HTML report draws its figures (the Markdown report has none)."""


Block = Heading | Paragraph | Table | Plots


@dataclass
class Document:
    title: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def tables(self) -> list[Table]:
        return [b for b in self.blocks if isinstance(b, Table)]


def build_document(report: Report) -> Document:
    doc = Document(f"tdiff: {report.side_a} vs {report.side_b}")
    doc.blocks.append(Paragraph(headline(report)))
    doc.blocks.append(Paragraph(counts_line(report)))
    doc.blocks += [Paragraph((Strong("Warning:"), f" {problem}")) for problem in report.problems]
    if report.bisect is not None:  # the answer first, right under the headline
        doc.blocks += [Heading("Bisect", "bisect"), *bisect_blocks(report.bisect)]
    doc.blocks.append(Plots())
    doc.blocks.append(layer_table(report))
    if report.token_parity:
        doc.blocks.append(parity_table(report))
    if report.patch_results is not None:
        doc.blocks.append(patch_table(report.patch_results))
    doc.blocks.append(environment_table(report))
    doc.blocks += [boundary_table(report), diverged_table(report)]
    doc.blocks.append(Paragraph((f"Made by tdiff {__version__}; every row of every table: ",
                                 Code("tdiff report A B --format json"), ".")))
    return doc


# ---- summary ----
def headline(report: Report) -> tuple:
    culprit = report.culprit
    if culprit is None and report.same_dump is not None:
        return (Strong("Match:"), " A and B are the same dump (", Code(report.same_dump),
                (f"), so its {report.counts['compared']:,} tensors equal themselves; give two different "
                 "runs to compare."))
    if culprit is None:
        equal = "bitwise equal" if report.tolerance == "bitwise" else f"equal within {report.tolerance}"
        left_out = f" ({report.left_out:,} tensors were left out by --layers/--select/--exclude.)" if report.left_out else ""
        return (Strong("Match:"), f" all {report.counts['compared']:,} tensors are {equal}.{left_out}")
    c = culprit.comparison
    where = [c.record.role] + ([f"layer {culprit.layer}"] if culprit.layer is not None else [])
    where += [f"kind {c.boundary_kind}"]
    where += [f"step {c.record.step} call {c.record.call}"] + ([f"rank {c.record.rank}"] if c.record.rank else [])
    token = culprit.first_token
    at_token = ("" if token is None or c.tokens is None else
                f" First differing token: position {token['position']} of sequence {token['seq_a']} (A, step "
                f"{token['step_a']}, {token['phase_a']}) / {token['seq_b']} (B, step {token['step_b']}, "
                f"{token['phase_b']}); {c.tokens.equal:,}/{c.tokens.compared:,} tokens equal.")
    return (Strong("Diverged:"), " first divergence at ", Code(c.name), f" ({', '.join(where)}, boundary ",
            Code(culprit.boundary), f"): {describe(c, report.tolerance)}.{at_token}")


def counts_line(report: Report) -> str:
    counts = report.counts
    diverged = counts["compared"] - counts["match"]
    text = f"{diverged:,} of {counts['compared']:,} tensors differ ({report.tolerance})"
    statuses = [f"{counts[s]:,} {s.replace('_', ' ')}" for s in counts if s not in ("compared", "match")
                and counts[s]]
    if statuses:
        text += ": " + ", ".join(statuses)
    culprit = report.culprit
    if culprit is not None and culprit.tokens is not None:
        t = culprit.tokens
        text += (f". Per token (dim {t.axis} of {t.shape}): {t.tokens_differ:,} of {len(t.mismatched):,} "
                 f"tokens differ")
        if t.worst is not None:
            text += f", the worst is {t.label(t.worst)} (max abs {fmt_number(t.max_abs[t.worst])})"
    elif culprit is not None:
        text += f". No per-token error: {culprit.tokens_note}"
    return text + "."


# ---- tables ----
def layer_table(report: Report) -> Table:
    first_layer = report.culprit.layer if report.culprit else None
    rows, severity = [], []
    for row in report.layers:
        first = row.first_diverged
        label: Inline = row.label
        if row.layer is not None and row.layer == first_layer:
            label = (Strong(row.label), " ◀ first")
        out = row.output
        rows.append([label, f"{row.diverged:,}/{row.tensors:,}", Code(first.boundary) if first else "-",
                     *metric_cells(out)])
        severity.append((row.layer == first_layer and row.layer is not None, row.diverged > 0,
                         *out.severity()[1:]))
    count = count_column(report)
    return Table("layers", "Error by layer", ["layer", "tensors differ", "first differing boundary",
                                              count, "max abs", "ULP at scale"], rows,
                 numeric=frozenset({1, 3, 4, 5}), priority=_by(severity),
                 note=f"{count}, max abs and ULP at scale of the layer's output (outside the layers: of the "
                      "last boundary)")


def parity_line(report: Report) -> str:
    """The totals of the log-prob parity table, as slime's gates say them."""
    rows = report.token_parity
    compared, equal = sum(r.compared for r in rows), sum(r.equal for r in rows)
    text = f"{equal:,}/{compared:,} token/rank log-probs bitwise equal"
    if rows and rows[0].within is not None:
        text += f", {sum(r.within or 0 for r in rows):,}/{compared:,} within {report.tolerance}"
    return text


def parity_table(report: Report) -> Table:
    rows = report.token_parity
    tolerance = rows[0].within is not None
    cells: list[list[Inline]] = []
    for r in rows:
        row: list[Inline] = [Code(r.tensor), str(r.rank) if r.rank == r.rank_b else f"{r.rank} / {r.rank_b}",
                             f"{r.seq_a} / {r.seq_b}",
                             "response" if r.scope == "response" else "all (prompt length unknown)",
                             f"{r.equal:,}/{r.compared:,}"]
        cells.append(row + ([f"{r.within:,}/{r.compared:,}"] if tolerance else []))
    columns = ["tensor", "rank", "sequence (A / B)", "tokens", "bitwise equal"]
    columns += [f"within {report.tolerance}"] if tolerance else []
    worst_first = sorted(range(len(rows)), key=lambda i: rows[i].equal - rows[i].compared)
    return Table("token-parity", "Log-prob parity per token", columns, cells,
                 numeric=frozenset({4, 5} if tolerance else {4}), priority=worst_first,
                 note=f"{parity_line(report)}. Per sequence and rank: the response tokens (from the prompt "
                      "length on) whose log-prob row matches.")


def boundary_table(report: Report) -> Table:
    culprit = report.culprit
    rows, severity = [], []
    for row in report.boundaries:
        is_first = culprit is not None and (row.layer, row.boundary) == (culprit.layer, culprit.boundary)
        name: Inline = (Code(row.boundary), " ◀ first") if is_first else Code(row.boundary)
        rows.append(["-" if row.layer is None else str(row.layer), name, row.kind or "-",
                     differ_cell(row), *metric_cells(row)])
        severity.append((is_first, *row.severity()))
    return Table("boundaries", f"All boundaries ({len(rows):,})",
                 ["layer", "boundary", "kind", "tensors differ", count_column(report), "max abs", "ULP at scale"], rows,
                 numeric=frozenset({3, 4, 5, 6}), priority=_by(severity), folded=True)


def diverged_table(report: Report) -> Table:
    diverged = [(i, c) for i, c in enumerate(report.comparisons) if c.diverged]
    first = report.culprit.comparison if report.culprit else None
    rows, severity = [], []
    for index, c in diverged:
        m = c.metrics
        status: Inline = (Strong(c.status), " ◀ first") if c is first else c.status
        rows.append([str(index), Code(c.name), c.boundary_kind, c.record.role, f"{c.record.step}:{c.record.call}",
                     status, _percent(m.outside_fraction) if m else "-", fmt_number(m.max_abs) if m else "-",
                     fmt_number(m.max_ulp_at_scale) if m else "-", fmt_cosine(m.cosine, 6) if m else "-"])
        severity.append((c is first, float(m.max_ulp_at_scale or 0) if m else 0.0, m.max_abs if m else 0.0))
    return Table("tensors", f"Diverged tensors ({len(rows):,}), in execution order",
                 ["#", "tensor", "kind", "role", "step:call", "status", count_column(report), "max abs",
                  "ULP at scale", "cosine"],
                 rows, numeric=frozenset({0, 6, 7, 8, 9}), priority=_by(severity), folded=True)


def environment_table(report: Report) -> Table:
    env = report.environment
    host_used = False

    def version(side: SideEnvironment, package: str) -> Inline:
        nonlocal host_used
        if package in side.versions:
            return side.versions[package]
        host_used = True
        installed = env.report_host.get(package)
        return f"{installed} (report host)" if installed else "not installed (report host)"

    rows: list[list[Inline]] = [[package, version(env.a, package), version(env.b, package)] for package in PACKAGES]
    rows += [["device", _tally(env.a.devices), _tally(env.b.devices)],
             ["dtypes", _tally(env.a.dtypes), _tally(env.b.dtypes)],
             ["processes", str(env.a.processes), str(env.b.processes)],
             ["host", ", ".join(env.a.hosts) or "-", ", ".join(env.b.hosts) or "-"],
             ["command", _command(env.a), _command(env.b)]]
    note = ("(report host): the dump does not record that package's version; shown is the one "
            "installed where this report was made") if host_used else None
    return Table("environment", "Environment", ["", f"A: {report.side_a}", f"B: {report.side_b}"], rows,
                 note=note)


def bisect_blocks(result: BisectResult) -> list[Block]:
    """The section for a bisection (``tdiff report --bisect``)."""
    events = f"{result.checked:,} events checked"
    found = result.first_divergence
    if found is None and result.status == "diverged":  # only tensors missing from an incomplete dump
        why = (f" every event compared on both sides matches ({events}), "
               "but tensors are missing on one side, so no op is named. ")
        return [Paragraph((Strong("Diverged:"), why, *result.notes[-1:]))]
    if found is None:
        return [Paragraph((Strong("Match:"), f" bisect found no divergence ({events})."))]
    verb = "Introduced at" if found.introduced else "First differs at"
    where = [found.event, f"kind {found.kind}"] + ([f"layer {found.layer}"] if found.layer is not None else [])
    where += [f"step {found.step}"]
    headline: tuple = (Strong(verb), " ", Code(found.name), f" ({', '.join(where)}); {events}.")
    if not found.introduced:
        headline += ((" Its inputs already differed: bisect could not prove the divergence is "
                      "introduced here."),)
    metrics = found.metrics
    rows: list[list[Inline]] = [["where", found.description]] if found.description else []
    rows += [
        ["module (A)", Code(found.module) if found.module else "-"],
        ["module (B)", Code(found.module_b) if found.module_b else "-"],
        ["event", found.event], ["kind", found.kind or "-"],
        ["mismatch" if result.tolerance == "bitwise" else "outside tolerance",
         _percent(metrics.outside_fraction)],
        ["max abs", fmt_number(metrics.max_abs)], ["max ULP", fmt_number(metrics.max_ulp)],
        ["ULP at scale", fmt_number(metrics.max_ulp_at_scale)],
        ["cosine", fmt_cosine(metrics.cosine, 9)]]
    trail = result.trail
    if trail:
        shown = [Code(t.name or t.module or ROOT_LABEL) for t in trail[:TRAIL_SHOWN]]
        cell = tuple(part for item in shown for part in (item, ", "))[:-1]
        more = len(trail) - len(shown)
        rows.append(["trail (enclosing modules that also differ)", cell + ((f", and {more} more",) if more else ())])
    cause = [Paragraph((Strong("Cause:"), " ", found.cause.line().removeprefix("cause: ")))] if found.cause else []
    cause += [Paragraph((Strong("Swap:"), " ", line.removeprefix("swap: "))) for line in
              (found.swap.lines() if found.swap is not None else [])]
    return [Paragraph(headline), *cause, Table("bisect-result", None, ["", "value"], rows)]


def patch_table(results: TrialReport) -> Table:
    """The table of ``tdiff patch try``'s trials: the control, then the candidates as ranked."""
    best = results.best
    rows: list[list[Inline]] = [[(Strong("control"), " (unpatched)"), *_trial_cells(results.control)]]
    for candidate in results.candidates:
        label: Inline = (Code(candidate.name), " ★ best") if candidate is best else Code(candidate.name)
        rows.append([label, *_trial_cells(candidate)])
    note = None if best else "no candidate was ranked best"
    return Table("patches", "Patch trials (ranked: best first)", ["candidate", "status", "first divergence",
                 "moved by", "tensors differ", "ULP at scale"], rows, numeric=frozenset({3, 4, 5}), note=note)


def _trial_cells(trial: TrialResult) -> list[Inline]:
    first = trial.first_divergence
    return [trial.status, Code(first.name) if first else "-", fmt_number(trial.moved_by),
            fmt_number(trial.mismatched), fmt_number(trial.max_ulp_at_scale)]


# ---- cells ----
def metric_cells(row: BoundaryRow) -> list[str]:
    return [_percent(row.outside_fraction), fmt_number(row.max_abs), fmt_number(row.max_ulp_at_scale)]


def count_column(report: Report) -> str:
    """The share of elements that fail the verdict: bits that differ, or values outside the tolerance."""
    return "mismatch" if report.tolerance == "bitwise" else "outside tolerance"


def differ_cell(row: BoundaryRow) -> str:
    text = f"{row.diverged:,}/{row.tensors:,}"
    return text + (f" ({row.unmeasured:,} unmeasured)" if row.unmeasured else "")


def _percent(fraction) -> str:
    if fraction is None:
        return "-"
    return "0%" if fraction == 0 else f"{100 * fraction:.3g}%"


def _tally(counter: Counter) -> str:
    return ", ".join(f"{key} ×{count:,}" for key, count in counter.most_common()) or "-"


def _command(side: SideEnvironment) -> Inline:
    return Code(" ".join(side.command)) if side.command else "-"


def _by(severity: list[tuple]) -> list[int]:
    return sorted(range(len(severity)), key=lambda i: severity[i], reverse=True)
