"""Carry tdiff into every Python process a command starts: environment plus sitecustomize.

The parent sets ``TDIFF_CAPTURE`` and/or ``TDIFF_PATCHES`` (JSON) and puts ``site/`` first on
PYTHONPATH; each child's sitecustomize calls :func:`tdiff.child_startup.activate_from_env`, which
arms a capture for when torch is imported and registers the patches for when their targets are
imported. Nothing here imports the rest of tdiff: the capture and the patcher both build on it.
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
