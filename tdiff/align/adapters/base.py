"""What every adapter shares: an index of one rank's records for one step, simple one-record
rules, and the scan that turns a whole dump into canonical tensors."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from tdiff.align.canonical import CanonicalTensor, Piece, assemble
from tdiff.align.ops import Combine, Take, TokensFirst
from tdiff.store import Dump, Record
from tdiff.vocab.boundaries import MODEL_INPUTS, layer_name, split_name


class View:
    """The records of one rank and one step, looked up by (module, role, sub, call)."""

    def __init__(self, records: list[Record]):
        self.records = records
        self.step, self.rank = records[0].step, records[0].rank
        self.problems: list[tuple[Piece, str]] = []   # boundaries found but not buildable, and why
        self._by_key = {(r.module, r.role, r.sub, r.call): r for r in records}
        self.modules: dict[str, str | None] = {}   # module path -> class, in execution order
        for r in records:
            if r.role != "explicit":
                self.modules.setdefault(r.module, r.module_class)

    def get(self, module: str, role: str, sub: str = "", call: int = 0) -> Record | None:
        record = self._by_key.get((module, role, sub, call))
        if record is None and sub == "0":
            # SGLang's dumper names a tuple holding one tensor (Megatron's (out, None)) like a
            # bare tensor
            record = self._by_key.get((module, role, "", call))
        return record

    def calls(self, module: str, role: str, sub: str = "") -> list[Record]:
        out, call = [], 0
        while (record := self.get(module, role, sub, call)) is not None:
            out.append(record)
            call += 1
        return out

    def find(self, pattern: re.Pattern) -> list[tuple[re.Match, str]]:
        return [(m, module) for module in self.modules if (m := pattern.fullmatch(module))]

    def unresolved(self, found: Piece, reason: str) -> None:
        self.problems.append((found, reason))


@dataclass(frozen=True)
class Rule:
    """One stored tensor is one canonical boundary: module path pattern (a ``layer`` group for
    per-layer boundaries), role, sub-name, and the stored leading dims (see TokensFirst)."""

    pattern: str
    role: str
    subs: tuple[str, ...]
    boundary: str
    order: str
    skip_classes: tuple[str, ...] = ()     # classes that only stand in for the op (IdentityOp)

    def compile(self) -> re.Pattern:
        return re.compile(self.pattern)


@dataclass
class Canonicalized:
    """One side of an alignment: its canonical tensors and everything that did not become one."""

    adapter: Adapter
    tensors: list[CanonicalTensor]
    unresolved: list[tuple[str, str]]          # (canonical name, why it could not be built)
    unmapped: list[Record]                     # records no canonical boundary uses
    not_exposed: dict[str, str] = field(default_factory=dict)   # boundary -> why


class Adapter:
    """Maps one framework's module paths and tensor layouts to canonical boundaries."""

    framework = ""
    label = ""
    rules: tuple[Rule, ...] = ()
    # boundaries (as in LAYER_BOUNDARIES, or model-level names) this framework never exposes
    not_exposed: Mapping[str, str] = {}

    def __init__(self):
        self._compiled = [(rule, rule.compile()) for rule in self.rules]

    def canonicalize(self, dump: Dump) -> Canonicalized:
        by_view: dict[tuple, list[Record]] = defaultdict(list)
        for record in dump.records:
            by_view[(record.rank, record.step)].append(record)
        pieces: list[Piece] = []
        problem_records: list[Record] = []
        problems: dict[str, str] = {}
        for records in by_view.values():
            view = View(records)
            pieces.extend(_first_of_each(self.pieces(view)))
            for found, reason in view.problems:
                problems.setdefault(found.name, f"step {found.step}: {reason}")
                problem_records.extend(found.records)
        not_exposed = self.not_exposed_in(dump)
        pieces = [p for p in pieces if split_name(p.name)[1] not in not_exposed]   # listed as unmapped
        tensors, unresolved = assemble(pieces)
        unresolved += sorted(problems.items())
        used = {(r.part, r.seq) for p in pieces for r in p.records}
        used |= {(r.part, r.seq) for r in problem_records}
        unmapped = [r for r in dump.records if (r.part, r.seq) not in used]
        return Canonicalized(self, tensors, unresolved, unmapped, not_exposed)

    def not_exposed_in(self, dump: Dump) -> dict[str, str]:
        return dict(self.not_exposed)

    def pieces(self, view: View) -> list[Piece]:
        """Every canonical piece in one rank's records of one step (the simple rules; adapters
        add the boundaries that need several records or a split)."""
        out = []
        matches: dict[str, list] = {}
        for record in view.records:
            if record.role == "explicit":
                # values dumped by name pair by that name, compared as stored
                out.append(Piece(record.name, view.step, record.call, [record]))
                continue
            if record.module not in matches:
                matches[record.module] = [(rule, m) for rule, pattern in self._compiled
                                          if (m := pattern.fullmatch(record.module))]
            for rule, match in matches[record.module]:
                if (record.role == rule.role and (record.sub in rule.subs or (record.sub == "" and "0" in rule.subs))
                        and record.module_class not in rule.skip_classes):
                    found = piece(rule.boundary, match, view, [record], layout=(TokensFirst(rule.order),))
                    if record.module_class is None and rule.skip_classes:
                        found.uncertain = (f"{record.module} has no recorded class: it may be a placeholder "
                                           f"({'/'.join(rule.skip_classes)}) rather than a real op")
                    out.append(found)
        return out


def canonical_name(boundary: str, match: re.Match | None) -> str:
    layer = match.groupdict().get("layer") if match is not None else None
    return layer_name(int(layer), boundary) if layer is not None else boundary


def piece(boundary: str, match: re.Match | None, view: View, records: list[Record], *,
          combine: Combine = Take(), transforms=(), layout=(), call: int | None = None,
          layer: int | None = None) -> Piece:
    name = layer_name(layer, boundary) if layer is not None else canonical_name(boundary, match)
    return Piece(name, view.step, records[0].call if call is None else call, records, combine,
                 tuple(transforms), tuple(layout))


def _first_of_each(pieces: list[Piece]) -> list[Piece]:
    """One piece per (name, call) in one rank's step: where two modules expose the same boundary
    (a root model and its inner model both receiving the positions), the first found wins. The
    model's inputs are taken once per step (SGLang's dumper names them alike wherever they pass)."""
    seen, out = set(), []
    for p in pieces:
        key = p.name if p.name in MODEL_INPUTS and p.records[0].role != "explicit" else (p.name, p.call)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out
