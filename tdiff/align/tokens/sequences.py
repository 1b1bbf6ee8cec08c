"""The sequences of one run, followed across its forwards, and their partners in the other run.

An engine feeds a sequence's prompt in a prefill, then one token per decode step; a trainer
feeds the finished sequence in one forward. Either way each forward's token metadata
(tdiff.store.tokens.TokenBatch) says, per sequence of that forward, which tokens at which
positions it fed. A forward's sequence continues one of an earlier forward on the same rank
when it has the same request id (or, without ids, the same index in the batch) and starts right
where that one ended; with a request id also when it fills a gap of it (decode steps recorded out
of order) or feeds again positions it holds with the same tokens (a recompute: each claim is
compared on its own). Otherwise, and always at position 0 without an id, it is a new one; n
samples of one request id fed in one forward are n sequences.

Sequences of two runs are matched by request id where both runs give it, else by their token
ids, globally and the same from either side (:func:`match_sequences`): the pairs share the
longest prefixes in total (the trainer's sequence holds prompt + response, the engine's lacks the
last sampled token); sequences that part at a sampled token still pair, up to where they part.
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
    """Each run's sequences, followed across its forwards on each rank (module docstring)."""
    sequences: list[Sequence] = []
    of_forward: dict[tuple[int, int], list[int | None]] = {}
    open_by_rank: dict[int, dict[tuple, list[Sequence]]] = defaultdict(lambda: defaultdict(list))
    for (step, rank), batch in sorted(batches.items(), key=lambda item: (item[0][1], item[0][0])):
        cells: dict[int, list[int]] = defaultdict(list)
        for cell, seq in enumerate(batch.seqs):
            if seq != PADDING:
                cells[seq].append(cell)
        members: list[int | None] = []
        open_sequences = open_by_rank[rank]
        used: set[int] = set()   # sequences this forward already feeds: n samples of one id stay apart
        for seq in range(batch.sequences):
            if not cells.get(seq):
                members.append(None)   # a row of padding only
                continue
            seq_id = batch.seq_ids[seq] if batch.seq_ids is not None else None
            key = ("id", seq_id) if seq_id is not None else ("row", seq)
            fed = {batch.positions[c]: batch.input_ids[c] for c in cells[seq]}
            current = _continued(open_sequences[key], fed, used, by_id=seq_id is not None)
            if current is None:
                current = Sequence(index=len(sequences), rank=rank, seq_id=seq_id)
                sequences.append(current)
                open_sequences[key].append(current)
            used.add(current.index)
            for position, token in fed.items():
                current.tokens.setdefault(position, token)
            current.next_position = max(current.next_position, max(fed) + 1)
            members.append(current.index)
        of_forward[(step, rank)] = members
    return SequenceIndex(sequences, of_forward)


def _continued(candidates: list[Sequence], fed: dict[int, int], used: set[int], *, by_id: bool) -> Sequence | None:
    """The earlier sequence of the same key (request id, else batch row) that these tokens continue:
    one that ends where they start; with a request id also one they fill a gap of (decode steps
    recorded out of order) or recompute (positions it holds, fed again with the same tokens).
    None: a new sequence."""
    free = [c for c in candidates if c.index not in used]
    first = min(fed)
    for candidate in free:
        if candidate.next_position == first and first > 0:
            return candidate
    if not by_id:
        return None
    for candidate in free:
        if first > 0 and not fed.keys() & candidate.tokens.keys():
            return candidate
    for candidate in free:
        held = fed.keys() & candidate.tokens.keys()
        if held and all(candidate.tokens[p] == fed[p] for p in held):
            return candidate
    return None


def match_sequences(a: list[Sequence], b: list[Sequence]) -> dict[int, int]:
    """Side A's sequence index -> its partner's on side B (see the module's docstring).

    Global and symmetric: swapping the sides gives the same pairs. Sequences whose request id the
    other side gives too pair within that id (n samples of one prompt: by their tokens); the rest
    by tokens. By tokens, the pairs maximise the total shared prefix, found deepest first on the
    sequences' token trie (optimal for that sum): a short sample (prompt + EOS) never takes a
    longer one's partner. Ties go to the same request id, then to the sequences' order of first
    appearance, k-th with k-th. A sequence without position 0 (its first forwards not captured, a
    fragment) pairs last, with the one agreeing with it on most positions."""
    shared_ids = {s.seq_id for s in a if s.seq_id is not None} & {s.seq_id for s in b if s.seq_id is not None}
    order = ({s.index: k for k, s in enumerate(a)}, {s.index: k for k, s in enumerate(b)})
    pairs: list[tuple[Sequence, Sequence]] = []
    groups: dict[object, tuple[list[Sequence], list[Sequence]]] = defaultdict(lambda: ([], []))
    for which, side in enumerate((a, b)):
        for sequence in side:
            groups[sequence.seq_id if sequence.seq_id in shared_ids else None][which].append(sequence)
    left: tuple[list[Sequence], list[Sequence]] = ([], [])
    for seq_id, (group_a, group_b) in groups.items():
        rooted = [[s for s in g if 0 in s.tokens] for g in (group_a, group_b)]
        unpaired = _by_prefix(rooted[0], rooted[1], order, pairs, same_request=seq_id is not None)
        for which, group in enumerate((group_a, group_b)):
            left[which].extend(unpaired[which] + [s for s in group if 0 not in s.tokens])
    _by_agreement(left[0], left[1], order, pairs)
    return {x.index: y.index for x, y in pairs}


