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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from tdiff.align.pairing import Alignment, CanonicalPairing
from tdiff.align.tokens.rows import Located, locate
from tdiff.align.tokens.sequences import Sequence, SequenceIndex, index_sequences, match_sequences
from tdiff.compare.pairing import Pair, Pairing, Side
from tdiff.compare.tokens import TokenRef, TokenRows
from tdiff.errors import TdiffError
from tdiff.store import Dump
from tdiff.store.tokens import PADDING


@dataclass
class SequencePair:
    a: int
    b: int
    rank_a: int
    rank_b: int
    shared: int                 # positions both runs fed
    only_a: list[int]           # positions only A fed
    only_b: list[int]
    parted: Parting | None = None   # where the runs sampled different tokens

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "rank_a": self.rank_a, "rank_b": self.rank_b, "shared": self.shared,
                "only_a": self.only_a, "only_b": self.only_b,
                "parted": self.parted.to_json() if self.parted is not None else None}


@dataclass(frozen=True)
class Parting:
    """The first position both runs fed a sequence pair with different tokens: a divergence (the
    runs sampled differently); the positions before it are compared as usual, those after not."""

    seq_a: int
    seq_b: int
    position: int
    token_a: int
    token_b: int

    def to_json(self) -> dict:
        return {"seq_a": self.seq_a, "seq_b": self.seq_b, "position": self.position, "token_a": self.token_a,
                "token_b": self.token_b}

    def describe(self) -> str:
        return (f"sampled token differs at seq {self.seq_a}/{self.seq_b} position {self.position}: "
                f"{self.token_a} vs {self.token_b}")


@dataclass(frozen=True)
class UncomparedToken:
    """A row of a tensor standing for a token both runs fed, left uncompared, and why. A side's
    sequence, or the position, is None where the row could not be located at all."""

    tensor: str
    seq_a: int | None
    seq_b: int | None
    position: int | None
    why: str

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "seq_a": self.seq_a, "seq_b": self.seq_b, "position": self.position,
                "why": self.why}

    def describe(self) -> str:
        def shown(value):
            return "?" if value is None else value
        return f"{self.tensor} seq {shown(self.seq_a)}/{shown(self.seq_b)} position {shown(self.position)}: {self.why}"


