"""Run a command with capture armed in every Python process it starts (and patches, if given).

One place for what `tdiff capture`, `tdiff bisect`'s runs and `tdiff patch try` all do: make the
dump, start the command with the bootstrap environment, record how it ended.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tdiff.bootstrap import child_environment
from tdiff.errors import TdiffError
from tdiff.store.manifest import create_dump, update_dump_info


def run_captured(command: list[str], out: Path, config: dict, *, patches: dict | None = None,
                 stdout=None, stderr=None) -> int:
    """Make ``out`` a dump, run ``command`` with capture armed (``config``: the options of
    :class:`tdiff.hooks.capture.Capture`) and ``patches`` active (the source patcher's child
    configuration), record how it ended and return its exit status."""
    create_dump(out, {"side": config["side"], "mode": config["mode"],
                      "storage": config.get("storage", "safetensors"), "command": list(command)})
    started = time.time()
    env = child_environment(capture={**config, "out": str(Path(out).resolve())}, patches=patches)
    try:
        completed = subprocess.run(command, stdout=stdout, stderr=stderr, env=env)
    except FileNotFoundError:
        raise TdiffError(f"command not found: {command[0]}") from None
    except PermissionError:
        raise TdiffError(f"command is not executable: {command[0]}") from None
    update_dump_info(out, exit_code=completed.returncode, seconds=round(time.time() - started, 3))
    return completed.returncode
