"""Options shared by several commands, and their conversion to library objects.

Each option family is declared once here; a command that needs a word of its own on one adds it
as ``note`` (appended to the help). Light at import (no torch): `tdiff CMD --help` must answer at
once, so library modules are imported where an option is converted."""

from __future__ import annotations

import math
from pathlib import Path

import click

from tdiff.errors import TdiffError


def tolerance_options(command):
    command = click.option("--ulp", type=float, metavar="N", help=(
        "Equal within N ULPs at each tensor's scale: an element matches when |a-b| <= N * ulp(max |x|), "
        "max |x| over both tensors (the 'ULP at scale' compare prints); adds to --atol/--rtol. Fp32 noise "
        "across frameworks grows with the activations, so a fixed --atol misjudges large ones."))(command)
    command = click.option("--rtol", type=float, help=(
        "Relative tolerance: an element matches when |a-b| <= atol + rtol*max(|a|,|b|) (the same "
        "with A and B swapped); an infinity matches only itself, NaN only NaN."))(command)
    command = click.option("--atol", type=float, help="Absolute tolerance (relaxes the bitwise verdict).")(command)
    command = click.option("--exact", is_flag=True, help="Bitwise verdict (the default).")(command)
    return command


def tolerance_from(exact: bool, atol: float | None, rtol: float | None, ulp: float | None):
    from tdiff.compare.metrics import EXACT, Tolerance

    if exact and (atol is not None or rtol is not None or ulp is not None):
        raise TdiffError("--exact cannot be combined with --atol/--rtol/--ulp")
    for name, value in (("--atol", atol), ("--rtol", rtol), ("--ulp", ulp)):
        if value is not None and not 0 <= value < math.inf:
            raise TdiffError(f"{name} must be a non-negative number, not {value}")
    if atol is None and rtol is None and ulp is None:
        return EXACT
    if ulp is not None and atol is None and rtol is None:
        return Tolerance(ulp=ulp)
    return Tolerance(atol=atol or 0.0, rtol=rtol or 0.0, ulp=ulp)


def name_filter_options(command):
    """--select and --exclude on the tensors a command compares (compare, bisect, report)."""
    command = click.option("--exclude", multiple=True, metavar="REGEX",
                           help="Skip tensors whose name matches (repeatable).")(command)
    command = click.option("--select", multiple=True, metavar="REGEX",
                           help="Only tensors whose name matches (repeatable).")(command)
    return command


def layers_option(note: str = "", what: str = "Only tensors of"):
    """--layers RANGES (alias --layer): the decoder layers a command compares (compare, bisect,
    report) or records (``what``: capture, patch try); parsed by tdiff.vocab.parse.parse_ranges."""
    return click.option("--layers", "--layer", "layers", metavar="RANGES",
                        help=f"{what} these decoder layers, e.g. 1 or 0-3,7{note}.")


def capture_selection_options(note: str = ""):
    """--select, --exclude, --layers and --steps: what a capture records (capture, patch try);
    check them with :func:`check_capture_selection`."""
    def decorate(command):
        command = steps_option(note)(command)
        command = layers_option(note, what="Record only")(command)
        command = click.option("--exclude", multiple=True, metavar="REGEX",
                               help=f"Skip modules and dumps whose name matches (repeatable){note}.")(command)
        command = click.option("--select", multiple=True, metavar="REGEX",
                               help=f"Record only modules whose path matches (repeatable){note}.")(command)
        return command
    return decorate


def steps_option(note: str = ""):
    """--steps alone, for bisect's runs; with the rest of the selection: capture_selection_options."""
    return click.option("--steps", metavar="RANGES", help=f"Record only these steps (forward passes), e.g. 0-1{note}.")


def check_capture_selection(select=(), exclude=(), layers: str | None = None, steps: str | None = None) -> None:
    """Refuse a bad capture selection before any command starts; the capture itself reads the
    values as written (tdiff.launch.CaptureConfig)."""
    from tdiff.vocab.parse import compile_patterns, parse_ranges

    compile_patterns(select, "--select")
    compile_patterns(exclude, "--exclude")
    parse_ranges(layers, "--layers")
    parse_ranges(steps, "--steps")


def batch_row_option(note: str = ""):
    return click.option("--batch-row", type=click.IntRange(min=0), metavar="N",
                        help="Record only row N of tensors whose leading dimension is the batch size (one "
                             f"sequence of a batch, to compare with it scored alone){note}.")


def workdir_option(note: str):
    """--workdir (alias --work) DIR, a new directory for the runs of a command that runs commands;
    ``note`` says when it applies and its default."""
    return click.option("--workdir", "--work", "work", type=click.Path(file_okay=False, path_type=Path),
                        help=f"A new directory for the runs' dumps and logs{note}.")


def mapping_option(command):
    return click.option("--mapping", type=click.Path(dir_okay=False), metavar="FILE",
                        help="YAML mapping of module paths to canonical boundaries, for models no adapter "
                             "knows.")(command)


def allow_incomplete_option(note: str = ""):
    return click.option("--allow-incomplete", is_flag=True, help=f"Use what an incomplete dump holds{note}.")


def allow_unaligned_option(command):
    return click.option("--allow-unaligned", is_flag=True, help=(
        "Runs aligned by token: accept rows of tokens both runs fed that could not be compared (listed as "
        "a note) instead of exit 2."))(command)


def dumps_from(dump_a: str, dump_b: str, allow_incomplete: bool, mapping: str | None, align: str | None = None):
    """Dumps A and B opened as --allow-incomplete says, and their pairing (--align, --mapping, else
    the one their frameworks, layouts and token metadata call for)."""
    from tdiff.align import choose_pairing
    from tdiff.store.reader import open_dump

    a = open_dump(dump_a, allow_incomplete=allow_incomplete)
    b = open_dump(dump_b, allow_incomplete=allow_incomplete)
    return a, b, choose_pairing(a, b, mapping, align)


def json_option(command):
    return click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")(command)


def quiet_option(command):
    return click.option("--quiet", "-q", is_flag=True,
                        help="No progress bars or informational messages (for CI); warnings still print.")(command)


def align_option(command):
    """--align on the commands that pair two dumps (compare, bisect, report)."""
    return click.option("--align", type=click.Choice(["tokens", "names", "boundaries"]), help=(
        "Force how tensors pair (default: chosen from the dumps): by module name, step and call; by "
        "canonical op boundary (across frameworks and parallel layouts); or by token, over either "
        "(prefill and decode steps against one forward; docs/ALIGNMENT.md)."))(command)


def jobs_option(command):
    """--jobs N: how many pairs of tensors are loaded and measured at once (compare, bisect, report, patch try)."""
    import os

    cores = len(os.sched_getaffinity(0))
    return click.option("--jobs", "-j", type=click.IntRange(min=1), default=cores, show_default="the cores this "
                        "process may use", help="Load, check and measure this many tensor pairs at once.")(command)
