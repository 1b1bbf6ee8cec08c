"""The spine: the boundaries a binary search runs over, and the region between two of them.

A discovery run records side A's structure without looking inside decoder layers: every module
call outside the layers, each decoder layer's own inputs and outputs, and the explicit dumps. The
spine is, in execution order, each decoder layer's output, each call of the outermost model, and
each explicit dump recorded there; a divergence introduced anywhere persists through the residual
stream to every later spine boundary, which is what makes the binary search sound. (Boundaries off
that stream, such as the rotary embedding, could match again after a divergence; they are not on
the spine.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tdiff.bisect.events import parent_of
from tdiff.bisect.regions import Region, ancestors, parents_by_path
from tdiff.store import Dump, Record
from tdiff.vocab.paths import DECODER_LAYER, LAYER_CONTAINER, ROOT_LABEL

# --exclude for the discovery run: everything inside a decoder layer (the layers themselves stay).
INSIDE_LAYER = LAYER_CONTAINER + r"\."
# --select that matches no module: a probe of an explicit dump records only explicit dumps.
NO_MODULE = r"(?!)"


@dataclass(frozen=True)
class Boundary:
    module: str | None      # the module whose output is probed; None for an explicit dump
    name: str               # the module path, or the explicit dump's tensor name
    step: int
    call: int

    def matches(self, record: Record) -> bool:
        if (record.step, record.call) != (self.step, self.call):
            return False
        if self.module is None:
            return record.role == "explicit" and record.name == self.name
        return record.role == "output" and record.module == self.module

    def probe_select(self) -> list[str]:
        return [NO_MODULE] if self.module is None else [f"^{re.escape(self.module)}$"]

    def __str__(self) -> str:
        what = f"the dump `{self.name}`" if self.module is None else f"`{self.name or ROOT_LABEL}` output"
        return f"{what} (step {self.step}{f' call {self.call}' if self.call else ''})"


def spine_boundaries(discovery: Dump) -> list[Boundary]:
    records = _first_process(discovery)
    seen, spine = set(), []
    for record in records:
        if record.role == "explicit":
            boundary = Boundary(None, record.name, record.step, record.call)
        elif record.role == "output" and (record.depth == 0 or DECODER_LAYER.search(record.module)):
            boundary = Boundary(record.module, record.module, record.step, record.call)
        else:
            continue
        if boundary not in seen:
            seen.add(boundary)
            spine.append(boundary)
    return spine


def interval_region(discovery: Dump, spine: list[Boundary], index: int) -> Region:
    """What a full capture must record to bisect between spine[index - 1] and spine[index]:
    every call that ends in between (the decoder layer with its subtree, other calls exactly),
    the previous boundary's module and the enclosing calls (exactly)."""
    records = _first_process(discovery)
    boundary = spine[index]
    previous = spine[index - 1] if index > 0 and spine[index - 1].step == boundary.step else None
    start = _last_position(records, previous) if previous is not None else -1
    end = _last_position(records, boundary)
    entries: list[tuple[str, bool]] = []
    for position in range(start + 1, end + 1):
        record = records[position]
        if record.role == "output" and record.step == boundary.step:
            entry = (record.module, bool(DECODER_LAYER.search(record.module)))
            if entry not in entries:
                entries.append(entry)
    if previous is not None and previous.module is not None:
        entries.append((previous.module, False))
    parents = parents_by_path(records)
    if boundary.module is not None:
        enclosing = ancestors(boundary.module, parents)
    else:
        parent = parent_of(records[end])
        enclosing = [parent, *ancestors(parent, parents)] if parent is not None else []
    entries.extend((path, False) for path in enclosing if (path, False) not in entries)
    unknown = [path for path, subtree in entries if subtree]
    return Region(entries, boundary.step, why=f"between {previous or 'the start'} and {boundary}",
                  unknown=unknown)


def _first_process(dump: Dump) -> list[Record]:
    """The records of the first process (lowest rank); the structure is the same on every rank."""
    first = dump.records[0].part
    return [r for r in dump.records if r.part == first]


def _last_position(records: list[Record], boundary: Boundary) -> int:
    positions = [i for i, r in enumerate(records) if boundary.matches(r)]
    if not positions:
        raise LookupError(f"{boundary} is not in the discovery run")
    return positions[-1]
