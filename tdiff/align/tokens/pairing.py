"""TokenPairing: pair two runs of different token layouts token by token.

The pairing stage of SGLang's comparator pipeline (unshard -> reorder -> align -> compare): a
base pairing (by name within one framework, by canonical boundary across frameworks, which also
unshards) gives each side's tensors per step; this one regroups them by boundary across steps,
locates every row as (sequence, position) (tdiff.align.tokens.rows), matches sequences across the
runs by token ids (tdiff.align.tokens.sequences) and pairs the rows of one token. A pair's
tensors are then ``[tokens, ...]``, in order of (A's sequence, position), and carry the token
of each row, for the verdict per token.

- A position one run has and the other lacks (the last sampled token is never fed to the
  engine) is one-sided: listed, not compared, not a divergence by itself.
- A boundary one run lacks at every step is a one-sided pair: a divergence. Within one framework,
  a module input only one run passes (an engine's ``position_ids``, a trainer's
  ``attention_mask``) is listed as one-sided instead, not a divergence by itself: the runs are
  called differently by design. A one-sided output, module or explicit dump still diverges.
- A boundary whose tensors have no row per token (an attention mask, a decode step's
  cache position) is listed as not token-aligned and not compared.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from tdiff.align.pairing import Alignment, CanonicalPairing
from tdiff.align.tokens.rows import Located, locate
from tdiff.align.tokens.sequences import SequenceIndex, index_sequences, match_sequences
from tdiff.compare.pairing import Pair, Pairing, Side
from tdiff.compare.tokens import TokenRef, TokenRows
from tdiff.errors import TdiffError
from tdiff.store import Dump


@dataclass
class SequencePair:
    a: int
    b: int
    rank_a: int
    rank_b: int
    shared: int                 # positions both runs fed
    only_a: list[int]           # positions only A fed
    only_b: list[int]

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "rank_a": self.rank_a, "rank_b": self.rank_b, "shared": self.shared,
                "only_a": self.only_a, "only_b": self.only_b}


@dataclass
class TokenAlignment:
    """How the runs' tokens were aligned: sequence partners, sequences without one, boundaries
    not aligned, and (across frameworks) the boundary alignment below it."""

    sequences: list[SequencePair] = field(default_factory=list)
    unmatched_a: list[dict] = field(default_factory=list)    # {"seq", "rank", "tokens"}
    unmatched_b: list[dict] = field(default_factory=list)
    not_aligned: list[tuple[str, str]] = field(default_factory=list)
    partly: list[tuple[str, str]] = field(default_factory=list)   # compared at the steps whose rows are tokens
    one_sided_inputs: list[tuple[str, str]] = field(default_factory=list)   # (name, "A" or "B"): passed by one run only
    boundaries: Alignment | None = None

    @property
    def warnings(self) -> list[str]:
        return self.boundaries.warnings if self.boundaries is not None else []

    def to_json(self) -> dict:
        out = {"by": "tokens", "sequences": [s.to_json() for s in self.sequences],
               "unmatched": {"a": self.unmatched_a, "b": self.unmatched_b},
               "not_aligned": [{"name": n, "reason": r} for n, r in self.not_aligned],
               "partly_aligned": [{"name": n, "reason": r} for n, r in self.partly],
               "one_sided_inputs": [{"name": n, "side": side} for n, side in self.one_sided_inputs]}
        if self.boundaries is not None:
            out["boundaries"] = self.boundaries.to_json()
        return out


@dataclass
class _Unit:
    """One side's tensor of a boundary at one step."""

    side: Side
    step: int
    rank: int


@dataclass
class _Group:
    name: str
    kind: str | None
    units: tuple[list[_Unit], list[_Unit]] = field(default_factory=lambda: ([], []))
    note: str | None = None


