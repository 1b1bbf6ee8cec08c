"""Carry tdiff into every Python process a command starts: environment plus sitecustomize.

The parent sets ``TDIFF_CAPTURE`` and/or ``TDIFF_PATCHES`` (JSON, written by tdiff.launch) and puts
``site/`` first on PYTHONPATH; each child's sitecustomize calls :func:`tdiff.child_startup.activate_from_env`, which
arms a capture for when torch is imported and registers the patches for when their targets are
imported. Nothing here imports the rest of tdiff: the capture and the patcher both build on it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CAPTURE_ENV = "TDIFF_CAPTURE"
PATCHES_ENV = "TDIFF_PATCHES"
SITE_DIR = Path(__file__).parent / "site"
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def child_environment(variables: Mapping[str, str]) -> dict:
    """This process's environment for a command whose Python processes should act on
    ``variables`` (``CAPTURE_ENV``, ``PATCHES_ENV``) at start-up."""
    env = {**os.environ, **variables}
    paths = [str(SITE_DIR), str(_PACKAGE_PARENT)]
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths + existing)
    return env
