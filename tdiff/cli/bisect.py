"""tdiff bisect: name the first op boundary that introduces a divergence."""

from __future__ import annotations

import json
import sys

import click

from tdiff.cli.options import (align_option, allow_incomplete_option, allow_unaligned_option, capture_options,
                               jobs_option, json_option, layers_option, mapping_option, name_filter_options,
                               quiet_option, tolerance_from, tolerance_options, workdir_option)
from tdiff.errors import TdiffError

GIB = 1 << 30


@click.command()
@click.argument("dumps", nargs=-1, metavar="[A B | REPEATS]")
@click.option("--run-a", metavar="CMD", help="Online: side A's command line (run by /bin/sh) that bisect "
                                             "runs under capture.")
@click.option("--run-b", metavar="CMD", help="Online: side B's command line (with --graft on two dumps: "
                                             "the command that reruns side B).")
@tolerance_options
@name_filter_options
@layers_option()
@click.option("--graft", is_flag=True, help="Rerun side B with the culprit's inputs taken from side A: "
                                            "does the op differ on identical inputs?")
@click.option("--try", "try_spec", metavar="builtin|builtin:NAMES|FILE",
              help="After locating the culprit, rerun side B (--run-b) under candidate fixes and rank them "
                   "against side A: `builtin` tries the catalogue's entries for the culprit's kind.")
@click.option("--budget-gb", type=float, metavar="N",
              help="Online: the most tensor data one full capture may store per side (GiB).")
@click.option("--no-stats-pass", is_flag=True,
              help="Online: no stats pass; binary-search boundaries with selective captures.")
@capture_options("steps", note="; online bisection only")
@workdir_option(" (online bisection, --graft and --try; default: a temporary one, removed at the end)")
@json_option
@allow_incomplete_option("; tensors it lacks are reported missing, never named as the culprit")
@allow_unaligned_option
@mapping_option
@align_option
@quiet_option
@jobs_option
def bisect(dumps, run_a, run_b, exact, atol, rtol, ulp, select, exclude, layers, graft, try_spec, budget_gb,
           no_stats_pass, steps, work, as_json, allow_incomplete, allow_unaligned, mapping, align, quiet, jobs):
    """Name the first op boundary where two runs part, and what kind of op it is.

    \b
    tdiff bisect dumps/a dumps/b                       two dumps
    tdiff bisect dumps/a dumps/b --graft --run-b "python run.py --planted"
    tdiff bisect dumps/rep                             the runs of `tdiff capture --repeat N`
    tdiff bisect --run-a "python run.py" --run-b "python run.py --planted"

    The culprit is the module whose inputs match but whose output differs (the deepest such),
    or the code between two recorded events of a forward when an input already differs. Online,
    bisect captures each command itself: a stats pass first, or (with --no-stats-pass or a
    tolerance) a binary search over the decoder layers, O(log N) runs, then one full capture of
    the narrowed region. docs/BISECT.md has the rules.

    Dumps of different frameworks or parallel layouts are paired by canonical op boundary, as
    `tdiff compare` pairs them (--mapping for models no adapter knows), and runs of different token
    layouts token by token: the first divergence then names its token. --select and --exclude
    keep only the tensors whose name (canonical name, when aligned) they leave, and --layers those
    of these decoder layers, as in compare.

    Exit status: 0 match, 1 diverged, 2 bad input.
    """
    import tdiff.bisect
    from tdiff.compare.distributed import silence_other_ranks
    from tdiff.compare.pairing import NameFilter
    from tdiff.report.console import make_console, render_bisect

    silence_other_ranks()   # under torchrun, one process prints
    if budget_gb is not None and not budget_gb > 0:
        raise TdiffError(f"--budget-gb must be a positive number of GiB, not {budget_gb}")
    progress = make_console(stderr=True, quiet=quiet)
    result = tdiff.bisect.run(
        *dumps, run_a=run_a, run_b=run_b, tolerance=tolerance_from(exact, atol, rtol, ulp),
        names=NameFilter.of(select, exclude, layers), mapping=mapping, align=align, allow_incomplete=allow_incomplete,
        allow_unaligned=allow_unaligned,
        graft=graft,        try_fixes=try_spec, stats_pass=not no_stats_pass, steps=steps, workdir=work,
        budget_bytes=int(budget_gb * GIB) if budget_gb is not None else None,
        echo=lambda line: progress.print(line, highlight=False, markup=False, soft_wrap=True), jobs=jobs)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1))
    else:
        render_bisect(result, make_console())
        if work is None and result.runs is not None and not quiet:
            click.echo("(the runs' captures were removed; pass --workdir DIR to keep them)")
    sys.exit(result.exit_code)

