"""Log-prob parity per token: per sequence and rank, how many response tokens' log-probs are
bitwise equal (and, under a tolerance, within it) — slime's "128/128 token/rank log-probs equal".

The log-probs are the token-aligned tensors of kind ``logprobs`` (an explicit
``tdiff.dump("logprobs", ..., positions=...)``; a row is the log-prob of the token at its
position), else, when the runs dumped none, those of kind ``logits`` (equal logits rows give
equal log-probs). A sequence's response starts at its prompt length: ``prompt_lens`` of its
token metadata where given (a recompute), else the first position a decode step fed it (a
forward continuing the sequence with one token). Where neither run says, every compared token
of the sequence is counted (scope "all").

    >>> rows = token_parity(dump_a, dump_b, pairing.pair(dump_a, dump_b), compare.comparisons, EXACT)
    >>> [(r.seq_a, r.rank, r.equal, r.compared) for r in rows]
    [(0, 0, 4, 4), (1, 0, 1, 4)]
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tdiff.align.tokens.sequences import index_sequences
from tdiff.compare.engine import Comparison
from tdiff.compare.metrics import EXACT, Tolerance
from tdiff.compare.pairing import Pair
from tdiff.compare.tokens import differing_rows
from tdiff.store import Dump
from tdiff.report.tokens import find_pair, load_side
from tdiff.store.tokens import PADDING

PARITY_KINDS = ("logprobs", "logits")   # the first kind the runs have token-aligned is counted


@dataclass
class ParityRow:
    """One sequence pair on one rank: its response tokens compared and those equal."""

    tensor: str
    seq_a: int
    seq_b: int
    rank: int                   # side A's rank (side B's is rank_b)
    rank_b: int
    scope: str                  # "response" (positions from the prompt length on) or "all" (length unknown)
    compared: int = 0
    equal: int = 0              # bitwise equal rows
    within: int | None = None   # rows within the tolerance (None: bitwise verdict)

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "seq_a": self.seq_a, "seq_b": self.seq_b, "rank": self.rank,
                "rank_b": self.rank_b, "scope": self.scope, "compared": self.compared, "equal": self.equal,
                "within_tolerance": self.within}


def response_starts(dump: Dump) -> dict[int, int]:
    """Per sequence of the run (tdiff.align.tokens' index): the position its response starts at,
    where the token metadata tells (prompt_lens, else its first decode step)."""
    batches = dump.token_batches()
    index = index_sequences(batches)
    prompt: dict[int, int] = {}
    decoded: dict[int, int] = {}
    seen: set[int] = set()
    for (step, rank), batch in sorted(batches.items(), key=lambda item: (item[0][1], item[0][0])):
        cells: dict[int, list[int]] = defaultdict(list)
        for cell, seq in enumerate(batch.seqs):
            if seq != PADDING:
                cells[seq].append(cell)
        for seq, members in cells.items():
            sequence = index.of(step, rank, seq)
            if sequence is None:
                continue
            if batch.prompt_lens is not None:
                prompt.setdefault(sequence, batch.prompt_lens[seq])
            if sequence in seen and len(members) == 1:
                decoded.setdefault(sequence, batch.positions[members[0]])
            seen.add(sequence)
    return {**decoded, **prompt}


def token_phase(dump: Dump, sequence: int, step: int) -> str:
    """How a run computed a sequence's token in ``step``: "decode" when that step fed the sequence
    one token after an earlier step fed it (a KV-cache step), else "prefill" (its first forward:
    an engine's prefill, a trainer's one forward)."""
    batches = dump.token_batches()
    index = index_sequences(batches)
    first_step, fed = None, 0
    for (at, rank), batch in batches.items():
        members = sum(1 for seq in batch.seqs if seq != PADDING and index.of(at, rank, seq) == sequence)
        if members:
            first_step = at if first_step is None else min(first_step, at)
            fed += members if at == step else 0
    return "decode" if fed == 1 and first_step is not None and first_step < step else "prefill"


def token_parity(a: Dump, b: Dump, pairs: list[Pair], comparisons: list[Comparison],
                 tolerance: Tolerance) -> list[ParityRow]:
    """Rows per (tensor, sequence pair, rank) of the log-prob tensors (``PARITY_KINDS``)."""
    aligned = [c for c in comparisons if c.tokens is not None and c.a is not None and c.b is not None]
    kind = next((k for k in PARITY_KINDS if any(c.boundary_kind == k for c in aligned)), None)
    if kind is None:
        return []
    starts = (response_starts(a), response_starts(b))
    rows: dict[tuple, ParityRow] = {}
    for c in (c for c in aligned if c.boundary_kind == kind):
        pair = find_pair(pairs, c)
        if pair is None or pair.tokens is None or pair.a is None or pair.b is None:
            continue
        ta, tb = load_side(pair.a, a), load_side(pair.b, b)
        bitwise = differing_rows(ta, tb, EXACT)
        beyond = None if tolerance.exact else differing_rows(ta, tb, tolerance)
        rank_a, rank_b = pair.a.record.rank, pair.b.record.rank
        for i, ref in enumerate(pair.tokens.refs):
            start = starts[0].get(ref.seq_a, starts[1].get(ref.seq_b))
            if start is not None and ref.position < start:
                continue
            key = (c.name, ref.seq_a, ref.seq_b, rank_a)
            row = rows.get(key)
            if row is None:
                row = rows[key] = ParityRow(c.name, ref.seq_a, ref.seq_b, rank_a, rank_b,
                                            "all" if start is None else "response",
                                            within=None if beyond is None else 0)
            row.compared += 1
            row.equal += int(not bitwise[i])
            if beyond is not None and row.within is not None:
                row.within += int(not beyond[i])
    return sorted(rows.values(), key=lambda r: (r.tensor, r.rank, r.seq_a))
