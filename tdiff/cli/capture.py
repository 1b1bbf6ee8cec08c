"""tdiff capture: run a command with capture active in every Python process it starts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tdiff.cli.options import batch_row_option, capture_selection_options, check_capture_selection, quiet_option
from tdiff.errors import TdiffError
from tdiff.store.manifest import STORAGES, describe_exit
from tdiff.vocab.parse import parse_size

if TYPE_CHECKING:
    from tdiff.launch import CaptureConfig


@click.command(context_settings={"allow_interspersed_args": False})
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Dump directory to create.")
@click.option("--side", help="Label of this run in reports (default: the directory name).")
@capture_selection_options()
@click.option("--ops", multiple=True, metavar="REGEX",
              help="Inside the forward of modules whose path matches, record every ATen op's output too, "
                   "with its function and source line (repeatable; docs/BISECT.md).")
@click.option("--params", is_flag=True,
              help="Store each recorded module's parameters and buffers, once per dump (by fingerprint), "
                   "for bisect's exact-reference replay of the culprit (docs/BISECT.md).")
@click.option("--mode", type=click.Choice(["full", "stats"]), default="full", show_default=True,
              help="full: store tensors; stats: fingerprints and statistics only.")
@click.option("--format", "storage", type=click.Choice(list(STORAGES)), default="safetensors",
              show_default=True, help="Tensor file format.")
@click.option("--max-pending", default="2GiB", show_default=True, metavar="SIZE",
              help="Host memory pending writes (copies of GPU tensors) may hold; capture waits at the cap.")
@batch_row_option()
@click.option("--graph-budget", default="1GiB", show_default=True, metavar="SIZE",
              help="GPU memory for the static buffers that record tensors inside CUDA graphs; past "
                   "it, the rest of a graph is recorded as statistics (see docs/GPU.md).")
@click.option("--force", is_flag=True, help="Replace a dump in --out that holds records (one that holds "
                                        "none, from a failed run, is replaced anyway); never one that another "
                                        "capture is still writing.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Run the command N times into --out/run-1 ... run-N; `tdiff bisect OUT` then "
                   "names the first op that is not bitwise repeatable.")
@quiet_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def capture(out, side, select, exclude, layers, steps, ops, params, mode, storage, max_pending, batch_row, graph_budget,
            force, repeat, quiet, command):
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
    from tdiff.vocab.parse import compile_patterns

    check_capture_selection(select, exclude, layers, steps)
    compile_patterns(ops, "--ops")
    config = CaptureConfig(out=out, side=side or out.name, mode=mode, storage=storage, select=tuple(select),
                           exclude=tuple(exclude), layers=layers, steps=steps, batch_row=batch_row,
                           max_pending_bytes=parse_size(max_pending, "--max-pending"),
                           graph_budget_bytes=parse_size(graph_budget, "--graph-budget"), ops=tuple(ops),
                           params=params or None)
    lock = _claim_out(out, force)
    try:
        if repeat == 1:
            runs = [config]
        else:
            from tdiff.store.repeats import write_repeat_index

            runs = [replace(config, out=run, side=f"{config.side} {run.name}")
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
    filters = " and ".join([f"--select {' '.join(config.select)}"] * bool(config.select)
                           + [f"--layers {config.layers}"] * bool(config.layers))
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
