"""Progress bars on stderr for long captures, compares and bisects (rich), shared by every command.

    with progress_bar("comparing", quiet=quiet) as advance:
        report = compare_dumps(a, b, progress=advance)    # advance(done, total); total None: unknown

Bars are drawn only when stderr is an interactive terminal, so logs, pipes and CI stay clean.
``--quiet`` hides them; rich's ``TTY_COMPATIBLE=1`` (treat the output as a terminal) forces them,
``TTY_INTERACTIVE=0`` hides them, and ``NO_COLOR`` draws them without colour.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from tdiff.report.console import make_console

Advance = Callable[..., None]


def progress_enabled(quiet: bool) -> bool:
    return not quiet and make_console(stderr=True).is_interactive


@contextmanager
def progress_bar(description: str, *, quiet: bool = False) -> Iterator[Advance]:
    """Yield ``advance(done, total=None)``; the bar disappears when the block ends."""
    console = make_console(stderr=True)
    if quiet or not console.is_interactive:
        yield _ignore
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=None)

        def advance(done: int, total: int | None = None) -> None:
            progress.update(task, completed=done, total=total)

        yield advance


def _ignore(done: int, total: int | None = None) -> None:
    pass
