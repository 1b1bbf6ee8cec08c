"""Per-token error: the token axis, and the per-token maxima and counts."""

import math

import torch

import tdiff.report.tokens as tokens_module
from tdiff.report.tokens import token_axis, token_errors


def test_token_axis_by_layout():
    assert token_axis((24, 64)) == 0            # [tokens, hidden]
    assert token_axis((1, 23)) == 1             # one sequence of per-token values
    assert token_axis((2, 24, 64)) == 1         # [batch, seq, hidden]
    assert token_axis((2, 24, 4, 16)) == 1
    assert token_axis((7,)) == 0
    assert token_axis((2, 24, 64), aligned=True) == 0
    assert token_axis(()) is None


def test_per_token_maxima_and_counts(monkeypatch):
    monkeypatch.setattr(tokens_module, "CHUNK_ELEMENTS", 8)  # several chunks of tokens
    a = torch.zeros(2, 5, 4)
    b = a.clone()
    b[0, 1, 2] = 0.25
    b[1, 1, 0] = -0.5
    b[1, 3, 3] = float("nan")
    b[0, 4, 0] = -0.0                            # the same value, other bits
    errors = token_errors("x", a, b, 1)
    assert errors.shape == [2, 5, 4] and errors.per_token == 8
    assert errors.mismatched == [0, 2, 0, 1, 1]
    assert errors.max_abs == [0.0, 0.5, 0.0, 0.0, 0.0]
    assert errors.worst == 1 and errors.tokens_differ == 3


def test_bits_only_differences_and_dtype_mismatch():
    a = torch.tensor([[1.0, 2.0], [0.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16)
    b = a.clone()
    b[1, 0] = -0.0                  # other bits, no difference in value
    b[2, 1] = float("nan")          # a NaN against a number: a mismatch without a difference
    errors = token_errors("y", a, b, 0)
    assert errors.mismatched == [0, 1, 1] and errors.max_abs == [0.0, 0.0, 0.0] and errors.worst == 1
    mixed = token_errors("z", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5], dtype=torch.float64), 0)
    assert mixed.mismatched == [0, 1] and mixed.max_abs == [0.0, 0.5]
    assert not any(math.isnan(v) for v in mixed.max_abs)


def test_integers_past_float64s_precision_keep_their_difference_per_token():
    """As in compare (tests/compare/test_metrics.py): 2**60 and 2**60 + 1 differ by 1."""
    from tdiff.compare.metrics import Tolerance

    big = 1 << 60
    a = torch.tensor([[big], [big]])
    b = torch.tensor([[big], [big + 1]])
    errors = token_errors("ids", a, b, 0, Tolerance(atol=0.0))
    assert errors.max_abs == [0.0, 1.0] and errors.mismatched == [0, 1] and errors.differing == [0, 1]
