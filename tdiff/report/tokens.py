"""Error per token of one pair of tensors: where along the sequence two runs part.

The token axis is dim 0 for tensors in the aligned [tokens, ...] layout, 1-D tensors and 2-D
[tokens, hidden] tensors; dim 1 for [batch, seq, ...] tensors (3-D and more) and for a [1, seq]
row (one sequence of per-token values). Every other dim is reduced: per token, the largest
absolute difference and the number of elements whose bits differ (and, under a tolerance, of
those outside it: a token differs when one of its elements fails the verdict's rule).

    >>> errors = token_errors("x", torch.zeros(1, 3, 2), torch.tensor([[[0., 0.], [0., .5], [0., 0.]]]), 1)
    >>> errors.max_abs, errors.mismatched, errors.worst
    ([0.0, 0.5, 0.0], [0, 1, 0], 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tdiff.compare.engine import Comparison
from tdiff.compare.metrics import CHUNK_ELEMENTS, EXACT, Tolerance, beyond_tolerance, bits_of, integer_abs_difference, \
    json_number
from tdiff.compare.pairing import Pair, Side
from tdiff.compare.tokens import TokenRef
from tdiff.store import Dump


@dataclass
class TokenErrors:
    name: str
    axis: int
    shape: list[int]
    max_abs: list[float]    # per token; NaN against a number counts as a mismatch, not a difference
    mismatched: list[int]   # per token: elements whose bits differ
    per_token: int          # elements per token
    outside: list[int] | None = None   # per token: elements outside the tolerance (None: bitwise)
    refs: list[TokenRef] | None = None  # per token of a token-aligned pair: its sequences and position

    @property
    def differing(self) -> list[int]:
        """Per token, the elements that fail the verdict's rule (bitwise, or the tolerance)."""
        return self.mismatched if self.outside is None else self.outside

    @property
    def tokens_differ(self) -> int:
        return sum(1 for n in self.differing if n)

    @property
    def worst(self) -> int | None:
        """The token with the largest difference, the first of equals as compare's worst element is
        (the first differing one when all are 0)."""
        if not self.tokens_differ:
            return None
        differing = self.differing
        best = max(range(len(self.max_abs)), key=lambda i: (differing[i] > 0, self.max_abs[i]))
        return best if self.max_abs[best] > 0 else next(i for i, n in enumerate(differing) if n)

    def label(self, token: int) -> str:
        """A token as the reader knows it: its position and sequences when aligned, else its index."""
        if self.refs is None:
            return f"token {token}"
        ref = self.refs[token]
        return f"position {ref.position} of sequence {ref.seq_a} (A) / {ref.seq_b} (B)"

    def to_json(self) -> dict:
        return {"name": self.name, "axis": self.axis, "shape": self.shape, "per_token": self.per_token,
                "tokens_differ": self.tokens_differ, "worst": self.worst,
                "max_abs": [json_number(v) for v in self.max_abs], "mismatched": self.mismatched,
                "outside_tolerance": self.differing,
                "tokens": [ref.to_json() for ref in self.refs] if self.refs is not None else None}


def token_axis(shape: tuple[int, ...], *, aligned: bool = False) -> int | None:
    if not shape:
        return None
    if aligned or len(shape) == 1:
        return 0
    if len(shape) == 2:
        return 1 if shape[0] == 1 and shape[1] > 1 else 0
    return 1