@dataclass
class Uncompared:
    """How many tensor-tokens fed by both runs were not compared, and the first of them: part of
    the verdict (a match that compared less than both runs fed is no match). Kept per tensor, so
    that a filter (--select, --layer) judges the tensors it keeps."""

    by_tensor: dict[str, tuple[int, UncomparedToken]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(count for count, _ in self.by_tensor.values())

    @property
    def first(self) -> UncomparedToken | None:
        return next((first for _, first in self.by_tensor.values()), None)

    def add(self, token: UncomparedToken, count: int = 1) -> None:
        known, first = self.by_tensor.get(token.tensor, (0, token))
        self.by_tensor[token.tensor] = (known + count, first)

    def keep(self, wanted: Callable[[str], bool]) -> None:
        """Only the tensors a filter keeps."""
        self.by_tensor = {name: entry for name, entry in self.by_tensor.items() if wanted(name)}

    def to_json(self) -> dict:
        return {"count": self.count, "first": self.first.to_json() if self.first is not None else None}

    def note(self) -> str:
        assert self.first is not None, "note: only of tokens left uncompared"
        return f"{self.count} tensor-tokens fed by both runs were not compared; first: {self.first.describe()}"

    def message(self) -> str:
        """The error of a match that compared less than both runs fed (exit 2)."""
        return f"{self.note()}; --allow-unaligned accepts that"


@dataclass
class TokenAlignment:
    """How the runs' tokens were aligned: sequence partners, sequences without one, boundaries
    not aligned, and (across frameworks) the boundary alignment below it."""

    sequences: list[SequencePair] = field(default_factory=list)
    unmatched_a: list[dict] = field(default_factory=list)    # {"seq", "rank", "tokens"}
    unmatched_b: list[dict] = field(default_factory=list)
    not_aligned: list[tuple[str, str]] = field(default_factory=list)
    partly: list[tuple[str, str]] = field(default_factory=list)   # compared at the steps whose rows are tokens
    uncompared: Uncompared = field(default_factory=Uncompared)
    one_sided_inputs: list[tuple[str, str]] = field(default_factory=list)   # (name, "A" or "B"): passed by one run only
    boundaries: Alignment | None = None

    @property
    def warnings(self) -> list[str]:
        return self.boundaries.warnings if self.boundaries is not None else []

    @property
    def partings(self) -> list[Parting]:
        """The sequence pairs that part, the lowest position first: divergences by themselves."""
        found = [s.parted for s in self.sequences if s.parted is not None]
        return sorted(found, key=lambda p: (p.position, p.seq_a))

    def to_json(self) -> dict:
        out = {"by": "tokens", "sequences": [s.to_json() for s in self.sequences],
               "unmatched": {"a": self.unmatched_a, "b": self.unmatched_b},
               "not_aligned": [{"name": n, "reason": r} for n, r in self.not_aligned],
               "partly_aligned": [{"name": n, "reason": r} for n, r in self.partly],
               "uncompared": self.uncompared.to_json(),
               "parted": [p.to_json() for p in self.partings],
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
        context = _Context((a, b), batches, indexes, matcher, alignment)
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
            try:
                pairs += _aligned(group, context)
            except _NotAligned as left:
                alignment.not_aligned.append((group.name, left.why))
                for token, count in left.lost:
                    alignment.uncompared.add(UncomparedToken(group.name, *token), count=count)
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
        self._reversed: dict[tuple[int, int], dict[int, int]] = {}
        self.parted: dict[int, Parting | None] = {}   # A's sequence -> where it parts from its partner
        self._fragments: dict[tuple[int, int], int | None] = {}

    def partners(self, rank_a: int, rank_b: int) -> dict[int, int]:
        key = (rank_a, rank_b)
        if key not in self.matches:
            self.matches[key] = match_sequences(self.indexes[0].on_rank(rank_a), self.indexes[1].on_rank(rank_b))
            self._reversed[key] = {b: a for a, b in self.matches[key].items()}
            for index_a, index_b in self.matches[key].items():
                self.parted[index_a] = _parting(self.indexes[0].sequences[index_a], self.indexes[1].sequences[index_b])
        return self.matches[key]

    def compared_at(self, sequence_a: int, position: int) -> bool:
        """Whether a position of A's sequence comes before where it parts from its partner."""
        parted = self.parted.get(sequence_a)
        return parted is None or position < parted.position

    def both_fed(self, which: int, ranks: tuple[int, int], sequence: int, position: int) -> tuple[int, int, bool] | None:
        """(A's sequence, B's sequence, whether side ``which``'s is an unmatched fragment) of a token
        of ``sequence`` that both runs fed at ``position``; None when the other run did not feed it.
        A fragment (a sequence not starting at position 0 that found no partner: decode steps whose
        prefill was not followed) has the token when a sequence of the other run agrees with it."""
        self.partners(*ranks)
        other = (self.matches if which == 0 else self._reversed)[ranks].get(sequence)
        mine = self.indexes[which].sequences[sequence]
        fragment = other is None
        if other is None:
            if 0 in mine.tokens:
                return None   # a whole sequence without a partner: listed as unmatched
            other = self._fragment_partner(which, ranks, mine)
            if other is None:
                return None
        theirs = self.indexes[1 - which].sequences[other]
        if position not in mine.tokens or position not in theirs.tokens:
            return None
        pair = (sequence, other) if which == 0 else (other, sequence)
        if not fragment and not self.compared_at(pair[0], position):
            return None   # after the runs parted: other tokens, not both fed
        return (*pair, fragment)

    def _fragment_partner(self, which: int, ranks: tuple[int, int], fragment: Sequence) -> int | None:
        """The other run's sequence agreeing with a fragment on most positions (None: none agrees)."""
        key = (which, fragment.index)
        if key not in self._fragments:
            agreeing = [(fragment.agrees_with(s), -s.index, s.index)
                        for s in self.indexes[1 - which].on_rank(ranks[1 - which])]
            best = max(agreeing, default=None)
            self._fragments[key] = best[2] if best is not None and best[0] > 0 else None
        return self._fragments[key]

    def describe(self, alignment: TokenAlignment) -> None:
        sequences_a, sequences_b = self.indexes[0].sequences, self.indexes[1].sequences
        paired_a, paired_b = set(), set()
        for (rank_a, rank_b), partners in sorted(self.matches.items()):
            for index_a, index_b in sorted(partners.items()):
                ta, tb = sequences_a[index_a].tokens, sequences_b[index_b].tokens
                alignment.sequences.append(SequencePair(
                    index_a, index_b, rank_a, rank_b, len(ta.keys() & tb.keys()),
                    sorted(ta.keys() - tb.keys()), sorted(tb.keys() - ta.keys()), self.parted.get(index_a)))
                paired_a.add(index_a)
                paired_b.add(index_b)
        ranks_a = {rank_a for rank_a, _ in self.matches}
        ranks_b = {rank_b for _, rank_b in self.matches}
        alignment.unmatched_a = [{"seq": s.index, "rank": s.rank, "tokens": len(s.tokens)} for s in sequences_a
                                 if s.index not in paired_a and s.rank in ranks_a]
        alignment.unmatched_b = [{"seq": s.index, "rank": s.rank, "tokens": len(s.tokens)} for s in sequences_b
                                 if s.index not in paired_b and s.rank in ranks_b]


@dataclass
class _Context:
    """What the groups of one pairing share."""

    dumps: tuple[Dump, Dump]
    batches: tuple[dict, dict]
    indexes: tuple[SequenceIndex, SequenceIndex]
    matcher: _Matcher
    alignment: TokenAlignment
    located: tuple[dict, dict] = field(default_factory=lambda: ({}, {}))
    # the pairing of rows that boundaries located alike share (all the module tensors of the same steps)
    paired_rows: dict = field(default_factory=dict)


def _aligned(group: _Group, context: _Context) -> list[Pair]:
    """The group's token pair; or, for a tensor with no row per token on either side, its pairs as
    stored where their shapes agree; or none, the group listed as not aligned. Rows standing for a
    token both runs fed that are left uncompared go to the alignment's ``uncompared``."""
    alignment = context.alignment
    located: list[list[tuple[_Unit, Located]]] = [[], []]
    shapeless: list[list[tuple[_Unit, str]]] = [[], []]   # a step's tensor with no row per token, and why
    for which in (0, 1):
        for unit in group.units[which]:
            record = unit.side.record
            batch = context.batches[which].get((unit.step, unit.rank))
            if batch is None:
                alignment.uncompared.add(UncomparedToken(
                    group.name, None, None, None,
                    f"side {'AB'[which]}'s step {unit.step} has no token metadata on rank {unit.rank}"),
                    count=max(1, record.shape[0] if record.shape else 1))
                continue
            found = locate(record, batch, context.indexes[which], context.located[which])
            if isinstance(found, str):
                shapeless[which].append((unit, found))
                continue
            if found.strays:
                alignment.uncompared.add(UncomparedToken(
                    group.name, None, None, None,
                    f"side {'AB'[which]}'s step {unit.step} has rows of a sequence its token metadata lacks"),
                    count=found.strays)
            located[which].append((unit, found))
    if not located[0] and not located[1]:
        return _as_stored(group, [[why for _, why in side] for side in shapeless])
    ranks = (group.units[0][0].rank, group.units[1][0].rank)
    for which in (0, 1):
        if not located[which]:
            why = f"side {'AB'[which]} has no row per token of it: " + \
                (shapeless[which][0][1] if shapeless[which] else "no token metadata")
            widths = {found.features(unit.side.record) for unit, found in located[1 - which]}
            if shapeless[1 - which] or len(widths) > 1:
                raise _NotAligned(why)   # neither side has a row per token throughout: not token-shaped
            _left_out(why, located, context.matcher, ranks)
    misfits = _misfits(located)
    if isinstance(misfits, str):
        _left_out(misfits, located, context.matcher, ranks)
    for which in (0, 1):
        whole = not shapeless[1 - which] and not misfits[1 - which]   # the other side: a row per token at every step
        left = shapeless[which] + misfits[which]
        if left:
            why = f"side {'AB'[which]}: {len(left)} step(s) not compared, first: {left[0][1]}"
            alignment.partly.append((group.name, why))
        if whole:
            # the other side has this tensor's rows of every token: the tokens of a step this side's
            # layout was not understood at are not compared
            for unit, why in shapeless[which]:
                for seq_a, seq_b, position in _fed_tokens(which, unit, context, ranks):
                    alignment.uncompared.add(UncomparedToken(group.name, seq_a, seq_b, position,
                                                             f"side {'AB'[which]}: {why}"))
    key = tuple(tuple(id(found) for _, found in side) for side in located)
    if key not in context.paired_rows:
        # the Located objects are kept with the result: their ids in the key stay theirs
        context.paired_rows[key] = (located, _paired_rows(located, context.matcher, ranks))
    tokens, picks, lost = context.paired_rows[key][1]
    if tokens is None:
        raise _NotAligned(f"no token in common ({_rows_located(located[0])} located on A, "
                          f"{_rows_located(located[1])} on B)", lost)
    for token, count in lost:
        alignment.uncompared.add(UncomparedToken(group.name, *token), count=count)
    sides = [_gathered(group.name, context.dumps[which], located[which], picks[which]) for which in (0, 1)]
    return [Pair(group.name, sides[0], sides[1], kind=group.kind, tokens=tokens)]


def _parting(a: Sequence, b: Sequence) -> Parting | None:
    for position in sorted(a.tokens.keys() & b.tokens.keys()):
        if a.tokens[position] != b.tokens[position]:
            return Parting(a.index, b.index, position, a.tokens[position], b.tokens[position])
    return None


def _misfits(located: list[list[tuple[_Unit, Located]]]) -> list[list[tuple[_Unit, str]]] | str:
    """Where a side's rows have several widths across steps (a decode step's attention mask over
    the cache is [batch, keys]; the prefill's [batch, seq]), the steps whose width is not the one
    both sides share: removed from ``located``, with why (listed, not token rows). A string: why
    no width is shared."""
    widths = [{found.features(unit.side.record) for unit, found in side if unit.side.load is None} for side in located]
    if len(widths[0]) <= 1 and len(widths[1]) <= 1:
        return [[], []]
    common = widths[0] & widths[1]
    if len(common) != 1:
        which = 0 if len(widths[0]) > 1 else 1
        return (f"side {'AB'[which]}: rows of different widths across steps "
                f"({', '.join(map(str, sorted(widths[which])))})")
    width = next(iter(common))
    misfits: list[list[tuple[_Unit, str]]] = [[], []]
    for which in (0, 1):
        kept = []
        for unit, found in located[which]:
            features = found.features(unit.side.record)
            if unit.side.load is None and features != width:
                misfits[which].append((unit, f"rows of width {features} at step {unit.step}, not {width}"))
            else:
                kept.append((unit, found))
        located[which][:] = kept
    return misfits


def _fed_tokens(which: int, unit: _Unit, context: _Context, ranks: tuple[int, int]) -> list[tuple]:
    """(seq_a, seq_b, position) of the tokens both runs fed in ``unit``'s forward, by position."""
    batch = context.batches[which][(unit.step, unit.rank)]
    tokens = set()
    for seq, position in zip(batch.seqs, batch.positions):
        sequence = context.indexes[which].of(unit.step, unit.rank, seq) if seq != PADDING else None
        both = context.matcher.both_fed(which, ranks, sequence, position) if sequence is not None else None
        if both is not None:
            tokens.add((position, both[0], both[1]))
    return [(a, b, position) for position, a, b in sorted(tokens)]


def _rows_located(located: list[tuple[_Unit, Located]]) -> int:
    return sum(len(found.rows) for _, found in located)


def _as_stored(group: _Group, shapeless: list[list[str]]) -> list[Pair]:
    """A tensor with no row per token on either side (an attention mask over the cache): compared
    as stored, step by step in order, where both sides have as many steps of the same shapes;
    else listed as not aligned (not a divergence by itself)."""
    units_a, units_b = group.units
    if len(units_a) == len(units_b) and all(ua.side.record.shape == ub.side.record.shape
                                            for ua, ub in zip(units_a, units_b)):
        return [Pair(group.name, ua.side, ub.side, kind=group.kind) for ua, ub in zip(units_a, units_b)]
    which = 0 if shapeless[0] else 1
    raise _NotAligned(f"side {'AB'[which]}: {shapeless[which][0]}" if shapeless[which] else "no token metadata")


class _NotAligned(Exception):
    """A group that is neither token-aligned nor comparable as stored: listed, with why, and the
    rows of tokens both runs fed it leaves uncompared (with how many)."""

    def __init__(self, why: str, lost: list[tuple[tuple, int]] | None = None):
        super().__init__(why)
        self.why = why
        self.lost = lost or []


def _left_out(why: str, located: list[list[tuple[_Unit, Located]]], matcher: _Matcher,
              ranks: tuple[int, int]) -> NoReturn:
    """A group one side of which has no rows to pair: raises it as not aligned, the other side's
    rows of tokens both runs fed uncompared."""
    lost: list[tuple[tuple, int]] = []
    for which in (0, 1):
        for _, found in located[which]:
            for sequence, position in zip(found.sequences, found.positions):
                both = matcher.both_fed(which, ranks, sequence, position)
                if both is not None:
                    lost.append(((both[0], both[1], position, why), 1))
    raise _NotAligned(why, sorted(lost, key=lambda item: (item[0][2], item[0][0])))


def _paired_rows(located: list[list[tuple[_Unit, Located]]], matcher: _Matcher,
                 ranks: tuple[int, int]) -> tuple[TokenRows | None, tuple[list, list], list[tuple[tuple, int]]]:
    """Rows of one token on both sides (in order of A's sequence and position), with the (unit,
    row) each comes from, and the tokens both runs fed whose rows are left uncompared (with how
    many). A token claimed more than once (a re-fed token, a recompute in a later step) pairs
    each claim on its own: claim k of A with claim k of B, a side's extra claims with the other
    side's first."""
    claims: tuple[dict, dict] = (defaultdict(list), defaultdict(list))
    for which in (0, 1):
        for i, (_, found) in enumerate(located[which]):
            for row, sequence, position in zip(found.rows, found.sequences, found.positions):
                claims[which][(sequence, position)].append((i, row))
    partners = matcher.partners(*ranks)
    refs: list[TokenRef] = []
    picks: tuple[list, list] = ([], [])
    paired_b: set[tuple[int, int]] = set()
    for (sequence_a, position), hits_a in sorted(claims[0].items()):
        sequence_b = partners.get(sequence_a)
        hits_b = claims[1].get((sequence_b, position)) if sequence_b is not None else None
        if sequence_b is None or not hits_b or not matcher.compared_at(sequence_a, position):
            continue
        paired_b.add((sequence_b, position))
        for k in range(max(len(hits_a), len(hits_b))):
            hit_a, hit_b = hits_a[k if k < len(hits_a) else 0], hits_b[k if k < len(hits_b) else 0]
            refs.append(TokenRef(sequence_a, sequence_b, position, located[0][hit_a[0]][0].step,
                                 located[1][hit_b[0]][0].step))
            picks[0].append(hit_a)
            picks[1].append(hit_b)
    lost: list[tuple[tuple, int]] = []
    for which in (0, 1):
        for (sequence, position), hits in claims[which].items():
            both = matcher.both_fed(which, ranks, sequence, position)
            if both is not None and both[2]:
                lost.append(((both[0], both[1], position,
                              f"sequence {sequence} of side {'AB'[which]} is a fragment without a partner"), len(hits)))
    lost.sort(key=lambda item: (item[0][2], item[0][0]))
    only_a = sum(len(h) for key, h in claims[0].items() if partners.get(key[0]) is None
                 or (partners[key[0]], key[1]) not in paired_b)
    only_b = sum(len(h) for key, h in claims[1].items() if key not in paired_b)
    if not refs:
        return None, picks, lost
    return TokenRows(refs, only_a=only_a, only_b=only_b), picks, lost


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
