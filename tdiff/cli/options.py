"""Options shared by several commands, and their conversion to library objects.

Light at import (no torch): `tdiff CMD --help` must answer at once, so library modules are
imported where an option is converted."""

from __future__ import annotations

import click

from tdiff.errors import TdiffError


def tolerance_options(command):
    command = click.option("--rtol", type=float, help=(
        "Relative tolerance: an element matches when |a-b| <= atol + rtol*max(|a|,|b|) (the same "
        "with A and B swapped); an infinity matches only itself, NaN only NaN."))(command)
    command = click.option("--atol", type=float, help="Absolute tolerance (relaxes the bitwise verdict).")(command)
    command = click.option("--exact", is_flag=True, help="Bitwise verdict (the default).")(command)
    return command


def name_filter_options(command):
    """--select and --exclude on the tensors a command compares (compare, bisect)."""
    command = click.option("--exclude", multiple=True, metavar="REGEX",
                           help="Skip tensors whose name matches (repeatable).")(command)
    command = click.option("--select", multiple=True, metavar="REGEX",
                           help="Only tensors whose name matches (repeatable).")(command)
    return command


def tolerance_from(exact: bool, atol: float | None, rtol: float | None):
    from tdiff.compare.metrics import EXACT, Tolerance

    if exact and (atol is not None or rtol is not None):
        raise TdiffError("--exact cannot be combined with --atol/--rtol")
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and not value >= 0:
            raise TdiffError(f"{name} must be a non-negative number, not {value}")
    if atol is None and rtol is None:
        return EXACT
    return Tolerance(atol=atol or 0.0, rtol=rtol or 0.0)


def quiet_option(command):
    return click.option("--quiet", "-q", is_flag=True,
                        help="No progress bars or informational messages (for CI); warnings still print.")(command)


def align_option(command):
    """--align on the commands that pair two dumps (compare, bisect)."""
    return click.option("--align", type=click.Choice(["tokens", "names", "boundaries"]), help=(
        "Force how tensors pair (default: chosen from the dumps): by module name, step and call; by "
        "canonical op boundary (across frameworks and parallel layouts); or by token, over either "
        "(prefill and decode steps against one forward; docs/ALIGNMENT.md)."))(command)
