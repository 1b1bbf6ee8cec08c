"""tdiff compare: pair two dumps' tensors and measure every pair."""

from __future__ import annotations

import json
import sys

import click

from tdiff.cli.options import (align_option, allow_incomplete_option, allow_unaligned_option, dumps_from, jobs_option,
                               json_option, layers_option, mapping_option, name_filter_options, quiet_option,
                               tolerance_from, tolerance_options)


@click.command()
@click.argument("dump_a", metavar="A")
@click.argument("dump_b", metavar="B")
@layers_option()
@name_filter_options
@tolerance_options
@json_option
@click.option("--top", type=int, default=50, show_default=True,
              help="Show at most K rows: the K worst divergences and the first one (0: all).")
@click.option("--wide", is_flag=True, help="Every column and whole tensor names, however wide the terminal.")
@allow_incomplete_option()
@allow_unaligned_option
@mapping_option
@align_option
@quiet_option
@jobs_option
def compare(dump_a, dump_b, layers, select, exclude, exact, atol, rtol, ulp, as_json, top, wide, allow_incomplete,
            allow_unaligned, mapping, align, quiet, jobs):
    """Compare dumps A and B tensor by tensor.

    Dumps of one framework with one parallel layout pair tensors by name, step, call index, role
    and rank. Otherwise (HF vs Megatron vs SGLang, TP=2 vs TP=1, or --mapping) tensors pair by
    canonical op boundary (docs/BOUNDARIES.md): adapters picked from the model's classes
    reassemble shards and move tokens first; boundaries a framework does not expose are listed.

    When both dumps carry token metadata and their steps or token layouts differ (an engine's
    prefill and decode steps against a trainer's one forward; ragged, padded or packed), tensors
    pair token by token (docs/ALIGNMENT.md): sequences match by their token ids, each row by
    (sequence, position); rows show tokens equal of tokens compared. A position one side lacks
    (the last sampled token) is listed, not a divergence. A row of a token both runs fed that
    cannot be compared (not located, a fragment, a step without metadata) makes a match exit 2,
    unless --allow-unaligned. --align forces a pairing.

    The verdict is bitwise unless --atol/--rtol/--ulp relax it. A tensor on one side only counts as a
    divergence.

    Under `torchrun --nnodes K --nproc-per-node M -m tdiff compare A B` the dumps' ranks are
    split over the processes (a shared filesystem); the first process prints the one verdict, and
    on stderr a line for each process: the ranks dealt to it, what it compared and what it read.

    Exit status: 0 all tensors match, 1 a divergence, 2 bad input (or tokens left uncompared).
    """
    from tdiff.compare.distributed import silence_other_ranks
    from tdiff.compare.engine import CompareOptions, compare_dumps, unaligned_notes
    from tdiff.report.console import make_console, render_compare
    from tdiff.report.progress import progress_bar

    silence_other_ranks()
    tolerance = tolerance_from(exact, atol, rtol, ulp)
    a, b, pairing = dumps_from(dump_a, dump_b, allow_incomplete, mapping, align)
    with progress_bar("comparing", quiet=quiet) as advance:
        report = compare_dumps(a, b, CompareOptions(tolerance=tolerance, layers=layers, select=list(select),
                                                  exclude=list(exclude)),
                               pairing=pairing, progress=advance, jobs=jobs,
                               echo=None if quiet else lambda line: click.echo(line, err=True))
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        render_compare(report, make_console(), top=top, wide=wide)
    unaligned_notes(report.alignment, diverged=report.status != "match", allow_unaligned=allow_unaligned)
    sys.exit(0 if report.status == "match" else 1)