def _by_prefix(a: list[Sequence], b: list[Sequence], order: tuple[dict, dict],
               pairs: list[tuple[Sequence, Sequence]], *, same_request: bool) -> tuple[list, list]:
    """Pair sequences starting at position 0 deepest first on their token trie; the unpaired.
    Within one request (``same_request``) even sequences parting at position 0 pair."""
    # a trie node: (depth, members of A, members of B); children are visited before their parent
    # pairs what they left, so the stack holds (node, children visited)
    stack: list[tuple[int, list[Sequence], list[Sequence], list | None]] = [(0, a, b, None)]
    results: list[tuple[list, list]] = []
    while stack:
        depth, members_a, members_b, children = stack.pop()
        if children is None:
            ending: tuple[list, list] = ([], [])
            by_token: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
            for which, members in enumerate((members_a, members_b)):
                for sequence in members:
                    token = sequence.tokens.get(depth)
                    (ending if token is None else by_token[token])[which].append(sequence)
            branches = [branch for branch in by_token.values() if branch[0] and branch[1]]
            # a branch one side lacks pairs nothing below: its members go up as they are
            for branch in by_token.values():
                if not (branch[0] and branch[1]):
                    for which in (0, 1):
                        ending[which].extend(branch[which])
            stack.append((depth, ending[0], ending[1], [len(branches)]))
            for branch in branches:
                stack.append((depth + 1, branch[0], branch[1], None))
            continue
        up_a, up_b = list(members_a), list(members_b)
        for _ in range(children[0]):
            left_a, left_b = results.pop()
            up_a += left_a
            up_b += left_b
        if depth > 0 or same_request:
            up_a, up_b = _pair_in_order(up_a, up_b, order, pairs)
        results.append((up_a, up_b))
    return results[0] if results else ([], [])


def _pair_in_order(a: list[Sequence], b: list[Sequence], order: tuple[dict, dict],
                   pairs: list[tuple[Sequence, Sequence]]) -> tuple[list, list]:
    """Pair sequences sharing the same prefix: same request id first, then k-th with k-th in
    order of first appearance; the unpaired."""
    a = sorted(a, key=lambda s: order[0][s.index])
    b = sorted(b, key=lambda s: order[1][s.index])
    by_id: dict[object, list[Sequence]] = defaultdict(list)
    for sequence in b:
        if sequence.seq_id is not None:
            by_id[sequence.seq_id].append(sequence)
    taken: set[int] = set()
    rest_a = []
    for sequence in a:
        partners = by_id.get(sequence.seq_id) if sequence.seq_id is not None else None
        if partners:
            partner = partners.pop(0)
            taken.add(partner.index)
            pairs.append((sequence, partner))
        else:
            rest_a.append(sequence)
    rest_b = [s for s in b if s.index not in taken]
    for x, y in zip(rest_a, rest_b):
        pairs.append((x, y))
    n = min(len(rest_a), len(rest_b))
    return rest_a[n:], rest_b[n:]


def _by_agreement(a: list[Sequence], b: list[Sequence], order: tuple[dict, dict],
                  pairs: list[tuple[Sequence, Sequence]]) -> None:
    """Pair what is left where one of a pair lacks position 0: most positions agreeing first,
    then the earliest in order (a rule the same from either side)."""
    candidates = []
    for x in a:
        for y in b:
            if 0 in x.tokens and 0 in y.tokens:
                continue
            shared = x.agrees_with(y)
            if shared > 0:
                ka, kb = order[0][x.index], order[1][y.index]
                candidates.append((-shared, min(ka, kb), max(ka, kb), ka, x, y))
    taken_a: set[int] = set()
    taken_b: set[int] = set()
    for *_, x, y in sorted(candidates, key=lambda c: c[:4]):
        if x.index not in taken_a and y.index not in taken_b:
            taken_a.add(x.index)
            taken_b.add(y.index)
            pairs.append((x, y))
