"""CanonicalPairing: pair two dumps of different frameworks by canonical boundary.

Each side's adapter turns its dump into canonical tensors; pairs are keyed by (canonical name,
step, call, data-parallel group) and ordered by execution (vocabulary order within a step). A
boundary found on one side only is either one the other framework does not expose (reported in
:class:`Alignment`, not compared) or a genuine gap (a one-sided pair: a divergence).
"""

from __future__ import annotations

import bisect

import functools
import re
import threading
from collections import Counter
from dataclasses import dataclass, field

from tdiff.align.adapters.base import Adapter, Canonicalized
from tdiff.align.canonical import CanonicalTensor
from tdiff.compare.pairing import Pair, Side
from tdiff.errors import TdiffError
from tdiff.store import Dump
from tdiff.vocab.boundaries import order_key, split_name


@dataclass
class SideAlignment:
    """What one side's adapter made of its dump."""

    side: str                     # the dump's label
    adapter: str                  # the adapter's label (framework)
    canonical: int                # canonical tensors found
    unmatched: list[str] = field(default_factory=list)          # on this side only; compared as a gap
    uncertain: list[tuple[str, str]] = field(default_factory=list)  # on this side only, maybe no real op
    not_exposed: dict[str, dict] = field(default_factory=dict)  # boundary -> {reason, skipped}
    unresolved: list[tuple[str, str]] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)           # record names, layers collapsed to N

    def to_json(self) -> dict:
        return {"side": self.side, "adapter": self.adapter, "canonical": self.canonical,
                "unmatched": self.unmatched, "not_exposed": self.not_exposed,
                "uncertain": [{"name": n, "reason": r} for n, r in self.uncertain],
                "unresolved": [{"name": n, "reason": r} for n, r in self.unresolved],
                "unmapped": self.unmapped}


_WARNING = threading.Lock()   # loads on several threads warn at once (compare --jobs)


@dataclass
class Alignment:
    """The report of a cross-framework pairing. ``not_exposed`` on side A lists boundaries that
    A's framework does not expose, so B's tensors of that boundary were not compared."""

    a: SideAlignment
    b: SideAlignment
    # filled while tensors load (replicas); sorted, so that pairs loaded on several threads or
    # processes (compare --jobs, torchrun) give the same list
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        with _WARNING:
            if message not in self.warnings:
                bisect.insort(self.warnings, message)

    def to_json(self) -> dict:
        return {"a": self.a.to_json(), "b": self.b.to_json(), "warnings": self.warnings}


class CanonicalPairing:
    """Pairs by canonical boundary; after :meth:`pair`, ``alignment`` says what was (not) aligned."""

    def __init__(self, adapter_a: Adapter, adapter_b: Adapter):
        self.adapters = (adapter_a, adapter_b)
        self.alignment: Alignment | None = None

    def pair(self, a: Dump, b: Dump) -> list[Pair]:
        ca, cb = self.adapters[0].canonicalize(a), self.adapters[1].canonicalize(b)
        for dump, found in ((a, ca), (b, cb)):
            if not found.tensors:
                raise TdiffError(f"{dump.path}: the {found.adapter.label} adapter found no canonical boundary "
                                 "in it; check the capture's --select/--layers (or the mapping's rules)")
        alignment = Alignment(_side_alignment(a, ca), _side_alignment(b, cb))
        self.alignment = alignment
        by_key_a = {t.key: t for t in ca.tensors}
        by_key_b = {t.key: t for t in cb.tensors}
        unresolved = ({n: r for n, r in ca.unresolved}, {n: r for n, r in cb.unresolved})
        pairs = []
        for key in sorted(by_key_a.keys() | by_key_b.keys(), key=_execution_order):
            ta, tb = by_key_a.get(key), by_key_b.get(key)
            if ta is not None and tb is not None:
                pairs.append(Pair(ta.name, _side(ta, a, alignment), _side(tb, b, alignment), kind=ta.kind))
                continue
            present, (here, other), which = (ta, (alignment.a, alignment.b), 1) if ta else \
                (tb, (alignment.b, alignment.a), 0)
            boundary = split_name(present.name)[1]
            other_reasons = (ca, cb)[which].not_exposed
            if boundary in other_reasons:
                entry = other.not_exposed.setdefault(boundary, {"reason": other_reasons[boundary], "skipped": 0})
                entry["skipped"] += 1
                continue
            if present.uncertain:
                here.uncertain.append((present.name, present.uncertain))
                continue
            note = unresolved[which].get(present.name)
            note = f"side {'AB'[which]} could not build it: {note}" if note else None
            here.unmatched.append(present.name)
            side = _side(present, (a, b)[1 - which], alignment)
            pairs.append(Pair(present.name, side if ta else None, None if ta else side, kind=present.kind, note=note))
        return pairs


def _execution_order(key: tuple) -> tuple:
    name, step, call, group = key
    return (group, step, order_key(name), call)


def _side(tensor: CanonicalTensor, dump: Dump, alignment: Alignment) -> Side:
    return Side(tensor.records, load=functools.partial(tensor.load, dump, alignment.warn), plan=tensor.plan())


def _side_alignment(dump: Dump, found: Canonicalized) -> SideAlignment:
    return SideAlignment(side=dump.side, adapter=found.adapter.label, canonical=len(found.tensors),
                         unresolved=found.unresolved, unmapped=collapse_names(r.name for r in found.unmapped))


_INDEX = re.compile(r"(^|\.)\d+(?=$|[.\[])")


def collapse_names(names) -> list[str]:
    """Record names with numeric path parts (layers, experts) replaced by N, each with its count."""
    counts = Counter(_INDEX.sub(r"\1N", name) for name in names)
    return [f"{name} (x{n})" if n > 1 else name for name, n in counts.items()]
