"""Patches in the processes a command starts: `tdiff patch apply` and `tdiff patch try` put them in
the environment (``TDIFF_PATCHES``, JSON) and each Python process arms them at start-up
(tdiff.bootstrap calls :func:`activate_patches`).

Fail closed: a patch that cannot apply in a child process ends that process with exit status 2
and a one-line message naming the patch, instead of letting it run unpatched. Each application is
appended to the applied-patches log the parent named, so it can say which patches took effect.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

from tdiff.bootstrap import PATCHES_ENV
from tdiff.errors import TdiffError
from tdiff.source_patcher.apply import apply_patches
from tdiff.source_patcher.spec import PatchSpec, patches_config, patches_from_config

APPLIED_LOG = "applied_log"


def activate_patches(config: dict) -> None:
    try:
        patches = patches_from_config(config)
        log = config.get(APPLIED_LOG)
        session = apply_patches(patches, on_applied=_logger(log) if log else None, on_error=fail_closed)
    except Exception as exc:  # noqa: BLE001 - nothing may run unpatched
        fail_closed(exc)
    atexit.register(session.restore)


def fail_closed(exc: BaseException) -> None:
    message = str(exc) if isinstance(exc, TdiffError) else f"patching failed: {type(exc).__name__}: {exc}"
    try:
        sys.stderr.write(f"tdiff: error: {message}\n")
        sys.stderr.flush()
    finally:
        os._exit(2)


def _logger(path: str):
    def log(patch: PatchSpec) -> None:
        line = json.dumps({"patch": patch.name, "target": patch.target, "pid": os.getpid()}) + "\n"
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line)
    return log


def child_config(patches: list[PatchSpec], *, applied_log: str | None = None) -> dict:
    """The TDIFF_PATCHES content for a child: patches already in this process's environment (an
    enclosing `tdiff patch apply`) first, then ``patches``."""
    config = patches_config(patches)
    inherited = os.environ.get(PATCHES_ENV)
    if inherited:
        outer = patches_from_config(json.loads(inherited), source=f"{PATCHES_ENV} (from an enclosing command)")
        names = {p.name for p in outer}
        twice = [p.name for p in patches if p.name in names]
        if twice:
            raise TdiffError(f"patch {twice[0]!r} is already applied by an enclosing tdiff command")
        config["patches"] = [p.to_config() for p in outer] + config["patches"]
    if applied_log is not None:
        config[APPLIED_LOG] = applied_log
    return config


def read_applied_log(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    except FileNotFoundError:
        return []
