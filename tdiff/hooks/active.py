"""The capture active in this process: the one slot that the module-call hook, the CUDA-graph
hooks and the public API (``tdiff.dump``, ``tdiff.step``) read, and only a capture's start and
stop write."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tdiff.hooks.capture import Capture

_active: Capture | None = None


def active_capture() -> Capture | None:
    return _active


def set_active(capture: Capture | None) -> None:
    global _active
    _active = capture
