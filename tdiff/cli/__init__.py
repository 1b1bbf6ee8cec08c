"""The ``tdiff`` command. Each subcommand lives in its own module and is imported on first use,
so ``tdiff --help`` is instant and a command whose optional dependency is missing says so."""

from __future__ import annotations

import importlib
import sys
import tempfile
import traceback

from typing import NoReturn

import click
from click.exceptions import NoArgsIsHelpError, NoSuchCommand

from tdiff.errors import TdiffError
from tdiff.text import printable
from tdiff.version import __version__

COMMANDS = {
    "capture": "tdiff.cli.capture:capture",
    "compare": "tdiff.cli.compare:compare",
    "bisect": "tdiff.cli.bisect:bisect",
    "patch": "tdiff.cli.patch:patch",
    "report": "tdiff.cli.report:report",
}
_SUMMARIES = {
    "capture": "Run a command and dump module inputs/outputs of its Python processes.",
    "compare": "Compare two dumps tensor by tensor (bitwise by default).",
    "bisect": "Name the first op boundary that introduces a divergence.",
    "patch": "Apply, check and try source patches: candidate fixes for a divergence.",
    "report": "Write a comparison up for a pull request: Markdown, HTML with plots, or JSON.",
}


def _usage_error(exc: click.UsageError) -> NoReturn:
    """A usage error as every error reads: its one line first (``tdiff: error: ...``, with click's
    suggestion of a close name), then how to use the command."""
    click.echo(f"tdiff: error: {printable(exc.format_message())}", err=True)
    if exc.ctx is not None:
        click.echo(f"{exc.ctx.get_usage()}\nTry '{exc.ctx.command_path} --help' for help.", err=True)
    sys.exit(2)


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            _usage_error(exc)

    def resolve_command(self, ctx, args):
        name = args[0]
        if name not in COMMANDS and not name.startswith("-") and not ctx.resilient_parsing:
            # click suggests from the commands it holds; these load on first use
            raise NoSuchCommand(name, possibilities=list(COMMANDS), ctx=ctx)
        return super().resolve_command(ctx, args)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise TdiffError(f"`tdiff {name}` needs the package {exc.name!r}, which is not installed; "
                             "see the README's install section") from None
        return getattr(module, attr)

    def format_commands(self, ctx, formatter):
        rows = [(name, _SUMMARIES.get(name, "")) for name in COMMANDS]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TdiffError as exc:
            click.echo(f"tdiff: error: {printable(exc)}", err=True)  # names in it come from files
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("tdiff: interrupted", err=True)
            ctx.exit(130)
        except NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            _usage_error(exc)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug in tdiff must never read as "diverged" (1)
            click.echo(f"tdiff: internal error, this is a bug in tdiff ({type(exc).__name__}); "
                       f"the traceback is in {_save_traceback()}", err=True)
            ctx.exit(3)


def _save_traceback() -> str:
    """Write the exception being handled to a file in the system's temporary directory."""
    with tempfile.NamedTemporaryFile("w", prefix="tdiff-crash-", suffix=".txt", delete=False,
                                     encoding="utf-8") as file:
        file.write(f"tdiff {__version__}, argv {sys.argv!r}\n")
        traceback.print_exc(file=file)
    return file.name


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tdiff")
def cli():
    """tdiff: find the first op where two runs of the same model part numerically.

    Exit codes: 0 match, 1 divergence found, 2 bad input or usage, 3 tdiff itself failed (the
    traceback is saved to a file in the temporary directory). capture and patch apply exit with
    the wrapped command's own status.
    """


def main(argv=None):
    return cli.main(args=argv, prog_name="tdiff")


if __name__ == "__main__":
    sys.exit(main())
