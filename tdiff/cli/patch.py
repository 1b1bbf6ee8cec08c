"""tdiff patch: apply source patches to a command, check them against the installed packages, and
try candidate fixes against a baseline dump (docs/PATCHES.md)."""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
from pathlib import Path

import click

from tdiff.cli.options import (allow_unaligned_option, capture_options, capture_options_from, jobs_option,
                               json_option, quiet_option, tolerance_from, tolerance_options, workdir_option)
from tdiff.errors import TdiffError

_RUN = {"allow_interspersed_args": False}
_config_option = click.option("--config", "config", required=True, metavar="FILE[:NAMES]|builtin[:NAMES]",
                              help="Patch file (FILE:NAME,... for some of its patches), or builtin / "
                                   "builtin:NAME,... for catalogue entries.")


@click.group()
def patch():
    """Apply, check and try source patches: candidate fixes for a divergence.

    Patch files are YAML (docs/PATCHES.md); `builtin` names the catalogue of known fixes.
    """


@patch.command(context_settings=_RUN)
@_config_option
@quiet_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def apply(config, quiet, command):
    """Run COMMAND with the patches active in every Python process it starts.

    \b
    tdiff patch apply --config fixes.yaml -- python run.py
    tdiff patch apply --config builtin:rmsnorm-fp32 -- tdiff capture --out dumps/b -- python run.py

    Every patch is checked against the installed packages first; one that no longer applies stops
    here (exit 2). In the command's processes a patch applies when its module is imported; one
    that fails there ends that process with status 2. Exit status: the command's own (3 when
    tdiff itself failed).
    """
    from tdiff.launch import exit_status, run_command
    from tdiff.source_patcher.bootstrap import child_config, read_applied_log
    from tdiff.source_patcher.catalogue import patches_from

    patches = patches_from(config)
    _refuse_stale([patches])
    with tempfile.TemporaryDirectory(prefix="tdiff-patch-") as scratch:
        log = str(Path(scratch) / "applied.jsonl")
        returncode = run_command(list(command), patches=child_config(patches, applied_log=log))
        applied = read_applied_log(log)
    took = sorted({entry["patch"] for entry in applied})
    never = [p.name for p in patches if p.name not in took]
    processes = len({entry["pid"] for entry in applied})
    if not quiet or never:  # a patch that never applied is a warning
        click.echo(f"tdiff: {len(took)} of {len(patches)} patch(es) applied in {processes} process(es)"
                   + (f"; never applied (target module not imported): {', '.join(never)}" if never else ""),
                   err=True)
    if returncode != 0:
        sys.exit(exit_status(returncode))


@patch.command()
@_config_option
@json_option
@quiet_option
def check(config, as_json, quiet):
    """Check that every patch still applies to the installed packages, running nothing.

    For CI after an upgrade: targets are found in the installed files, pins compared, edits
    applied and compiled. Exit status: 0 all apply, 2 a patch no longer applies (named).
    """
    from tdiff.source_patcher.catalogue import patches_from
    from tdiff.source_patcher.check import STALE, check_patches

    results = check_patches(patches_from(config))
    stale = [r for r in results if r.status == STALE]
    if as_json:
        click.echo(json.dumps({"status": "stale" if stale else "ok", "patches": [r.to_json() for r in results]},
                              indent=1))
    else:
        for r in results:
            if quiet and r.status != STALE:
                continue
            detail = f": {r.reason}" if r.reason else f"  ({r.location}, sha256 {r.sha256})" if r.sha256 else ""
            click.echo(f"{r.status:<13} {r.patch.name}  {r.patch.target}{detail}")
    if stale:
        raise TdiffError(_stale_message(stale, len(results)))


@patch.command("try", context_settings=_RUN)
@click.option("--candidates", required=True, metavar="FILE[:NAMES]|builtin[:NAMES]",
              help="Patch file (each patch, then each combination it lists; FILE:NAME,... for some of "
                   "them), or catalogue entries.")
@click.option("--baseline", required=True, metavar="DUMP_A", help="The dump run B should match.")
@workdir_option(" (default: a new ./tdiff-try-* directory)")
@capture_options("select", "exclude", "layers", "steps", note=", as for the baseline")
@capture_options("batch_row", note="; COMMAND_B's runs only")
@click.option("--rerun-baseline", metavar="CMD_A",
              help="Also capture side A again under each candidate (CMD_A, split like a shell) and "
                   "compare with that: for fixes both sides must share, such as batch invariance.")
@tolerance_options
@allow_unaligned_option
@json_option
@quiet_option
@jobs_option
@click.argument("command_b", nargs=-1, required=True, type=click.UNPROCESSED)
def try_(candidates, baseline, work, select, exclude, layers, steps, batch_row, rerun_baseline, exact, atol,
         rtol, ulp, allow_unaligned, as_json, quiet, jobs, command_b):
    """Run COMMAND_B once unpatched and once per candidate; rank the candidates against DUMP_A.

    \b
    tdiff patch try --candidates builtin --baseline dumps/a -- python run.py --engine
    tdiff patch try --candidates fixes.yaml --baseline dumps/a --json -- python run.py

    Each run is captured (with the baseline's mode) into --workdir and compared with the
    baseline. Ranking: a match first, then the first divergence moved furthest later than in the
    unpatched control, then fewer mismatched tensors, then smaller ULP at scale.
    Exit status: 0 some candidate matches, 1 none does, 2 bad input or the control run failed.
    """
    from tdiff.report.console import make_console, render_trials
    from tdiff.source_patcher.catalogue import candidates_from
    from tdiff.source_patcher.trial import try_candidates

    tolerance = tolerance_from(exact, atol, rtol, ulp)
    selection = capture_options_from({"select": select, "exclude": exclude, "layers": layers, "steps": steps,
                                      "batch_row": batch_row})
    chosen = candidates_from(candidates)
    _refuse_stale([list(c.patches) for c in chosen])
    console = make_console(stderr=True, quiet=quiet)

    def progress(result, done, total):
        where = result.first_divergence.name if result.first_divergence else ""
        console.print(f"tdiff: [{done}/{total}] {result.name}: {result.status}"
                      + (f", first divergence {where}" if where else "")
                      + (f" ({result.reason})" if result.reason else ""), highlight=False, markup=False)

    report = try_candidates(chosen, baseline, list(command_b), workdir=work, tolerance=tolerance,
                            selection=selection,
                            baseline_command=shlex.split(rerun_baseline) if rerun_baseline else None,
                            allow_unaligned=allow_unaligned, progress=progress, jobs=jobs)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        render_trials(report, make_console())
    sys.exit(0 if report.matched else 1)


def _refuse_stale(groups) -> None:
    """Check each group of patches (what one run applies together) as it will be applied."""
    from tdiff.source_patcher.check import STALE, CheckResult, check_patches

    stale: dict[str, CheckResult] = {}
    names: set[str] = set()
    for patches in groups:
        names.update(p.name for p in patches)
        for result in check_patches(patches):
            if result.status == STALE:
                stale.setdefault(result.patch.name, result)
    if stale:
        raise TdiffError(_stale_message(list(stale.values()), len(names)))


def _stale_message(stale, total: int) -> str:
    first = stale[0]
    more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
    return (f"{len(stale)} of {total} patch(es) no longer apply: patch {first.patch.name!r} "
            f"({first.patch.target}, {first.patch.origin}): {first.reason}{more}")

