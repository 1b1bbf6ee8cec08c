"""Regions: the part of a run one capture records, as module paths turned into --select patterns.

A region lists module paths, each either exactly (the call's own inputs and outputs) or with its
whole subtree, at one step. Explicit dumps are always recorded (capture ignores --select for them).

Example: ``Region([("model.layers.5", True), ("model", False)], step=0)`` records layer 5 with
everything in it, and the inputs and outputs of ``model`` itself, at step 0.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from tdiff.bisect.events import parent_of
from tdiff.store import Record
from tdiff.store.dtypes import torch_dtype
from tdiff.vocab.paths import DECODER_LAYER, ROOT_LABEL


@dataclass
class Region:
    entries: list[tuple[str, bool]]     # (module path, with its subtree)
    step: int
    why: str = ""
    unknown: list[str] = field(default_factory=list)  # subtrees whose size is not known yet

    def __post_init__(self):
        whole = {path for path, subtree in self.entries if subtree}
        entries = []
        for path, subtree in self.entries:
            if (path, subtree) not in entries and (subtree or path not in whole):
                entries.append((path, subtree))
        self.entries = entries

    def select(self) -> list[str]:
        patterns = []
        for path, subtree in self.entries:
            pattern = f"^{re.escape(path)}(?:\\.|$)" if subtree and path else f"^{re.escape(path)}$"
            if subtree and not path:
                pattern = ""  # the outermost model with its subtree: everything
            patterns.append(pattern)
        return patterns

    def wants(self, record: Record) -> bool:
        if record.step != self.step:
            return False
        if record.role == "explicit":
            return True
        return any(record.module == path or (subtree and (not path or record.module.startswith(path + ".")))
                   for path, subtree in self.entries)

    def nbytes(self, records: list[Record]) -> int:
        """Bytes a full capture of this region stores, from records that cover it (aliases are
        stored once)."""
        return sum(record_bytes(r) for r in records if r.alias_of is None and self.wants(r))

    def describe(self) -> str:
        parts = [f"{path or ROOT_LABEL}{' and everything in it' if subtree else ''}"
                 for path, subtree in self.entries]
        return f"step {self.step}: " + ", ".join(parts)


def record_bytes(record: Record) -> int:
    return math.prod(record.shape) * torch_dtype(record.dtype).itemsize


def enclosing_layer(path: str | None) -> str | None:
    """The decoder layer a module path lies in (or is), e.g. "model.layers.3"; None outside."""
    if not path:
        return None
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if DECODER_LAYER.search(prefix):
            return prefix
    return None


def parents_by_path(records: list[Record]) -> dict[str, str | None]:
    """Module path -> its parent's path, as recorded."""
    parents: dict[str, str | None] = {}
    for record in records:
        if record.role != "explicit":
            parents.setdefault(record.module, parent_of(record))
    return parents


def ancestors(path: str | None, parents: dict[str, str | None]) -> list[str]:
    """The enclosing module paths of ``path``, innermost first (each must have been recorded)."""
    found = []
    current = parents.get(path) if path is not None else None
    while current is not None and current not in found:
        found.append(current)
        current = parents.get(current)
    return found
