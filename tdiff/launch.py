"""Start a command whose Python processes capture and/or apply source patches; say how it ended.

What `tdiff capture`, bisect's runs, `tdiff patch try`'s trials and `tdiff patch apply` share: the
capture configuration every process of the command reads from its environment
(:class:`CaptureConfig`: the dump, its :class:`~tdiff.capture_options.CaptureOptions` and bisect's
graft, written by :meth:`~CaptureConfig.to_env`, read back by :meth:`~CaptureConfig.from_env` in
tdiff.child_startup), the run itself (:func:`run_command`), and
what its end means (:func:`exit_status`, :func:`failure`).

Light at import (no torch): every Python process such a command starts imports it.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tdiff.bootstrap import CAPTURE_ENV, PATCHES_ENV, child_environment
from tdiff.capture_options import CaptureOptions
from tdiff.errors import TdiffError
from tdiff.store.manifest import create_dump, describe_exit, update_dump_info

TAIL_CHARS = 200   # of the log line a failure quotes: a line may hold a whole printed tensor
_CHILD_ERROR = "tdiff: error:"


@dataclass(frozen=True)
class GraftSpec:
    """`tdiff bisect --graft`: side B's call of ``module_b`` at ``step`` and ``call`` gets the
    inputs side A's ``module`` had there, read from dump ``dump`` (tdiff.hooks.graft)."""

    dump: str
    module: str
    module_b: str
    step: int
    call: int


@dataclass(frozen=True)
class CaptureConfig:
    """The capture each Python process of a command makes into dump ``out``, with ``options``
    (and, for bisect --graft, the inputs one call is given)."""

    out: Path
    options: CaptureOptions
    graft: GraftSpec | None = None

    @property
    def side(self) -> str:
        return self.options.side_of(Path(self.out))

    def to_env(self) -> dict[str, str]:
        """The environment variables that arm this capture in a child process: every option by
        its name, ``out`` (made absolute: the command's processes may run elsewhere) and
        ``graft``."""
        payload = {**self.options.to_json(), "out": str(Path(self.out).resolve())}
        if self.graft is not None:
            payload["graft"] = asdict(self.graft)
        return {CAPTURE_ENV: json.dumps(payload)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> CaptureConfig | None:
        """The capture ``environ`` arms, or None when it arms none."""
        text = environ.get(CAPTURE_ENV)
        if not text:
            return None
        payload = json.loads(text)
        out, graft = Path(payload.pop("out")), payload.pop("graft", None)
        return cls(out=out, options=CaptureOptions.from_json(payload),
                   graft=GraftSpec(**graft) if graft is not None else None)


def patches_env(patches: dict) -> dict[str, str]:
    """The environment variables that arm ``patches`` (the source patcher's child configuration:
    tdiff.source_patcher.bootstrap.child_config) in a child process."""
    return {PATCHES_ENV: json.dumps(patches)}


def run_command(command: Sequence[str], *, capture: CaptureConfig | None = None,
                patches: dict | None = None, log: Path | None = None) -> int:
    """Run ``command`` with ``capture`` armed and ``patches`` (see :func:`patches_env`) active in
    every Python process it starts, and return its exit status (negative: killed by that signal).

    With ``capture``, its dump is made first and records how the command ended. The command's
    standard output and error go to ``log`` (together, in order), else to this process's.
    """
    variables: dict[str, str] = {}
    if capture is not None:
        create_dump(capture.out, {"side": capture.side, "mode": capture.options.mode,
                                  "storage": capture.options.storage, "command": list(command)})
        variables.update(capture.to_env())
    if patches is not None:
        variables.update(patches_env(patches))
    env = child_environment(variables)
    started = time.time()
    if log is None:
        returncode = _run(command, env, sink=None)
    else:
        with open(log, "wb") as sink:
            returncode = _run(command, env, sink=sink)
    if capture is not None:
        update_dump_info(capture.out, exit_code=returncode, seconds=round(time.time() - started, 3))
    return returncode


def _run(command: Sequence[str], env: dict, sink) -> int:
    try:
        return subprocess.run(list(command), env=env, stdout=sink,
                              stderr=None if sink is None else subprocess.STDOUT).returncode
    except FileNotFoundError:
        raise TdiffError(f"command not found: {command[0]}") from None
    except PermissionError:
        raise TdiffError(f"command is not executable: {command[0]}") from None
    except OSError as exc:
        raise TdiffError(f"cannot run {command[0]}: {exc.strerror or exc}") from None


def exit_status(returncode: int) -> int:
    """The status to exit with for a wrapped command that ended with ``returncode``: its own, or,
    like a shell, 128 + N for one killed by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def failure(returncode: int, log: Path) -> str:
    """One line on how a command whose output is in ``log`` failed."""
    tail = log_tail(log)
    return f"the command {describe_exit(returncode)}" + (f": {tail}" if tail else "")


def log_tail(log: Path) -> str:
    """The line of ``log`` that says most about a failure: the last error a tdiff child process
    reported (a patch that could not apply), else the last line; cut to TAIL_CHARS."""
    lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").splitlines()
             if line.strip()]
    line = next((line for line in reversed(lines) if line.startswith(_CHILD_ERROR)), lines[-1] if lines else "")
    return line[:TAIL_CHARS]
