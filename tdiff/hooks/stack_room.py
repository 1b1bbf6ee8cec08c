"""Room on the Python stack for capture's own frames, so that a model that recurses deeply
(a module calling itself, a tree of modules hundreds deep) runs under capture as it runs without:
capture raises the recursion limit by exactly the frames it adds, and gives it back at its end.

By exactly, not more: a model that recurses without end still meets RecursionError at the depth
it would without capture (a limit raised without bound would let it overflow the C stack).
"""

from __future__ import annotations

import sys

# the frames the hook puts between a module's caller and torch's own Module.__call__:
# _tdiff_module_call, Capture.module_call, Capture._outside_ops, recorded_call (tdiff.hooks.module_call)
HOOK_FRAMES = 4
# recording a call's tensors, once, at the deepest call (the walk of nested values, annotators,
# the writer): a constant, whatever the depth
WORK_FRAMES = 100


class StackRoom:
    """Keeps the recursion limit the program set plus what capture's frames take at the depth
    of module calls reached."""

    def __init__(self) -> None:
        self._program_limit = sys.getrecursionlimit()
        self._raised_to: int | None = None

    def make_room(self, depth: int) -> None:
        """Called at each module call, ``depth`` calls deep (1: an outermost call)."""
        limit = sys.getrecursionlimit()
        if limit != self._raised_to:   # not raised yet, or the program set a limit of its own since
            self._program_limit = limit
        needed = self._program_limit + HOOK_FRAMES * depth + WORK_FRAMES
        if needed > limit:
            sys.setrecursionlimit(needed)
            self._raised_to = needed

    def give_back(self) -> None:
        """The program's own limit again (unless it set another since)."""
        if self._raised_to is not None and sys.getrecursionlimit() == self._raised_to:
            try:
                sys.setrecursionlimit(self._program_limit)
            except RecursionError:
                return   # stopped deeper than the program's limit allows: keep the room
        self._raised_to = None
