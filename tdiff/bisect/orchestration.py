"""Bisection as one library call: locate (offline, repeats or online), then graft, then try fixes.

    import tdiff.bisect
    result = tdiff.bisect.run("dumps/a", "dumps/b")                          # two dumps
    result = tdiff.bisect.run("dumps/rep")                                   # `tdiff capture --repeat`
    result = tdiff.bisect.run(run_a="python run.py", run_b="python run.py --planted",
                              graft=True, try_fixes="builtin")               # online, then graft and try
    result.first_divergence, result.graft, result.trials

`tdiff bisect` parses its options into this call and renders what it returns.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tdiff.bisect.graft import run_graft
from tdiff.bisect.online import OnlineOptions, bisect_commands
from tdiff.bisect.repeats import bisect_repeats
from tdiff.bisect.result import BisectResult
from tdiff.bisect.runs import Runner
from tdiff.bisect.walk import bisect_dumps
from tdiff.compare.metrics import EXACT, Tolerance
from tdiff.compare.pairing import NameFilter
from tdiff.errors import TdiffError
from tdiff.store import Dump, open_dump
from tdiff.vocab.parse import parse_ranges


def _silent(line: str) -> None:
    """The default progress sink: a library call prints nothing."""


def run(*dumps: str | Path, run_a: str | None = None, run_b: str | None = None,
        tolerance: Tolerance = EXACT, names: NameFilter | None = None, mapping: str | None = None,
        align: str | None = None, allow_incomplete: bool = False, allow_unaligned: bool = False, graft: bool = False,
        try_fixes: str | None = None,
        stats_pass: bool = True, budget_bytes: int | None = None, steps: str | None = None,
        workdir: Path | None = None, echo: Callable[[str], None] = _silent, jobs: int = 1) -> BisectResult:
    """Bisect two dumps (A B), the runs of one repeat folder, or two commands (``run_a``, ``run_b``).

    ``mapping``, ``align`` and ``allow_unaligned`` pair and judge two dumps (or two commands' captures) as in
    `tdiff compare`. ``graft`` reruns side B
    (``run_b``) with the culprit's inputs from side A; ``try_fixes``
    (``builtin``, ``builtin:NAMES`` or a patch file) reruns side B under candidate fixes for the
    culprit's kind. ``stats_pass``, ``budget_bytes`` and ``steps`` shape online runs. Runs go to
    ``workdir`` (a new directory, kept) or to a temporary one removed before returning. ``echo``
    receives one line per run made and, under torchrun, one per process (what it compared and read).
    ``jobs``: the streams of two dumps walked at once (bisect_dumps).
    """
    names = names or NameFilter()
    online = run_a is not None and not dumps
    reruns_b = graft or try_fixes is not None
    _check_request(dumps, run_a, run_b, reruns_b, online, stats_pass, budget_bytes, steps, workdir)
    if (align is not None or mapping is not None) and not online and len(dumps) != 2:
        raise TdiffError(f"{'--align' if align is not None else '--mapping'} applies to two dumps (A B) or to "
                         "--run-a/--run-b")
    with _work_dir(workdir, needed=online or reruns_b) as work:
        final_a: Dump | None
        if online:
            assert run_a is not None and run_b is not None, "_check_request: online runs both commands"
            parse_ranges(steps, "--steps")
            options = OnlineOptions(tolerance=tolerance, stats_pass=stats_pass, steps=steps, names=names,
                                    budget_bytes=budget_bytes, mapping=mapping, align=align,
                                    allow_unaligned=allow_unaligned)
            result, runner, final_a = bisect_commands(run_a, run_b, work, options, echo)
        elif len(dumps) == 1:
            result = bisect_repeats(dumps[0], tolerance=tolerance, allow_incomplete=allow_incomplete,
                                    pairing=names.applied_to(None))
            runner, final_a = None, None
        else:
            from tdiff.align import choose_pairing

            final_a = open_dump(dumps[0], allow_incomplete=allow_incomplete)
            dump_b = open_dump(dumps[1], allow_incomplete=allow_incomplete)
            result = bisect_dumps(final_a, dump_b, tolerance=tolerance, allow_unaligned=allow_unaligned, jobs=jobs, echo=echo,
                                  pairing=names.applied_to(choose_pairing(final_a, dump_b, mapping, align)))
            runner = Runner({"B": run_b}, work, echo) if graft and run_b is not None else None
        if result.first_divergence is None:
            return result
        if graft:
            if final_a is None or runner is None:
                raise TdiffError("--graft needs side A's tensors, and no full capture was made")
            run_graft(runner, final_a, result, tolerance)
            result.runs = runner.log
        if try_fixes is not None:
            assert run_b is not None, "_check_request: --try reruns side B"
            result.trials = _try_fixes(try_fixes, result, final_a, run_b, work, tolerance, echo)
    return result


def _try_fixes(spec: str, result: BisectResult, dump_a: Dump | None, run_b: str, work: Path,
               tolerance: Tolerance, echo: Callable[[str], None]):
    """Rank candidate fixes for the culprit: the catalogue's entries for its kind, or those named,
    those that address its cause's class first."""
    from tdiff.source_patcher.catalogue import candidates_from, entries_for_kind, ordered_for_cause
    from tdiff.source_patcher.trial import try_candidates

    if dump_a is None:
        raise TdiffError("--try needs side A's tensors, and no full capture was made")
    assert result.first_divergence is not None, "run tries fixes for a culprit only"
    kind, cause = result.first_divergence.kind, result.first_divergence.cause
    candidates = entries_for_kind(kind) if spec == "builtin" else candidates_from(spec)
    if not candidates:
        raise TdiffError(f"the catalogue has no fix for kind {kind!r}; give your own with --try FILE")
    # the cause's class says which kind of fix to try first (rounding: batch-invariant kernels)
    candidates = ordered_for_cause(candidates, cause.cause_class if cause is not None else None)

    def report(trial, done, total):
        echo(f"tdiff: try [{done}/{total}] {trial.name}: {trial.status}")

    return try_candidates(candidates, dump_a.path, ["/bin/sh", "-c", run_b], workdir=work / "try",
                          tolerance=tolerance, progress=report)


def _check_request(dumps, run_a, run_b, reruns_b, online, stats_pass, budget_bytes, steps, workdir) -> None:
    """``reruns_b``: graft or try, which rerun side B from two dumps. The messages name the options
    of `tdiff bisect`, which are these parameters."""
    if online:
        if run_b is None:
            raise TdiffError("--run-a needs --run-b: bisect runs both commands")
    elif run_a is not None:
        raise TdiffError("give either two dumps or --run-a/--run-b, not both")
    elif len(dumps) not in (1, 2):
        raise TdiffError("give two dumps (A B), a folder of `tdiff capture --repeat`, or --run-a and --run-b")
    if not online and (budget_bytes is not None or not stats_pass or steps is not None):
        raise TdiffError("--budget-gb, --no-stats-pass and --steps apply to online bisection (--run-a/--run-b)")
    if reruns_b and not online and (len(dumps) != 2 or run_b is None):
        raise TdiffError("--graft and --try on two dumps need --run-b CMD: the command that reruns side B")
    if not reruns_b and not online and run_b is not None:
        raise TdiffError("--run-b without --run-a is only for --graft and --try")
    if workdir is not None and not (online or reruns_b):
        raise TdiffError("--workdir applies to online bisection, --graft and --try, which run commands")


@contextmanager
def _work_dir(workdir: Path | None, needed: bool) -> Iterator[Path]:
    """``workdir`` (created, kept) or a temporary directory removed at the end."""
    if not needed:
        yield Path()  # nothing runs: no directory is made, and none is read
        return
    if workdir is not None:
        if workdir.exists() and any(workdir.iterdir()):
            raise TdiffError(f"--workdir {workdir} is not empty; choose a new directory")
        workdir.mkdir(parents=True, exist_ok=True)
        yield workdir
        return
    temporary = Path(tempfile.mkdtemp(prefix="tdiff-bisect-"))
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
