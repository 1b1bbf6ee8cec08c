"""Which modules *introduce* a difference between two dumps: their inputs match, an output does
not, and no module inside them introduces it. A catalogue entry may only introduce differences in
the modules (boundary kinds) it claims."""

from __future__ import annotations

from collections import defaultdict

from tdiff.compare import compare_dumps


def introducers(a, b) -> set[str]:
    """Module classes that introduce a difference; "explicit:<name>" for an explicit dump that
    differs while no module introduced anything."""
    calls = defaultdict(lambda: {"input": False, "output": False, "class": None})
    explicit = set()
    for c in compare_dumps(a, b).comparisons:
        r = c.record
        if r.role == "explicit":
            if c.diverged:
                explicit.add(f"explicit:{r.name}")
            continue
        call = calls[(r.module, r.step, r.call, r.rank)]
        call[r.role] |= c.diverged
        call["class"] = r.module_class
    found = {key: call["class"] for key, call in calls.items() if call["output"] and not call["input"]}
    deepest = {cls for key, cls in found.items() if not any(_inside(other[0], key[0]) for other in found)}
    return deepest or explicit


def _inside(child: str, parent: str) -> bool:
    return child != parent and (parent == "" or child.startswith(parent + "."))
