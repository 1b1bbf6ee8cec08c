"""Verdicts per token: of a pair whose rows are tokens (aligned by tdiff.align.tokens), how many
tokens were compared, how many are equal, and the first that is not.

A token is equal when every element of its row passes the verdict's rule (equal bits, or
within the tolerance); the first differing token is the one at the lowest position (then the
lowest sequence index of side A): where along the sequences the runs part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tdiff.compare.metrics import CHUNK_ELEMENTS, Tolerance, beyond_tolerance, bits_of


@dataclass(frozen=True)
class TokenRef:
    """One token of both runs: each side's own sequence index, its position (0-based from the
    sequence start), and the step (forward) each side computed it in."""

    seq_a: int
    seq_b: int
    position: int
    step_a: int
    step_b: int

    def to_json(self) -> dict:
        return {"seq_a": self.seq_a, "seq_b": self.seq_b, "position": self.position,
                "step_a": self.step_a, "step_b": self.step_b}

    @classmethod
    def from_json(cls, data: dict) -> TokenRef:
        return cls(seq_a=data["seq_a"], seq_b=data["seq_b"], position=data["position"], step_a=data["step_a"],
                   step_b=data["step_b"])


@dataclass(frozen=True)
class TokenRows:
    """The tokens a pair's rows stand for, and the tokens each side had without a partner."""

    refs: list[TokenRef]
    only_a: int = 0
    only_b: int = 0


@dataclass(frozen=True)
class TokenVerdict:
    compared: int
    equal: int
    first_differing: TokenRef | None
    only_a: int = 0     # tokens of this tensor that side A has and B lacks (not compared)
    only_b: int = 0

    def to_json(self) -> dict:
        first = self.first_differing
        return {"compared": self.compared, "equal": self.equal,
                "first_differing": first.to_json() if first is not None else None,
                "only_a": self.only_a, "only_b": self.only_b}

    @classmethod
    def from_json(cls, data: dict) -> TokenVerdict:
        first = data["first_differing"]
        return cls(compared=data["compared"], equal=data["equal"],
                   first_differing=TokenRef.from_json(first) if first is not None else None,
                   only_a=data["only_a"], only_b=data["only_b"])


def token_verdict(differs: np.ndarray, tokens: TokenRows) -> TokenVerdict:
    """The verdict of a pair whose rows are ``tokens``, given the rows that differ
    (:func:`differing_rows`, or tdiff.compare.metrics.measure's ``rows_differ``)."""
    differing = [tokens.refs[i] for i in np.flatnonzero(differs)]
    first = min(differing, key=lambda t: (t.position, t.seq_a)) if differing else None
    return TokenVerdict(compared=len(tokens.refs), equal=len(tokens.refs) - len(differing), first_differing=first,
                        only_a=tokens.only_a, only_b=tokens.only_b)


def differing_rows(a: torch.Tensor, b: torch.Tensor, tolerance: Tolerance) -> np.ndarray:
    """Per row (dim 0): whether an element of it fails the verdict's rule."""
    tolerance = tolerance.at_scale(a, b)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    rows = a.shape[0]
    width = max(1, a[0].numel()) if rows else 1
    step = max(1, CHUNK_ELEMENTS // width)
    out = np.zeros(rows, dtype=bool)
    for start in range(0, rows, step):
        ca, cb = a[start:start + step].reshape(-1, width), b[start:start + step].reshape(-1, width)
        if tolerance.exact and ca.dtype != cb.dtype:
            out[start:start + len(ca)] = True   # tensors of two dtypes are never bitwise equal
        elif tolerance.exact:
            out[start:start + len(ca)] = (bits_of(ca.contiguous()) != bits_of(cb.contiguous())) \
                .view(ca.shape).any(dim=1).numpy()
        else:
            beyond = beyond_tolerance(_numbers(ca), _numbers(cb), tolerance)
            out[start:start + len(ca)] = beyond.any(axis=1)
    return out


def _numbers(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy() if t.is_floating_point() else t.numpy()
