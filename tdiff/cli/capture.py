"""tdiff capture: run a command with capture active in every Python process it starts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tdiff.cli.options import capture_options, capture_options_from, quiet_option
from tdiff.errors import TdiffError
from tdiff.store.manifest import describe_exit

if TYPE_CHECKING:
    from tdiff.launch import CaptureConfig


@click.command(context_settings={"allow_interspersed_args": False})
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Dump directory to create.")
@capture_options()
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Run the command N times into --out/run-1 ... run-N; `tdiff bisect OUT` then "
                   "names the first op that is not bitwise repeatable.")
@quiet_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def capture(out, repeat, quiet, command, **options):
    """Run COMMAND and dump module inputs and outputs of every Python process it starts.

    \b
    tdiff capture --out dumps/a -- python run.py
    tdiff capture --out dumps/b --layers 0-3 --mode stats -- torchrun --nproc-per-node 2 train.py
    tdiff capture --out dumps/rep --repeat 5 -- python run.py
    tdiff capture --out dumps/a --ops '^model\\.layers\\.1\\.self_attn$' -- python run.py
    tdiff capture --out dumps/a --params -- python run.py

    Each process (rank) writes its own manifest and shards into --out. A second capture of the
    same --out while this one runs is refused (exit 2; a lock, --out/tdiff.lock, that goes with
    the process holding it). Exit status: the command's own when it fails, 2 when nothing was
    captured or --out is taken, 3 when tdiff itself failed, else 0.
    """
    from dataclasses import replace

    from tdiff.launch import CaptureConfig, exit_status, run_command

    config = CaptureConfig(out=out, options=capture_options_from(options))
    lock = _claim_out(out, config.options.force)
    try:
        if repeat == 1:
            runs = [config]
        else:
            from tdiff.store.repeats import write_repeat_index

            runs = [replace(config, out=run, options=replace(config.options, side=f"{config.side} {run.name}"))
                    for run in write_repeat_index(out, repeat, list(command))]
        for run in runs:
            returncode = run_command(list(command), capture=run)
            _summarize(run, returncode, quiet)
            if returncode != 0:
                sys.exit(exit_status(returncode))
    finally:
        lock.release()


def _claim_out(out: Path, force: bool):
    """Lock ``out`` for this command's run and empty it: a second capture of the same directory is
    refused while this one runs (the command's own processes write their parts into it unlocked)."""
    import shlex

    from tdiff.store.ownership import DumpLock, Holder, check_is_dump, new_run_id, prepare_folder, refuse_held

    check_is_dump(out, _ELSEWHERE)  # before a lock file is put into it
    with DumpLock.deciding(out) as lock:
        if isinstance(lock, Holder):
            raise refuse_held(out, lock, _ELSEWHERE)
        try:
            prepare_folder(out, force=force, force_hint="--force", elsewhere=_ELSEWHERE)
            lock.announce(new_run_id(), shlex.join(["tdiff", *sys.argv[1:]]))
        except BaseException:
            lock.release()
            raise
    return lock


_ELSEWHERE = "choose another --out"


def _summarize(config: CaptureConfig, returncode: int, quiet: bool) -> None:
    from tdiff.errors import DumpError
    from tdiff.report.progress import progress_bar
    from tdiff.store.reader import open_dump

    out = config.out
    # the module filters given: when they match no module, only explicit dumps are recorded
    options = config.options
    filters = " and ".join([f"--select {' '.join(options.select)}"] * bool(options.select)
                           + [f"--layers {options.layers}"] * bool(options.layers))
    try:
        with progress_bar("reading the dump's manifests", quiet=quiet):
            dump = open_dump(out, allow_incomplete=True)
    except DumpError as exc:
        if returncode != 0:
            click.echo(f"tdiff: the command {describe_exit(returncode)} and nothing was captured", err=True)
            return
        if filters:
            raise TdiffError(f"{filters} matched no module and nothing else was recorded in {out}; check the "
                             "filter against the model's module paths (a capture without it lists them)") from None
        raise TdiffError(f"{exc}. Is the command running a torch model in Python?") from None
    explicit = sum(1 for r in dump.records if r.role == "explicit")
    if filters and explicit == len(dump.records):
        click.echo(f"tdiff: warning: {filters} matched no module; recorded {explicit} explicit dump(s)", err=True)
    processes = len(dump.parts)
    stored = sum(1 for r in [*dump.records, *dump.ops] if r.has_data and r.alias_of is None)
    ops = f" and {len(dump.ops)} op outputs" if dump.ops else ""
    if not quiet:
        click.echo(f"tdiff: captured {len(dump.records)} tensors{ops} ({stored} stored, the rest by reference "
                   f"or as statistics) from {processes} process(es) into {out}", err=True)
    for problem in dump.problems:
        click.echo(f"tdiff: warning: the dump is incomplete: {problem}", err=True)
