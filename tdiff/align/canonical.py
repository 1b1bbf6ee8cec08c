"""Canonical tensors: what an adapter finds in a dump, planned from metadata, built on demand.

An adapter reports *pieces*: one rank's contribution to one canonical boundary (its records, how
to combine them, which per-shard transforms to apply, and the layout steps that follow once the
shards are reassembled). :func:`assemble` groups the pieces of all ranks into
:class:`CanonicalTensor` objects and plans the unsharding; :meth:`CanonicalTensor.load` executes
the plan. Nothing is loaded until a comparison asks for it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from tdiff.align.ops import Combine, Take
from tdiff.align.unshard import Coords, UnshardError, UnshardStep, coords_of, execute_unshard, plan_unshard
from tdiff.store import Dump, Record
from tdiff.vocab.boundaries import kind_of, order_key


@dataclass
class Piece:
    """One rank's contribution to a canonical boundary."""

    name: str
    step: int
    call: int
    records: list[Record]                         # the primary record first
    combine: Combine = Take()
    transforms: tuple = ()                        # per shard, before unsharding
    layout: tuple = ()                            # after unsharding
    kind: str | None = None                       # default: the vocabulary's kind of `name`
    spec: list[dict] | None = None                # shard spec; default: the primary record's attrs
    uncertain: str | None = None                  # why it may not be a real op (no class recorded)

    @property
    def group(self) -> int:
        """Ranks that hold parts of the same tensor share a group: their data-parallel rank
        (the record's rank when the capture recorded no parallel layout)."""
        record = self.records[0]
        parallel = record.attrs.get("parallel") or {}
        axis = "edp" if any(e.get("axis") in ("ep", "etp") for e in self.shard_spec) else "dp"
        value = parallel.get(axis)
        return int(value[0]) if isinstance(value, (list, tuple)) and value else record.rank

    @property
    def shard_spec(self) -> list[dict]:
        if self.spec is not None:
            return self.spec
        spec = self.records[0].attrs.get("shard") or []
        return [entry for entry in spec if isinstance(entry, dict)]


@dataclass
class CanonicalTensor:
    name: str
    kind: str
    step: int
    call: int
    group: int
    pieces: list[Piece]
    unshard: list[UnshardStep] = field(default_factory=list)

    @property
    def uncertain(self) -> str | None:
        return self.pieces[0].uncertain

    @property
    def key(self) -> tuple:
        return (self.name, self.step, self.call, self.group)

    @property
    def records(self) -> list[Record]:
        return [r for piece in self.pieces for r in piece.records]

    def plan(self) -> list[str]:
        first = self.pieces[0]
        names = [r.name for r in first.records]
        source = first.combine.describe(names)
        ranks = sorted({p.records[0].rank for p in self.pieces})
        if len(ranks) > 1:
            source += f" on ranks {', '.join(map(str, ranks))}"
        return ([source] + [t.describe() for t in first.transforms]
                + [s.describe() for s in self.unshard] + [t.describe() for t in first.layout])

    def load(self, dump: Dump, warn) -> torch.Tensor:
        shards: list[tuple[Coords, torch.Tensor]] = []
        for piece in self.pieces:
            tensor = piece.combine.apply([dump.load(r) for r in piece.records])
            for transform in piece.transforms:
                tensor = transform.apply(tensor)
            shards.append((coords_of(piece.records[0].attrs), tensor))
        if self.unshard:
            tensor = execute_unshard(self.unshard, shards, lambda message: warn(f"{self.name}: {message}"))
        else:
            tensor = shards[0][1]
        for transform in self.pieces[0].layout:
            tensor = transform.apply(tensor)
        return tensor.contiguous()


def assemble(pieces: list[Piece]) -> tuple[list[CanonicalTensor], list[tuple[str, str]]]:
    """Group the pieces of every rank by (name, step, call, group) and plan their unsharding.

    Returns the canonical tensors in execution order and the (name, reason) of those that cannot
    be reassembled.
    """
    grouped: dict[tuple, list[Piece]] = defaultdict(list)
    for piece in pieces:
        grouped[(piece.name, piece.step, piece.call, piece.group)].append(piece)
    tensors, unresolved = [], []
    for (name, step, call, group), members in grouped.items():
        members.sort(key=lambda p: p.records[0].rank)
        try:
            steps = plan_unshard([coords_of(p.records[0].attrs) for p in members], members[0].shard_spec)
        except UnshardError as exc:
            unresolved.append((name, f"step {step}: cannot reassemble its shards: {exc}"))
            continue
        if len(members) > 1 and not steps:
            ranks = ", ".join(str(p.records[0].rank) for p in members)
            unresolved.append((name, f"step {step}: ranks {ranks} each hold it but recorded no parallel layout"))
            continue
        tensors.append(CanonicalTensor(name, members[0].kind or kind_of(name), step, call, group, members, steps))
    tensors.sort(key=lambda t: (t.group, t.step, order_key(t.name), t.call))
    return tensors, unresolved