class TokenPairing:
    """Pairs by token over ``base``'s tensors; after :meth:`pair`, ``alignment`` says how.

    ``chosen``: picked because the dumps' token layouts differ, not asked for (--align tokens).
    Then, when no tensor of either dump has rows to locate by token (a script's own log-probs of
    one row, dumped without positions), the base pairing stands: its pairs, its alignment."""

    def __init__(self, base: Pairing, *, chosen: bool = False):
        self.base = base
        self.chosen = chosen
        self.alignment: TokenAlignment | Alignment | None = None

    def pair(self, a: Dump, b: Dump) -> list[Pair]:
        for dump in (a, b):
            if not dump.token_batches():
                raise TdiffError(f"{dump.path}: the dump carries no token metadata to align by; capture it with "
                                 "this tdiff (or call tdiff.tokens) or pass --align names/boundaries")
        base_pairs = self.base.pair(a, b)
        boundaries = getattr(self.base, "alignment", None)
        self.alignment = alignment = TokenAlignment(boundaries=boundaries if isinstance(boundaries, Alignment)
                                                    else None)
        batches = (a.token_batches(), b.token_batches())
        indexes = (index_sequences(batches[0]), index_sequences(batches[1]))
        matcher = _Matcher(indexes)
        located: tuple[dict, dict] = ({}, {})
        rows: dict[tuple, tuple[list, tuple[TokenRows, tuple[list, list]] | str]] = {}
        pairs = []
        # a canonical name is one tensor (HF's attn.core is an input, Megatron's an output); a
        # module's input and output may share a name
        for group in _groups(base_pairs, by_role=not isinstance(self.base, CanonicalPairing)):
            units_a, units_b = group.units
            if not units_a or not units_b:
                if not isinstance(self.base, CanonicalPairing) and _inputs_only(units_a or units_b):
                    alignment.one_sided_inputs.append((group.name, "A" if units_a else "B"))
                    continue
                pairs.append(Pair(group.name, _joined(units_a), _joined(units_b), kind=group.kind, note=group.note))
                continue
            aligned = _aligned(group, (a, b), batches, indexes, matcher, located, rows, alignment.partly)
            if isinstance(aligned, str):
                alignment.not_aligned.append((group.name, aligned))
            else:
                pairs.append(aligned)
        if self.chosen and not any(p.tokens is not None for p in pairs):
            self.alignment = boundaries if isinstance(boundaries, Alignment) else None
            return base_pairs
        matcher.describe(alignment)
        if boundaries is not None and alignment.boundaries is not None:
            # one-sided at some step is the rule across layouts: only boundaries one run lacks at every step remain
            alignment.boundaries.a.unmatched = [p.name for p in pairs if p.b is None]
            alignment.boundaries.b.unmatched = [p.name for p in pairs if p.a is None]
        return pairs


def _groups(base_pairs: list[Pair], *, by_role: bool) -> list[_Group]:
    """The base pairs' sides regrouped by (name, role, rank, call within the step), across steps."""
    groups: dict[tuple, _Group] = {}
    calls: tuple[Counter, Counter] = (Counter(), Counter())
    for pair in base_pairs:
        for which, side in enumerate((pair.a, pair.b)):
            if side is None:
                continue
            record = side.record
            step_key = (pair.name, record.role if by_role else None, record.rank, record.step)
            call = calls[which][step_key]
            calls[which][step_key] += 1
            group = groups.setdefault((*step_key[:3], call), _Group(pair.name, pair.kind))
            group.units[which].append(_Unit(side, record.step, record.rank))
            group.note = group.note or pair.note
    return list(groups.values())


def _inputs_only(units: list[_Unit]) -> bool:
    return all(record.role == "input" for unit in units for record in unit.side.records)


def _joined(units: list[_Unit]) -> Side | None:
    if not units:
        return None
    return Side([r for unit in units for r in unit.side.records], plan=units[0].side.plan)


class _Matcher:
    """Sequence partners of two ranks' sequences, matched once."""

    def __init__(self, indexes: tuple[SequenceIndex, SequenceIndex]):
        self.indexes = indexes
        self.matches: dict[tuple[int, int], dict[int, int]] = {}

    def partners(self, rank_a: int, rank_b: int) -> dict[int, int]:
        key = (rank_a, rank_b)
        if key not in self.matches:
            self.matches[key] = match_sequences(self.indexes[0].on_rank(rank_a), self.indexes[1].on_rank(rank_b))
        return self.matches[key]

    def describe(self, alignment: TokenAlignment) -> None:
        sequences_a, sequences_b = self.indexes[0].sequences, self.indexes[1].sequences
        paired_a, paired_b = set(), set()
        for (rank_a, rank_b), partners in sorted(self.matches.items()):
            for index_a, index_b in sorted(partners.items()):
                ta, tb = sequences_a[index_a].tokens, sequences_b[index_b].tokens
                alignment.sequences.append(SequencePair(
                    index_a, index_b, rank_a, rank_b, len(ta.keys() & tb.keys()),
                    sorted(ta.keys() - tb.keys()), sorted(tb.keys() - ta.keys())))
                paired_a.add(index_a)
                paired_b.add(index_b)
        ranks_a = {rank_a for rank_a, _ in self.matches}
        ranks_b = {rank_b for _, rank_b in self.matches}
        alignment.unmatched_a = [{"seq": s.index, "rank": s.rank, "tokens": len(s.tokens)} for s in sequences_a
                                 if s.index not in paired_a and s.rank in ranks_a]
        alignment.unmatched_b = [{"seq": s.index, "rank": s.rank, "tokens": len(s.tokens)} for s in sequences_b
                                 if s.index not in paired_b and s.rank in ranks_b]


