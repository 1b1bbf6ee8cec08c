"""tdiff bisect: name the first op boundary that introduces a divergence."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import click

from tdiff.cli.options import align_option, name_filter_options, quiet_option, tolerance_from, tolerance_options
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
@click.option("--graft", is_flag=True, help="Rerun side B with the culprit's inputs taken from side A: "
                                            "does the op differ on identical inputs?")
@click.option("--try", "try_spec", metavar="builtin|builtin:NAMES|FILE",
              help="After locating the culprit, rerun side B (--run-b) under candidate fixes and rank them "
                   "against side A: `builtin` tries the catalogue's entries for the culprit's kind.")
@click.option("--budget-gb", type=float, metavar="N",
              help="Online: the most tensor data one full capture may store per side (GiB).")
@click.option("--no-stats-pass", is_flag=True,
              help="Online: no stats pass; binary-search boundaries with selective captures.")
@click.option("--steps", metavar="RANGES", help="Online: only these steps (forward passes), e.g. 0-1.")
@click.option("--workdir", "--work", "work", type=click.Path(file_okay=False, path_type=Path),
              help="Online and --graft: keep the runs' captures and logs in this new directory "
                   "(default: a temporary one, removed at the end).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--allow-incomplete", is_flag=True,
              help="Bisect what an incomplete dump holds; tensors it lacks are reported missing, never named "
                   "as the culprit.")
@click.option("--mapping", type=click.Path(dir_okay=False), metavar="FILE",
              help="YAML mapping of module paths to canonical boundaries, for models no adapter knows.")
@align_option
@quiet_option
def bisect(dumps, run_a, run_b, exact, atol, rtol, select, exclude, graft, try_spec, budget_gb, no_stats_pass,
           steps, work, as_json, allow_incomplete, mapping, align, quiet):
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
    keep only the tensors whose name (canonical name, when aligned) they leave, as in compare.

    Exit status: 0 match, 1 diverged, 2 bad input.
    """
    from tdiff.bisect.render import render_bisect
    from tdiff.compare.pairing import NameFilter
    from tdiff.report.console import make_console

    tolerance = tolerance_from(exact, atol, rtol)
    names = NameFilter.of(select, exclude)
    online = run_a is not None and not dumps
    _check_usage(dumps, run_a, run_b, graft or try_spec is not None, online, budget_gb, no_stats_pass, steps, work)
    if try_spec is not None and run_b is None:
        raise TdiffError("--try reruns side B under each candidate: give its command with --run-b")
    progress = make_console(stderr=True, quiet=quiet)
    with _work_dir(work, needed=online or graft or try_spec is not None) as work_dir:
        if online:
            result, runner, final_a = _online(run_a, run_b, work_dir, tolerance, budget_gb,
                                              no_stats_pass, steps, names, progress)
        elif len(dumps) == 1:
            from tdiff.bisect.repeats import bisect_repeats

            result, runner, final_a = bisect_repeats(dumps[0], tolerance=tolerance, allow_incomplete=allow_incomplete,
                                                     pairing=names.applied_to(None)), None, None
        else:
            from tdiff.align import choose_pairing
            from tdiff.bisect.runs import Runner
            from tdiff.bisect.walk import bisect_dumps
            from tdiff.store import open_dump

            final_a = open_dump(dumps[0], allow_incomplete=allow_incomplete)
            dump_b = open_dump(dumps[1], allow_incomplete=allow_incomplete)
            result = bisect_dumps(final_a, dump_b, tolerance=tolerance,
                                  pairing=names.applied_to(choose_pairing(final_a, dump_b, mapping, align)))
            runner = Runner({"B": run_b}, work_dir, lambda line: progress.print(line, highlight=False)) \
                if graft else None
        if graft and result.first_divergence is not None:
            from tdiff.bisect.graft import run_graft

            if final_a is None:
                raise TdiffError("--graft needs side A's tensors, and no full capture was made")
            run_graft(runner, final_a, result, tolerance)
            if not online:
                result.runs = runner.log
        if try_spec is not None and result.first_divergence is not None:
            result.trials = _try_fixes(try_spec, result, final_a, run_b, work_dir, tolerance, progress)
        if as_json:
            click.echo(json.dumps(result.to_json(), indent=1))
        else:
            render_bisect(result, make_console())
            if work is None and (online or graft) and not quiet:
                click.echo("(the runs' captures were removed; pass --workdir DIR to keep them)")
    sys.exit(result.exit_code)


