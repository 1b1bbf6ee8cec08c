"""What every Python process a command starts does first: arm the capture and the patches its
environment asks for (tdiff.bootstrap says how the parent sets that environment).

tdiff/bootstrap/site/sitecustomize.py calls :func:`activate_from_env` at start-up: the capture
starts when torch is imported, the patches are registered for when their targets are imported.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from tdiff.bootstrap import PATCHES_ENV
from tdiff.launch import CaptureConfig


def activate_from_env() -> None:
    patches = os.environ.get(PATCHES_ENV)
    if patches:
        from tdiff.source_patcher.bootstrap import activate_patches

        activate_patches(json.loads(patches))
    config = CaptureConfig.from_env(os.environ)
    if config is not None:
        from tdiff.bootstrap.imports import when_imported

        when_imported("torch", lambda _torch: _start_capture(config))


def _start_capture(config: CaptureConfig) -> None:
    import atexit

    from tdiff.hooks.capture import Capture

    graft = asdict(config.graft) if config.graft is not None else None
    capture = Capture(config.out, config.options, graft=graft, launched=True).start()
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
        capture.terminated("the process was ended by SIGTERM")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, finish_and_terminate)