def _aligned(group: _Group, dumps: tuple[Dump, Dump], batches: tuple[dict, dict],
             indexes: tuple[SequenceIndex, SequenceIndex], matcher: _Matcher,
             caches: tuple[dict, dict], paired_rows: dict, partly: list[tuple[str, str]]) -> Pair | str:
    """The group's token pair, or why it has none. ``paired_rows`` keeps the pairing of rows that
    boundaries located alike share (all the module tensors of the same steps); ``partly`` gets the
    groups some of whose steps have no row per token (an LM head computing the last token only
    in the prefill)."""
    located: list[list[tuple[_Unit, Located]]] = [[], []]
    for which in (0, 1):
        reasons = []
        for unit in group.units[which]:
            record = unit.side.record
            found = locate(record, batches[which].get((unit.step, unit.rank)), indexes[which], caches[which])
            if isinstance(found, str):
                reasons.append(found)
            else:
                located[which].append((unit, found))
        if not located[which]:
            return f"side {'AB'[which]}: {reasons[0]}"
        if reasons:
            partly.append((group.name, f"side {'AB'[which]}: {len(reasons)} step(s) not compared, first: {reasons[0]}"))
        widths = {found.features(unit.side.record) for unit, found in located[which] if unit.side.load is None}
        if len(widths) > 1:
            return f"side {'AB'[which]}: rows of different widths across steps ({', '.join(map(str, sorted(widths)))})"
    key = tuple(tuple(id(found) for _, found in side) for side in located)
    if key not in paired_rows:
        # the Located objects are kept with the result: their ids in the key stay theirs
        paired_rows[key] = (located, _paired_rows(located, matcher))
    paired = paired_rows[key][1]
    if isinstance(paired, str):
        return paired
    tokens, picks = paired
    sides = [_gathered(group.name, dumps[which], located[which], picks[which]) for which in (0, 1)]
    return Pair(group.name, sides[0], sides[1], kind=group.kind, tokens=tokens)


def _paired_rows(located: list[list[tuple[_Unit, Located]]],
                 matcher: _Matcher) -> tuple[TokenRows, tuple[list, list]] | str:
    """Rows of one token on both sides (in order of A's sequence and position), with the (unit,
    row) each comes from; or why there is none."""
    rows_b: dict[tuple[int, int], tuple[int, int]] = {}
    for i, (_, found) in enumerate(located[1]):
        for row, sequence, position in zip(found.rows, found.sequences, found.positions):
            rows_b.setdefault((sequence, position), (i, row))
    rows_a: dict[tuple[int, int], tuple[int, int]] = {}
    for i, (_, found) in enumerate(located[0]):
        for row, sequence, position in zip(found.rows, found.sequences, found.positions):
            rows_a.setdefault((sequence, position), (i, row))
    partners = matcher.partners(located[0][0][0].rank, located[1][0][0].rank)
    refs: list[TokenRef] = []
    picks: tuple[list, list] = ([], [])
    for (sequence_a, position), (i, row) in sorted(rows_a.items()):
        sequence_b = partners.get(sequence_a)
        hit = rows_b.get((sequence_b, position)) if sequence_b is not None else None
        if sequence_b is None or hit is None:
            continue
        refs.append(TokenRef(sequence_a, sequence_b, position, located[0][i][0].step, located[1][hit[0]][0].step))
        picks[0].append((i, row))
        picks[1].append(hit)
    if not refs:
        return f"no token in common ({len(rows_a)} located on A, {len(rows_b)} on B)"
    return TokenRows(refs, only_a=len(rows_a) - len(refs), only_b=len(rows_b) - len(refs)), picks


def _gathered(name: str, dump: Dump, located: list[tuple[_Unit, Located]], picks: list[tuple[int, int]]) -> Side:
    used = sorted({i for i, _ in picks})
    steps = sorted({located[i][0].step for i in used})
    shown = ", ".join(map(str, steps[:6])) + (f" ... {steps[-1]}" if len(steps) > 6 else "")
    plan = [f"{len(picks)} token rows from step(s) {shown}, in order of sequence and position"]
    first = located[used[0]][0].side
    return Side([r for i in used for r in located[i][0].side.records],
                load=functools.partial(_gather, name, dump, located, picks), plan=plan + first.plan)


def _gather(name: str, dump: Dump, located: list[tuple[_Unit, Located]], picks: list[tuple[int, int]]) -> torch.Tensor:
    by_unit: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for out, (i, row) in enumerate(picks):
        by_unit[i].append((out, row))
    parts, order = [], []
    for i, items in by_unit.items():
        unit, found = located[i]
        tensor = unit.side.load() if unit.side.load is not None else dump.load(unit.side.record)
        rows = found.as_rows(tensor, name)
        parts.append(rows.index_select(0, torch.tensor([row for _, row in items])))
        order += [out for out, _ in items]
    widths = {tuple(part.shape[1:]) for part in parts}
    if len(widths) > 1:
        raise TdiffError(f"{name}: its rows differ in shape across steps ({', '.join(map(str, sorted(widths)))}); "
                         "align it by name or boundary (--align)")
    gathered = torch.cat(parts)
    return gathered[torch.argsort(torch.tensor(order))]