def _try_fixes(spec: str, result, dump_a, run_b: str, work_dir: Path, tolerance, progress):
    """Rank candidate fixes for the culprit: the catalogue's entries for its kind, or those named."""
    from tdiff.source_patcher.catalogue import candidates_from, entries_for_kind
    from tdiff.source_patcher.trial import try_candidates

    if dump_a is None:
        raise TdiffError("--try needs side A's tensors, and no full capture was made")
    kind = result.first_divergence.kind
    candidates = entries_for_kind(kind) if spec == "builtin" else candidates_from(spec)
    if not candidates:
        raise TdiffError(f"the catalogue has no fix for kind {kind!r}; give your own with --try FILE")

    def report(trial, done, total):
        progress.print(f"tdiff: try [{done}/{total}] {trial.name}: {trial.status}", highlight=False, markup=False)

    return try_candidates(candidates, dump_a.path, ["/bin/sh", "-c", run_b], workdir=work_dir / "try",
                          tolerance=tolerance, progress=report)


def _check_usage(dumps, run_a, run_b, reruns_b, online, budget_gb, no_stats_pass, steps, work) -> None:
    """``reruns_b``: --graft or --try, which rerun side B from two dumps."""
    if online:
        if run_b is None:
            raise TdiffError("--run-a needs --run-b: bisect runs both commands")
    elif run_a is not None:
        raise TdiffError("give either two dumps or --run-a/--run-b, not both")
    elif len(dumps) not in (1, 2):
        raise TdiffError("give two dumps (A B), a folder of `tdiff capture --repeat`, or --run-a and --run-b")
    if not online and (budget_gb is not None or no_stats_pass or steps is not None):
        raise TdiffError("--budget-gb, --no-stats-pass and --steps apply to online bisection (--run-a/--run-b)")
    if budget_gb is not None and not budget_gb > 0:
        raise TdiffError(f"--budget-gb must be a positive number of GiB, not {budget_gb}")
    if reruns_b and not online and (len(dumps) != 2 or run_b is None):
        raise TdiffError("--graft and --try on two dumps need --run-b CMD: the command that reruns side B")
    if not reruns_b and not online and run_b is not None:
        raise TdiffError("--run-b without --run-a is only for --graft and --try")
    if work is not None and not (online or reruns_b):
        raise TdiffError("--workdir applies to online bisection, --graft and --try, which run commands")


class _work_dir:
    """--workdir DIR (created, kept) or a temporary directory removed at the end."""

    def __init__(self, work: Path | None, needed: bool):
        self.work, self.needed = work, needed
        self.path: Path | None = None

    def __enter__(self) -> Path | None:
        if not self.needed:
            return None
        if self.work is None:
            self.path = Path(tempfile.mkdtemp(prefix="tdiff-bisect-"))
            return self.path
        if self.work.exists() and any(self.work.iterdir()):
            raise TdiffError(f"--workdir {self.work} is not empty; choose a new directory")
        self.work.mkdir(parents=True, exist_ok=True)
        return self.work

    def __exit__(self, *exc_info) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


def _online(run_a, run_b, work, tolerance, budget_gb, no_stats_pass, steps, names, progress):
    from tdiff.bisect.online import OnlineOptions, bisect_commands
    from tdiff.vocab.parse import parse_ranges

    parse_ranges(steps, "--steps")
    options = OnlineOptions(tolerance=tolerance, stats_pass=not no_stats_pass, steps=steps, names=names,
                            budget_bytes=int(budget_gb * GIB) if budget_gb is not None else None)
    return bisect_commands(run_a, run_b, work, options, lambda line: progress.print(line, highlight=False))
