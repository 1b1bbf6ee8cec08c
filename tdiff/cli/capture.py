"""tdiff capture: run a command with capture active in every Python process it starts."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tdiff.cli.options import batch_row_option, capture_selection_options, check_capture_selection, quiet_option
from tdiff.errors import TdiffError
from tdiff.store.manifest import DATA_DIR, DUMP_FILE, MANIFEST_DIR, STORAGES, describe_exit, read_part
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
                                        "none, from a failed run, is replaced anyway).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="Run the command N times into --out/run-1 ... run-N; `tdiff bisect OUT` then "
                   "names the first op that is not bitwise repeatable.")
@quiet_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def capture(out, side, select, exclude, layers, steps, ops, mode, storage, max_pending, batch_row, graph_budget,
            force, repeat, quiet, command):
    """Run COMMAND and dump module inputs and outputs of every Python process it starts.

    \b
    tdiff capture --out dumps/a -- python run.py
    tdiff capture --out dumps/b --layers 0-3 --mode stats -- torchrun --nproc-per-node 2 train.py
    tdiff capture --out dumps/rep --repeat 5 -- python run.py
    tdiff capture --out dumps/a --ops '^model\\.layers\\.1\\.self_attn$' -- python run.py

    Each process (rank) writes its own manifest and shards into --out. Exit status: the
    command's own when it fails, 2 when nothing was captured, 3 when tdiff itself failed, else 0.
    """
    from dataclasses import replace

    from tdiff.launch import CaptureConfig, exit_status, run_command
    from tdiff.vocab.parse import compile_patterns

    check_capture_selection(select, exclude, layers, steps)
    compile_patterns(ops, "--ops")
    config = CaptureConfig(out=out, side=side or out.name, mode=mode, storage=storage, select=tuple(select),
                           exclude=tuple(exclude), layers=layers, steps=steps, batch_row=batch_row,
                           max_pending_bytes=parse_size(max_pending, "--max-pending"),
                           graph_budget_bytes=parse_size(graph_budget, "--graph-budget"), ops=tuple(ops))
    _prepare_out(out, force)
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


def _prepare_out(out: Path, force: bool) -> None:
    if not out.exists() or not any(out.iterdir()):
        return
    from tdiff.store.repeats import REPEAT_FILE

    if not ((out / DUMP_FILE).is_file() or (out / REPEAT_FILE).is_file()):
        raise TdiffError(f"{out} exists and is not a dump; choose another --out")
    # a run that failed before recording anything leaves nothing to protect: the retry replaces it
    if not force and _holds_records(out):
        raise TdiffError(f"{out} already holds a dump; pass --force to replace it")
    foreign = None if force else _file_tdiff_did_not_write(out)
    if foreign is not None:
        raise TdiffError(f"{out} holds {foreign.relative_to(out)}, which tdiff did not write; "
                         "pass --force to replace the dump and it, or choose another --out")
    if out.is_symlink():
        raise TdiffError(f"{out} is a symbolic link; --force replaces only a dump directory itself: "
                         f"pass the directory it points to ({os.path.realpath(out)}) or another --out")
    try:
        shutil.rmtree(out)
    except OSError as exc:
        raise TdiffError(f"cannot remove the dump in {out} ({exc.strerror or exc}); "
                         "remove it yourself or choose another --out") from None


def _holds_records(folder: Path) -> bool:
    """Whether a dump (or a repeat folder's runs) holds any record or tensor data, complete or
    not; a manifest that cannot be read counts as holding some."""
    from tdiff.errors import DumpError

    for manifest in folder.rglob(f"{MANIFEST_DIR}/*.jsonl"):
        try:
            if read_part(manifest).records:
                return True
        except DumpError:
            if manifest.stat().st_size > 0:
                return True
    return any(path.is_file() for data in folder.rglob(DATA_DIR) for path in data.rglob("*"))


_REPEAT_RUN = re.compile(r"run-\d+")


def _file_tdiff_did_not_write(folder: Path) -> Path | None:
    """The first path in a dump (or a repeat folder's runs) that capture does not write there: a
    file the command put next to the dump (its log, say), which only --force may remove."""
    from tdiff.bisect.repeats import REPEAT_FILE

    for path in folder.rglob("*"):
        parts = path.relative_to(folder).parts
        if _REPEAT_RUN.fullmatch(parts[0]):
            parts = parts[1:]  # a repeat run's dump
        if not parts or parts in ((DUMP_FILE,), (REPEAT_FILE,), (MANIFEST_DIR,)) or parts[0] == DATA_DIR:
            continue  # (tensor data counts as records: see _holds_records)
        if parts[0] == MANIFEST_DIR and len(parts) == 2 and parts[1].endswith(".jsonl"):
            continue
        return path
    return None


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
