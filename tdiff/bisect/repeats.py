"""Determinism: the first op that is not bitwise repeatable across N runs of one command.

``tdiff capture --repeat N --out DIR`` writes one dump per run and an index (tdiff.store.repeats).
``tdiff bisect DIR`` bisects run-1 against every other run and reports the divergence that comes
first in run-1's execution order (the op that is not repeatable), with the runs that differ.
"""

from __future__ import annotations

from pathlib import Path

from tdiff.bisect.result import BisectResult, RepeatsSection
from tdiff.bisect.walk import bisect_dumps
from tdiff.compare.metrics import EXACT, Tolerance
from tdiff.compare.pairing import Pairing
from tdiff.errors import TdiffError
from tdiff.store import open_dump
from tdiff.store.repeats import REPEAT_FILE, read_repeat_index


def bisect_repeats(path: str | Path, *, tolerance: Tolerance = EXACT, allow_incomplete: bool = False,
                   pairing: Pairing | None = None) -> BisectResult:
    """Bisect every run of a repeat folder against the first one (``pairing``: as for
    :func:`bisect_dumps`)."""
    runs = read_repeat_index(Path(path))
    if runs is None:
        raise TdiffError(f"{path} is not a repeat folder (no {REPEAT_FILE}); give two dumps, or a "
                         "folder written by `tdiff capture --repeat N`")
    if len(runs) < 2:
        raise TdiffError(f"{path} holds {len(runs)} run; determinism needs at least two (--repeat 2)")
    reference = open_dump(runs[0], allow_incomplete=allow_incomplete)
    results = [(run, bisect_dumps(reference, run, tolerance=tolerance, pairing=pairing,
                                  allow_incomplete=allow_incomplete))
               for run in runs[1:]]
    # a run that lacks tensors (--allow-incomplete) differs too, though no op can be named
    differing = [(run, result) for run, result in results if result.status != "match"]
    located = [(run, result) for run, result in differing if result.first_divergence is not None]
    if located:
        def first_in_reference_order(item):
            record = item[1].first_divergence.first.record
            return (record.step, record.rank, record.seq)

        chosen = min(located, key=first_in_reference_order)[1]
    else:
        chosen = results[0][1]
    chosen.checked = sum(result.checked for _, result in results)
    chosen.status = "diverged" if differing else "match"
    chosen.notes = list(dict.fromkeys(note for _, result in results for note in result.notes))
    chosen.repeats = RepeatsSection(runs=[run.name for run in runs], reference=runs[0].name,
                                    differing=[run.name for run, _ in differing])
    return chosen
