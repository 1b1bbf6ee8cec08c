"""tdiff compare: pair two dumps' tensors and measure every pair."""

from __future__ import annotations

import json
import sys

import click

from tdiff.cli.options import (align_option, allow_incomplete_option, dumps_from, json_option, layers_option,
                               mapping_option, name_filter_options, quiet_option, tolerance_from, tolerance_options)


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
@mapping_option
@align_option
@quiet_option
def compare(dump_a, dump_b, layers, select, exclude, exact, atol, rtol, as_json, top, wide, allow_incomplete, mapping,
            align, quiet):
    """Compare dumps A and B tensor by tensor.

    Dumps of one framework with one parallel layout pair tensors by name, step, call index, role
    and rank. Otherwise (HF vs Megatron vs SGLang, TP=2 vs TP=1, or --mapping) tensors pair by
    canonical op boundary (docs/BOUNDARIES.md): adapters picked from the model's classes
    reassemble shards and move tokens first; boundaries a framework does not expose are listed.

    When both dumps carry token metadata and their steps or token layouts differ (an engine's
    prefill and decode steps against a trainer's one forward; ragged, padded or packed), tensors
    pair token by token (docs/ALIGNMENT.md): sequences match by their token ids, each row by
    (sequence, position); rows show tokens equal of tokens compared. A position one side lacks
    (the last sampled token) is listed, not a divergence. --align forces a pairing.

    The verdict is bitwise unless --atol/--rtol relax it. A tensor on one side only counts as a
    divergence.

    Exit status: 0 all tensors match, 1 a divergence, 2 bad input.
    """
    from tdiff.compare.engine import CompareOptions, compare_dumps
    from tdiff.report.console import make_console, render_compare
    from tdiff.report.progress import progress_bar

    tolerance = tolerance_from(exact, atol, rtol)
    a, b, pairing = dumps_from(dump_a, dump_b, allow_incomplete, mapping, align)
    with progress_bar("comparing", quiet=quiet) as advance:
        report = compare_dumps(a, b, CompareOptions(tolerance=tolerance, layers=layers, select=list(select),
                                                  exclude=list(exclude)),
                               pairing=pairing, progress=advance)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        render_compare(report, make_console(), top=top, wide=wide)
    sys.exit(0 if report.status == "match" else 1)
