"""Determinism: the first op that is not bitwise repeatable across N runs of one command.

``tdiff capture --repeat N --out DIR`` writes one dump per run into ``DIR/run-1`` ... ``run-N``
and an index, ``DIR/tdiff-repeat.json``::

    {"format": "tdiff-repeat", "version": 1, "runs": ["run-1", "run-2", "run-3"],
     "command": ["python", "run.py"]}

``tdiff bisect DIR`` bisects run-1 against every other run and reports the divergence that comes
first in run-1's execution order (the op that is not repeatable), with the runs that differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tdiff.bisect.result import BisectResult
from tdiff.bisect.walk import bisect_dumps
from tdiff.compare.metrics import EXACT, Tolerance
from tdiff.compare.pairing import Pairing
from tdiff.errors import DumpError, TdiffError
from tdiff.store import open_dump
from tdiff.store.files import read_regular

REPEAT_FILE = "tdiff-repeat.json"
_FORMAT = "tdiff-repeat"
_VERSION = 1


def write_repeat_index(out: Path, runs: int, command: list[str]) -> list[Path]:
    """Create ``out`` with its index; returns the run directories, to be captured in order."""
    names = [f"run-{k}" for k in range(1, runs + 1)]
    out.mkdir(parents=True, exist_ok=True)
    index = {"format": _FORMAT, "version": _VERSION, "runs": names, "command": command}
    (out / REPEAT_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return [out / name for name in names]


def read_repeat_index(path: Path) -> list[Path] | None:
    """The run directories of a repeat folder, or None when ``path`` is not one."""
    index_path = Path(path) / REPEAT_FILE
    if not index_path.is_file():
        return None
    try:
        index = json.loads(read_regular(index_path, "repeat index").decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise DumpError(f"{index_path}: not valid JSON (corrupted repeat index)") from None
    if not isinstance(index, dict) or index.get("format") != _FORMAT:
        raise DumpError(f"{index_path}: not a tdiff repeat index")
    if not isinstance(index.get("version"), int) or index["version"] > _VERSION:
        raise DumpError(f"{index_path}: repeat index version {index.get('version')!r} is not one this "
                        f"tdiff reads ({_VERSION}); upgrade tdiff")
    runs = index.get("runs")
    if not isinstance(runs, list) or not all(isinstance(r, str) and "/" not in r and r not in ("", ".", "..")
                                             for r in runs):
        raise DumpError(f"{index_path}: field 'runs' must list run folder names")
    return [Path(path) / run for run in runs]


@dataclass
class RepeatsSection:
    runs: list[str]
    reference: str
    differing: list[str]

    def to_json(self) -> dict:
        return {"runs": self.runs, "reference": self.reference, "differing": self.differing}


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
            record = item[1].first_divergence.comparison.record
            return (record.step, record.rank, record.seq)

        chosen = min(located, key=first_in_reference_order)[1]
    else:
        chosen = results[0][1]
    chosen.checked = sum(result.checked for _, result in results)
    chosen.missing = sum(result.missing for _, result in results)
    chosen.notes = list(dict.fromkeys(note for _, result in results for note in result.notes))
    chosen.repeats = RepeatsSection(runs=[run.name for run in runs], reference=runs[0].name,
                                    differing=[run.name for run, _ in differing])
    return chosen
