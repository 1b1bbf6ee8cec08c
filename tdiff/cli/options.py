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


def layers_option(note: str = ""):
    """--layers RANGES (alias --layer): the decoder layers a command compares (compare, bisect,
    report); parsed by tdiff.vocab.parse.parse_ranges. (What a capture records: capture_options.)"""
    return click.option("--layers", "--layer", "layers", metavar="RANGES",
                        help=f"Only tensors of these decoder layers, e.g. 1 or 0-3,7{note}.")


def capture_options(*names: str, note: str = ""):
    """The flags of these capture options (every one that has a flag, when none is named), as
    tdiff.capture_options.CaptureOptions declares them, in its order: each passes its value under
    the option's name (a SIZE as written; :func:`capture_options_from` converts it). ``note`` ends
    each help: what the flags are for on a command of its own (patch try, bisect)."""
    from tdiff.capture_options import flags
    from tdiff.vocab.parse import format_size

    def decorate(command):
        for option, flag in reversed(list(flags(names))):
            kind: dict = {}
            if flag.choices:
                kind = {"type": click.Choice(list(flag.choices)), "default": option.default, "show_default": True}
            elif flag.size:
                kind = {"default": format_size(option.default), "show_default": True}
            elif flag.minimum is not None:
                kind = {"type": click.IntRange(min=flag.minimum)}
            elif option.default is False:
                kind = {"is_flag": True}
            elif option.default == ():
                kind = {"multiple": True}
            command = click.option(*flag.names, option.name, metavar=flag.metavar, help=f"{flag.help}{note}.",
                                   **kind)(command)
        return command
    return decorate


def capture_options_from(values: dict):
    """The :class:`~tdiff.capture_options.CaptureOptions` of the flags' ``values`` (by option name,
    as :func:`capture_options` passes them), checked."""
    from tdiff.capture_options import CaptureOptions, flags
    from tdiff.vocab.parse import parse_size

    sizes = {option.name: parse_size(values[option.name], flag.name)
             for option, flag in flags() if flag.size and option.name in values}
    return CaptureOptions(**{**values, **sizes})


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
