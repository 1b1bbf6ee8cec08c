"""The sequences of one run, followed across its forwards, and their partners in the other run.

An engine feeds a sequence's prompt in a prefill, then one token per decode step; a trainer
feeds the finished sequence in one forward. Either way each forward's token metadata
(tdiff.store.tokens.TokenBatch) says, per sequence of that forward, which tokens at which
positions it fed. A forward's sequence continues one of an earlier forward on the same rank
when it has the same request id (or, without ids, the same index in the batch) and starts right
where that one ended; a sequence starting at position 0 is always a new one.

Sequences of two runs are matched by their token ids: two sequences agree when every position
both fed holds the same token (the trainer's holds prompt + response, the engine's lacks the
last sampled token). Among agreeing candidates the one sharing most positions wins, then the
one with the same request id, then the first in order (n samples of one prompt).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from tdiff.store.tokens import PADDING, TokenBatch


@dataclass
class Sequence:
    """One sequence of one run, as fed over its forwards on one rank."""

    index: int                          # this run's own sequence index (order of first appearance)
    rank: int
    seq_id: str | int | None
    tokens: dict[int, int] = field(default_factory=dict)   # position -> token id
    next_position: int = 0

    def agrees_with(self, other: Sequence) -> int:
        """Positions both fed, when they all hold the same token; -1 when one differs."""
        small, large = (self.tokens, other.tokens) if len(self.tokens) <= len(other.tokens) else \
            (other.tokens, self.tokens)
        shared = 0
        for position, token in small.items():
            theirs = large.get(position)
            if theirs is None:
                continue
            if theirs != token:
                return -1
            shared += 1
        return shared


@dataclass
class SequenceIndex:
    """One run's sequences, and which one each forward's sequence is."""

    sequences: list[Sequence]
    of_forward: dict[tuple[int, int], list[int | None]]   # (step, rank) -> per forward sequence: index

    def of(self, step: int, rank: int, seq: int) -> int | None:
        members = self.of_forward.get((step, rank))
        return members[seq] if members is not None and 0 <= seq < len(members) else None

    def on_rank(self, rank: int) -> list[Sequence]:
        return [s for s in self.sequences if s.rank == rank]


def index_sequences(batches: dict[tuple[int, int], TokenBatch]) -> SequenceIndex:
    sequences: list[Sequence] = []
    of_forward: dict[tuple[int, int], list[int | None]] = {}
    open_by_rank: dict[int, dict] = defaultdict(dict)
    for (step, rank), batch in sorted(batches.items(), key=lambda item: (item[0][1], item[0][0])):
        cells: dict[int, list[int]] = defaultdict(list)
        for cell, seq in enumerate(batch.seqs):
            if seq != PADDING:
                cells[seq].append(cell)
        members: list[int | None] = []
        open_sequences = open_by_rank[rank]
        for seq in range(batch.sequences):
            if not cells.get(seq):
                members.append(None)   # a row of padding only
                continue
            seq_id = batch.seq_ids[seq] if batch.seq_ids is not None else None
            key = ("id", seq_id) if seq_id is not None else ("row", seq)
            positions = [batch.positions[c] for c in cells[seq]]
            current = open_sequences.get(key)
            first = min(positions)
            if first == 0 or current is None or current.next_position != first:
                current = Sequence(index=len(sequences), rank=rank, seq_id=seq_id)
                sequences.append(current)
                open_sequences[key] = current
            for cell, position in zip(cells[seq], positions):
                current.tokens.setdefault(position, batch.input_ids[cell])
            current.next_position = max(current.next_position, max(positions) + 1)
            members.append(current.index)
        of_forward[(step, rank)] = members
    return SequenceIndex(sequences, of_forward)


def match_sequences(a: list[Sequence], b: list[Sequence]) -> dict[int, int]:
    """Side A's sequence index -> its partner's on side B (see the module's docstring)."""
    by_start: dict[tuple, list[Sequence]] = defaultdict(list)
    for sequence in b:
        by_start[_start(sequence)].append(sequence)
    taken: set[int] = set()
    matched: dict[int, int] = {}
    for sequence in a:
        candidates = by_start[_start(sequence)] + by_start[_MID] if 0 in sequence.tokens else b
        best, best_key = None, None
        for candidate in candidates:
            if candidate.index in taken:
                continue
            shared = sequence.agrees_with(candidate)
            if shared <= 0:
                continue
            key = (shared, sequence.seq_id is not None and candidate.seq_id == sequence.seq_id, -candidate.index)
            if best_key is None or key > best_key:
                best, best_key = candidate, key
        if best is not None:
            taken.add(best.index)
            matched[sequence.index] = best.index
    return matched


_MID = ("mid",)   # a sequence whose first forward was not captured (--steps)


def _start(sequence: Sequence) -> tuple:
    """Where a sequence starts, to find candidates quickly: its first token, when it has position 0."""
    return (0, sequence.tokens[0]) if 0 in sequence.tokens else _MID
