"""Pairing: which tensor of side A is compared with which tensor of side B.

The stage is pluggable: :class:`NamePairing` pairs tensors of two runs of the same program by
(name, step, call, role, rank, thread); cross-framework alignment supplies its own pairing, which may
also attach a plan that reshapes or reassembles tensors before they are compared.
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tdiff.compare.tokens import TokenRows
from tdiff.errors import TdiffError
from tdiff.store import Dump, Record
from tdiff.vocab.parse import compile_patterns, format_ranges, parse_ranges
from tdiff.vocab.paths import layer_of, record_layer


@dataclass
class Side:
    """One side of a pair: the records it is built from and how to turn them into one tensor."""

    records: list[Record]
    load: Callable[[], torch.Tensor] | None = None  # default: load the single record as stored
    plan: list[str] = field(default_factory=list)   # human-readable steps of that transform

    @property
    def record(self) -> Record:
        return self.records[0]


@dataclass
class Pair:
    name: str
    a: Side | None
    b: Side | None
    kind: str | None = None       # the op boundary kind, when an adapter knows it
    note: str | None = None       # why a one-sided pair has no partner, when the pairing knows
    tokens: TokenRows | None = None   # the token each row (dim 0) stands for, when aligned by token

    @property
    def record(self) -> Record:
        """Side A's record, else side B's (a pair has at least one side)."""
        side = self.a if self.a is not None else self.b
        assert side is not None, "a pair without a side"
        return side.record


class Pairing(Protocol):
    def pair(self, a: Dump, b: Dump) -> list[Pair]:
        """Pairs in side A's execution order, with B-only entries placed after their predecessor."""


class NamePairing:
    """Tensors of two runs of the same program, paired by (name, step, call, role, rank, thread):
    a thread's records pair with those of the same thread of the other run."""

    def pair(self, a: Dump, b: Dump) -> list[Pair]:
        return _keyword_and_position_paired(merge_in_order(
            a.records, b.records, key=lambda r: r.pair_key,
            make=lambda ra, rb: Pair(name=(ra or rb).name, a=Side([ra]) if ra else None, b=Side([rb]) if rb else None)))


def _keyword_and_position_paired(pairs: list[Pair]) -> list[Pair]:
    """An input one side passed by position and the other by keyword, paired by the parameter it
    binds to (Record.bound_key), under its keyword name; each stays at side A's place."""
    only_b: dict[tuple, int] = {}
    for index, pair in enumerate(pairs):
        if pair.a is None and pair.record.role == "input":
            only_b.setdefault(pair.record.bound_key, index)
    if not only_b:
        return pairs
    out, taken = [], set()
    for pair in pairs:
        if pair.b is None and pair.record.role == "input":
            partner = only_b.pop(pair.record.bound_key, None)
            if partner is not None:
                taken.add(partner)
                pair = Pair(name=pair.record.bound_key[0], a=pair.a, b=pairs[partner].b)
        out.append(pair)
    return [pair for index, pair in enumerate(out) if index not in taken]


