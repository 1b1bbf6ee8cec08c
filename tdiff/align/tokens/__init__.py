"""Token alignment: runs of different token layouts (an engine's prefill and decode steps, a
trainer's one forward over the finished sequences; ragged, padded or packed) compared token by
token. docs/ALIGNMENT.md.

1. tdiff.align.tokens.sequences follows each run's sequences across its forwards and matches
   them across the runs by token ids;
2. tdiff.align.tokens.rows locates each tensor's rows as (sequence, position);
3. tdiff.align.tokens.pairing.TokenPairing pairs the rows of one token, over a base pairing
   (by name, or by canonical boundary, which unshards first).
"""

from __future__ import annotations

from collections import defaultdict

from tdiff.align.tokens.pairing import TokenAlignment, TokenPairing
from tdiff.store import Dump
from tdiff.store.tokens import TokenBatch


def layouts_differ(a: Dump, b: Dump) -> bool:
    """Whether both dumps carry token metadata and their steps or token layouts differ: then
    pairing by name or boundary per step would compare tensors of different tokens. Ranks that
    hold the same tokens (tensor-parallel replicas) count once."""
    batches_a, batches_b = a.token_batches(), b.token_batches()
    return bool(batches_a and batches_b) and _layout(batches_a) != _layout(batches_b)


def _layout(batches: dict[tuple[int, int], TokenBatch]) -> dict[int, set]:
    steps: dict[int, set] = defaultdict(set)
    for (step, _), batch in batches.items():
        steps[step].add((batch.shape, tuple(batch.input_ids), tuple(batch.positions), tuple(batch.seqs)))
    return steps


__all__ = ["TokenAlignment", "TokenPairing", "layouts_differ"]
