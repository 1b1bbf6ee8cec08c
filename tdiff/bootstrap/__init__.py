"""Carry tdiff into every Python process a command starts: environment plus sitecustomize.

The parent sets ``TDIFF_CAPTURE`` and/or ``TDIFF_PATCHES`` (JSON) and puts ``site/`` first on
PYTHONPATH; each child's sitecustomize calls :func:`activate_from_env`, which arms a capture for
when torch is imported and registers the patches for when their targets are imported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CAPTURE_ENV = "TDIFF_CAPTURE"
PATCHES_ENV = "TDIFF_PATCHES"
SITE_DIR = Path(__file__).parent / "site"
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def child_environment(*, capture: dict | None = None, patches: dict | None = None,
                      base: dict | None = None) -> dict:
    """The environment for a command whose Python processes should capture and/or patch."""
    env = dict(os.environ if base is None else base)
    if capture is not None:
        env[CAPTURE_ENV] = json.dumps(capture)
    if patches is not None:
        env[PATCHES_ENV] = json.dumps(patches)
    paths = [str(SITE_DIR), str(_PACKAGE_PARENT)]
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths + existing)
    return env


def activate_from_env() -> None:
    patches = os.environ.get(PATCHES_ENV)
    if patches:
        from tdiff.source_patcher.bootstrap import activate_patches

        activate_patches(json.loads(patches))
    capture = os.environ.get(CAPTURE_ENV)
    if capture:
        from tdiff.bootstrap.imports import when_imported

        config = json.loads(capture)
        when_imported("torch", lambda _torch: _start_capture(config))


def _start_capture(config: dict) -> None:
    import atexit

    from tdiff.hooks.capture import Capture

    capture = Capture(config.pop("out"), **config).start()
    atexit.register(capture.stop)
    _stop_on_sigterm(capture)


def _stop_on_sigterm(capture) -> None:
    """Engines end worker processes with SIGTERM: finish the manifest first, as failed (what the
    process computed may be cut short, even when its launcher exits 0), then die as asked."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the program handles SIGTERM itself and will exit through atexit

    def finish_and_terminate(signum, frame):
        capture.stop("the process was ended by SIGTERM")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, finish_and_terminate)