def token_errors(name: str, a: torch.Tensor, b: torch.Tensor, axis: int,
                 tolerance: Tolerance = EXACT) -> TokenErrors:
    """Per-token error of two tensors of one shape, ``axis`` being the token dim."""
    tolerance = tolerance.at_scale(a, b)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    shape = list(a.shape)
    a, b = a.movedim(axis, 0), b.movedim(axis, 0)
    tokens = a.shape[0]
    per_token = a[0].numel() if tokens else 0
    rows = max(1, CHUNK_ELEMENTS // max(per_token, 1))
    max_abs: list[float] = []
    mismatched: list[int] = []
    outside: list[int] | None = None if tolerance.exact else []
    for start in range(0, tokens, rows):
        ca, cb = a[start:start + rows].reshape(-1, per_token), b[start:start + rows].reshape(-1, per_token)
        abs_diff, differs = _difference(ca, cb)
        mismatched += differs.sum(dim=1).tolist()
        max_abs += abs_diff.amax(dim=1).tolist() if abs_diff is not None else [math.nan] * len(ca)
        if outside is not None:
            outside += (_beyond(ca, cb, tolerance) if abs_diff is not None else differs).sum(dim=1).tolist()
    return TokenErrors(name, axis, shape, max_abs, mismatched, per_token, outside)


def _beyond(a: torch.Tensor, b: torch.Tensor, tolerance: Tolerance) -> torch.Tensor:
    return torch.from_numpy(beyond_tolerance(_numbers(a), _numbers(b), tolerance))


def _numbers(t: torch.Tensor):
    """Floats in float64; integers as they are (beyond_tolerance differences them exactly)."""
    return t.to(torch.float64).numpy() if t.is_floating_point() else t.numpy()


def _difference(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """|a - b| (0 where either is NaN) and where the elements differ, both [rows, per_token]."""
    try:
        af, bf = a.to(torch.float64), b.to(torch.float64)
    except (RuntimeError, TypeError):  # bit-container dtypes have no numeric value
        return None, bits_of(a).ne(bits_of(b)).view(a.shape)
    if a.dtype == b.dtype:
        differs = bits_of(a).ne(bits_of(b)).view(a.shape)
    else:
        differs = af.ne(bf) & ~(af.isnan() & bf.isnan())
    if a.dtype == b.dtype and not a.is_floating_point():  # float64 would lose differences past 2**53
        abs_diff = torch.from_numpy(integer_abs_difference(a.numpy(), b.numpy())).view(a.shape)
    else:
        abs_diff = (af - bf).abs()
    abs_diff = abs_diff.masked_fill(abs_diff.isnan() | ~differs, 0.0)
    return abs_diff, differs


def culprit_token_errors(a: Dump, b: Dump, culprit: Comparison, pairs: list[Pair],
                         tolerance: Tolerance = EXACT) -> tuple[TokenErrors | None, str | None]:
    """The culprit's per-token error, or None and why there is none; ``pairs`` are the pairing's
    pairs of ``a`` and ``b`` again (for the tensors' data)."""
    if culprit.a is None or culprit.b is None:
        return None, f"captured on side {'A' if culprit.b is None else 'B'} only"
    if culprit.status == "shape_mismatch":
        return None, f"the shapes differ ({culprit.reason})"
    pair = find_pair(pairs, culprit)
    if pair is None or pair.a is None or pair.b is None:
        return None, "the tensor is not found again in the dumps"
    if not all(side.load is not None or side.record.has_data for side in (pair.a, pair.b)):
        return None, "captured in stats mode (no tensor data); capture it with --mode full"
    ta, tb = load_side(pair.a, a), load_side(pair.b, b)
    if ta.shape != tb.shape:
        return None, f"the shapes differ ({list(ta.shape)} vs {list(tb.shape)})"
    if ta.numel() == 0:
        return None, "the tensor is empty"
    aligned = bool(pair.a.plan or pair.b.plan) or culprit.name != culprit.record.name
    axis = token_axis(tuple(ta.shape), aligned=aligned)
    if axis is None:
        return None, "a scalar has no token axis"
    errors = token_errors(culprit.name, ta, tb, axis, tolerance)
    if pair.tokens is not None and axis == 0 and len(pair.tokens.refs) == ta.shape[0]:
        errors.refs = pair.tokens.refs
    return errors, None


def find_pair(pairs: list[Pair], c: Comparison) -> Pair | None:
    """The pair a comparison was made of, among the pairing's pairs made again."""
    return next((p for p in pairs if p.name == c.name and p.a and p.b and p.record.pair_key == c.record.pair_key),
                None)


def load_side(side: Side, dump: Dump) -> torch.Tensor:
    return side.load() if side.load is not None else dump.load(side.record)
