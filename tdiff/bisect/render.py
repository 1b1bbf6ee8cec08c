"""The readable summary of a bisection (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from tdiff.bisect.result import BisectResult
from tdiff.bisect.search import BinarySearch
from tdiff.report.console import describe, fmt_number
from tdiff.text import printable
from tdiff.vocab.paths import ROOT_LABEL


def render_bisect(result: BisectResult, console: Console) -> None:
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
    if d is None and result.missing:
        say(f"[bold red]diverged[/bold red]: {result.missing:,} tensor(s) are missing on one side (see the note); "
            f"the {result.checked:,} events compared on both sides are equal ({result.tolerance}), so no op is named")
    elif d is None:
        say(f"[green]match[/green]: all {result.checked:,} events compared are equal "
            f"({result.tolerance})")
    else:
        where = d.module if d.module else (ROOT_LABEL if d.module is not None else "outside any module")
        layer = f", layer {d.layer}" if d.layer is not None else ""
        record = d.comparison.record
        verb = "introduced" if d.introduced else "first seen"
        say(f"[bold red]diverged[/bold red]: {verb} at [bold]{escape(where)}[/bold] "
            f"({d.kind}{layer}), step {record.step} call {record.call}, event {d.event}")
        say(f"  {escape(d.description)}")
        say(f"  first differing tensor {escape(d.name)}: {escape(describe(d.comparison, result.tolerance))}")
        tokens = d.comparison.tokens
        if tokens is not None and tokens.first_differing is not None:
            t = tokens.first_differing
            say(f"  first differing token: position {t.position} of sequence {t.seq_a} (A, step {t.step_a}) / "
                f"{t.seq_b} (B, step {t.step_b}); {tokens.equal:,}/{tokens.compared:,} tokens equal")
        if result.trail:
            chain = " > ".join(f"{escape(t.module or ROOT_LABEL)} (ULP at scale "
                               f"{fmt_number(t.comparison.metrics.max_ulp_at_scale) if t.comparison.metrics else '-'})"
                               for t in result.trail)
            say(f"  enclosing modules that diverged too: {chain}")
        say(f"  {result.checked:,} events compared ({result.tolerance})")
    if result.graft is not None:
        say(f"graft: {escape(result.graft.description)}")
    if result.trials is not None:
        trials = result.trials
        best = trials.best
        verdict = (f"[green]{escape(best.name)} closes the gap[/green]" if trials.matched
                   else f"none closes the gap; closest: {escape(best.name) if best else '-'}")
        say(f"try: {len(trials.candidates)} candidate fix(es) for kind {result.first_divergence.kind}: {verdict}")
        for trial in [trials.control, *trials.candidates]:
            where = trial.first_divergence["name"] if trial.first_divergence else ""
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
