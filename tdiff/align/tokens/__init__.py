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

from tdiff.align.tokens.pairing import TokenAlignment, TokenPairing
from tdiff.store import Dump


def layouts_differ(a: Dump, b: Dump) -> bool:
    """Whether both dumps carry token metadata and their steps or token layouts differ: then
    pairing by name or boundary per step would compare tensors of different tokens."""
    batches_a, batches_b = a.token_batches(), b.token_batches()
    if not batches_a or not batches_b:
        return False
    if batches_a.keys() != batches_b.keys():
        return True
    return any((x.shape, x.input_ids, x.positions, x.seqs) != (y.shape, y.input_ids, y.positions, y.seqs)
               for x, y in ((batches_a[k], batches_b[k]) for k in batches_a))


__all__ = ["TokenAlignment", "TokenPairing", "layouts_differ"]