@dataclass(frozen=True)
class NameFilter:
    """``--select`` / ``--exclude`` / ``--layers`` of compare, bisect and report: a pair is wanted
    when its name matches a select pattern (or none is given) and no exclude pattern
    (``re.search``), and it belongs to one of the decoder layers (when they are given)."""

    select: tuple[re.Pattern, ...] = ()
    exclude: tuple[re.Pattern, ...] = ()
    layers: frozenset[int] | None = None

    @classmethod
    def of(cls, select=(), exclude=(), layers: str | None = None) -> NameFilter:
        return cls(compile_patterns(select, "--select"), compile_patterns(exclude, "--exclude"),
                   parse_ranges(layers, "--layers"))

    def __bool__(self) -> bool:
        return bool(self.select or self.exclude or self.layers is not None)

    def wants(self, name: str) -> bool:
        if any(p.search(name) for p in self.exclude):
            return False
        return not self.select or any(p.search(name) for p in self.select)

    def wants_tensor(self, name: str) -> bool:
        """A tensor by its (canonical) name alone: its decoder layer is the one the name carries."""
        return self.wants(name) and (self.layers is None or layer_of(name) in self.layers)

    def wants_pair(self, pair: Pair) -> bool:
        if self.layers is not None and pair_layer(pair.name, pair.kind, pair.record) not in self.layers:
            return False
        return self.wants(pair.name)

    def wants_record(self, record: Record) -> bool:
        """A record of a dump compared by name (online bisection's discovery runs)."""
        return self.wants_pair(Pair(record.name, Side([record]), None))

    def applied_to(self, pairing: Pairing | None) -> Pairing | None:
        """``pairing`` (None: by name) keeping only the pairs this filter wants; as it is when
        the filter is empty."""
        return FilteredPairing(pairing or NamePairing(), self) if self else pairing

    def nothing_left(self) -> str:
        """The one-line error when it leaves no pair."""
        said = [f"--{option} {' '.join(p.pattern for p in patterns)}"
                for option, patterns in (("select", self.select), ("exclude", self.exclude)) if patterns]
        if self.layers is not None:
            said.append(f"--layers {format_ranges(self.layers)}")
        if not said:
            return "nothing to compare: the dumps have no tensor in common"
        return f"nothing to compare: no tensor is left by {' and '.join(said)}"


def pair_layer(name: str, kind: str | None, record: Record) -> int | None:
    """The decoder layer of a pair (None for explicit dumps): an aligned pair's canonical name
    carries it (its records may sit elsewhere); else the layer its record's call belongs to."""
    if record.role == "explicit":
        return None
    return layer_of(name) if kind is not None else record_layer(record)


class FilteredPairing:
    """Another pairing's pairs whose names a :class:`NameFilter` wants."""

    def __init__(self, pairing: Pairing, name_filter: NameFilter):
        self.pairing, self.name_filter = pairing, name_filter
        self.left_out = 0   # pairs the last pair() call left out

    @property
    def alignment(self):
        return getattr(self.pairing, "alignment", None)

    def pair(self, a: Dump, b: Dump) -> list[Pair]:
        pairs = self.pairing.pair(a, b)
        wanted = [p for p in pairs if self.name_filter.wants_pair(p)]
        if pairs and not wanted:
            raise TdiffError(self.name_filter.nothing_left())
        self.left_out = len(pairs) - len(wanted)
        keep_uncompared(self.alignment, self.name_filter.wants_tensor)
        return wanted


def keep_uncompared(alignment: object, wanted: Callable[[str], bool]) -> None:
    """Narrow a token alignment's uncompared rows to the tensors a filter keeps (no-op for others)."""
    uncompared = getattr(alignment, "uncompared", None)
    if uncompared is not None:
        uncompared.keep(wanted)


def merge_in_order(items_a, items_b, *, key, make) -> list:
    """Pair items with equal keys, in A's order; a B-only item follows the pair of the B item
    before it (or leads, if none came before). Repeated keys pair up in order of occurrence."""
    by_key: dict = defaultdict(deque)
    for item in items_b:
        by_key[key(item)].append(item)
    position_of_b: dict[int, int] = {}
    pairs: list = []
    for item in items_a:
        partners = by_key.get(key(item))
        partner = partners.popleft() if partners else None
        if partner is not None:
            position_of_b[id(partner)] = len(pairs)
        pairs.append(make(item, partner))
    after: dict[int, list] = defaultdict(list)
    anchor = -1
    for item in items_b:
        if id(item) in position_of_b:
            anchor = position_of_b[id(item)]
        else:
            after[anchor].append(make(None, item))
    ordered = list(after.get(-1, []))
    for index, pair in enumerate(pairs):
        ordered.append(pair)
        ordered.extend(after.get(index, []))
    return ordered
