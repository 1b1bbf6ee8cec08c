"""The repeat index: how ``tdiff capture --repeat N --out DIR`` lays out its N runs.

One dump per run in ``DIR/run-1`` ... ``DIR/run-N``, and an index, ``DIR/tdiff-repeat.json``::

    {"format": "tdiff-repeat", "version": 1, "runs": ["run-1", "run-2", "run-3"],
     "command": ["python", "run.py"]}

`tdiff bisect DIR` reads it (tdiff.bisect.repeats).
"""

from __future__ import annotations

import json
from pathlib import Path

from tdiff.errors import DumpError
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
