"""Property tests for the ULP and bitwise rules (hypothesis)."""

import math
import struct

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tdiff.compare.metrics import compare_tensors, ulp_distance

finite32 = st.floats(width=32, allow_nan=False)
bf16_bits = st.integers(min_value=-(1 << 15), max_value=(1 << 15) - 1)


def f32(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32)


def bits32(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(ulp_distance(a, b)[0])


@given(finite32, finite32)
def test_ulp_is_symmetric(a, b):
    assert ulp(f32(a), f32(b)) == ulp(f32(b), f32(a))


@given(finite32, finite32)
def test_ulp_is_zero_exactly_when_the_bits_are_equal(a, b):
    assert (ulp(f32(a), f32(b)) == 0) == (bits32(a) == bits32(b))  # so +0 and -0 are 1 apart


@given(bf16_bits, bf16_bits)
def test_bfloat16_ulp_zero_iff_bits_equal_and_symmetric(a, b):
    ta = torch.tensor([a], dtype=torch.int16).view(torch.bfloat16)
    tb = torch.tensor([b], dtype=torch.int16).view(torch.bfloat16)
    if torch.isnan(ta).any() or torch.isnan(tb).any():
        return  # NaN has no ULP distance: compare_tensors counts it as nan_mismatch instead
    assert (ulp(ta, tb) == 0) == (a == b)
    assert ulp(ta, tb) == ulp(tb, ta)


@given(finite32, finite32, finite32)
def test_ulp_is_monotone_in_the_true_difference_on_one_side(a, b1, b2):
    if not ((b1 >= a and b2 >= a) or (b1 <= a and b2 <= a)):
        return  # across a the spacing differs on each side: ULP counts are not comparable
    near, far = sorted([b1, b2], key=lambda b: abs(float(b) - float(a)))
    if abs(float(far) - float(a)) > abs(float(near) - float(a)):
        assert ulp(f32(a), f32(near)) <= ulp(f32(a), f32(far))


@settings(max_examples=200)
@given(st.lists(st.floats(width=32), min_size=1, max_size=32), st.data())
def test_compare_tensors_agrees_with_bitwise_equality_and_is_symmetric(values, data):
    a = torch.tensor(values, dtype=torch.float32)
    b = a.clone()
    flips = data.draw(st.lists(st.integers(0, len(values) - 1), max_size=3))
    for i in flips:
        b.view(torch.int32)[i] ^= 1
    ab, ba = compare_tensors(a, b), compare_tensors(b, a)
    differing = int((a.view(torch.int32) != b.view(torch.int32)).sum())
    assert ab.bitwise_equal == (differing == 0) == ba.bitwise_equal
    assert ab.mismatched == differing == ba.mismatched
    assert ab.max_ulp == ba.max_ulp and ab.nan_mismatch == ba.nan_mismatch
    assert (ab.max_abs == ba.max_abs) or (math.isnan(ab.max_abs) and math.isnan(ba.max_abs))
