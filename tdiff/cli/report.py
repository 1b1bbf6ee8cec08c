"""tdiff report: a comparison written up for a pull request (Markdown, HTML or JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from tdiff.cli.options import (align_option, allow_incomplete_option, allow_unaligned_option, dumps_from, jobs_option,
                               json_option, layers_option, mapping_option, name_filter_options, quiet_option,
                               tolerance_from, tolerance_options)
from tdiff.errors import TdiffError


@click.command()
@click.argument("dump_a", metavar="A")
@click.argument("dump_b", metavar="B")
@click.option("--format", "fmt", type=click.Choice(["md", "html", "json"]), default="md", show_default=True,
              help="md: for a pull request; html: one self-contained file with plots; json: every row.")
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Write the report to FILE (default: standard output).")
@layers_option(" (--bisect still walks every tensor)")
@name_filter_options
@click.option("--bisect", "with_bisect", is_flag=True,
              help="Also bisect to the op that introduces the divergence.")
@click.option("--patch-results", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Add the trials of `tdiff patch try --json` saved in FILE.")
@click.option("--gh-comment", is_flag=True,
              help="Print the Markdown with a marker line, ready for `gh pr comment -F -`.")
@tolerance_options
@json_option
@allow_incomplete_option()
@allow_unaligned_option
@mapping_option
@align_option
@quiet_option
@jobs_option
def report(dump_a, dump_b, fmt, out, layers, select, exclude, with_bisect, patch_results, gh_comment, exact, atol,
           rtol, ulp, as_json, allow_incomplete, allow_unaligned, mapping, align, quiet, jobs):
    """Write a report of dumps A and B: the first divergence, error per layer and boundary,
    log-prob parity per token (runs aligned by token), the environment, and optionally bisect
    and patch-trial results.

    \b
    tdiff report dumps/a dumps/b > report.md
    tdiff report dumps/a dumps/b --format html -o report.html
    tdiff report dumps/a dumps/b --gh-comment | gh pr comment 123 -F -

    The Markdown stays within GitHub's 65,536-character comment limit: large tables keep their
    most telling rows. The HTML file needs nothing else to open (no network): it draws per-layer
    error growth, a boundary × layer heatmap and the first divergence's error per token (and,
    for runs aligned by token, over sequence × position).

    Exit status: 0 match, 1 divergence (the report is written either way), 2 bad input (or, for
    runs aligned by token, rows of tokens both fed left uncompared: --allow-unaligned).
    """
    from tdiff.bisect import bisect_dumps
    from tdiff.compare.engine import CompareOptions, compare_dumps, unaligned_notes
    from tdiff.report.model import build_report
    from tdiff.report.progress import progress_bar

    if as_json:
        if fmt not in ("md", "json") or gh_comment:
            raise TdiffError("--json is --format json; drop --format/--gh-comment")
        fmt = "json"
    if gh_comment and (fmt != "md" or out is not None):
        raise TdiffError("--gh-comment prints Markdown on standard output; drop --format/--out")
    tolerance = tolerance_from(exact, atol, rtol, ulp)
    patches = _read_patch_results(patch_results) if patch_results else None
    if fmt == "html":
        from tdiff.report.plots import require_matplotlib

        require_matplotlib()  # fail before the work when matplotlib is missing
    a, b, pairing = dumps_from(dump_a, dump_b, allow_incomplete, mapping, align)
    with progress_bar("comparing", quiet=quiet) as advance:
        compared = compare_dumps(a, b, CompareOptions(tolerance=tolerance, layers=layers, select=list(select),
                                                      exclude=list(exclude)),
                                 pairing=pairing, progress=advance, jobs=jobs)
    notes = unaligned_notes(compared.alignment, diverged=compared.status != "match", allow_unaligned=allow_unaligned)
    bisected = bisect_dumps(a, b, tolerance=tolerance, pairing=pairing, allow_unaligned=allow_unaligned,
                            jobs=jobs) if with_bisect else None
    with progress_bar("writing the report", quiet=quiet):
        result = build_report(compared, bisect=bisected, patch_results=patches, notes=notes)
        text = _render(result, fmt, gh_comment)
    if out is None:
        click.echo(text, nl=False)
    else:
        try:
            out.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise TdiffError(f"cannot write {out}: {exc.strerror}") from None
        if not quiet:
            click.echo(f"tdiff: wrote {out} ({len(text.encode()):,} bytes, {result.status})", err=True)
    sys.exit(0 if result.status == "match" else 1)


def _render(result, fmt: str, gh_comment: bool) -> str:
    if fmt == "json":
        return json.dumps(result.to_json(), indent=1) + "\n"
    if fmt == "html":
        from tdiff.report.html import render_html

        return render_html(result)
    from tdiff.report.markdown import render_markdown

    return render_markdown(result, gh_comment=gh_comment)


def _read_patch_results(path: Path):
    from tdiff.report.model import read_patch_results
    from tdiff.store.files import read_regular

    try:
        text = read_regular(path, "file").decode("utf-8")
    except TdiffError as exc:
        raise TdiffError(f"--patch-results {exc}") from None
    except UnicodeDecodeError as exc:
        raise TdiffError(f"--patch-results {path}: cannot read it ({exc})") from None
    return read_patch_results(text, f"--patch-results {path}")
