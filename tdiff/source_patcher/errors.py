"""The source patcher's one error: which patch, on which target, and why it cannot apply."""

from __future__ import annotations

from tdiff.errors import TdiffError


class PatchError(TdiffError):
    """A patch that cannot apply. Raised before anything of that patch is changed."""

    def __init__(self, patch: str, target: str, reason: str):
        super().__init__(f"patch {patch!r} ({target}): {reason}")
        self.patch = patch
        self.target = target
        self.reason = reason


class TargetNotInstalled(PatchError):
    """The target's top-level package is not installed (an optional patch is then skipped)."""
