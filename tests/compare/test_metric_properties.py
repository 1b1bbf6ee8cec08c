"""Property tests for the ULP and bitwise rules (hypothesis)."""

import math
import struct

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tdiff.compare.metrics import Tolerance, compare_tensors, ulp_distance

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


any32 = st.floats(width=32)  # NaN and both infinities included
tolerances = st.builds(Tolerance, atol=st.floats(0, 10), rtol=st.floats(0, 10))


@settings(max_examples=300)
@given(st.lists(st.tuples(any32, any32), min_size=1, max_size=16), tolerances)
@example([(1.0, math.inf)], Tolerance(atol=0.0, rtol=1e-3))
@example([(1.0, 2.0)], Tolerance(atol=0.0, rtol=0.6))
def test_swapping_a_and_b_never_changes_a_verdict_under_a_tolerance(pairs, tolerance):
    a = torch.tensor([x for x, _ in pairs], dtype=torch.float32)
    b = torch.tensor([y for _, y in pairs], dtype=torch.float32)
    ab, ba = compare_tensors(a, b, tolerance), compare_tensors(b, a, tolerance)
    assert ab.outside_tolerance == ba.outside_tolerance and ab.within(tolerance) == ba.within(tolerance)


@settings(max_examples=300)
@given(any32, any32, tolerances)
@example(1.0, math.inf, Tolerance(atol=0.0, rtol=1e-3))
@example(-math.inf, math.inf, Tolerance(atol=1.0, rtol=1.0))
def test_a_non_finite_value_matches_only_the_same_value_under_any_tolerance(x, y, tolerance):
    if math.isfinite(x) and math.isfinite(y):
        return
    same = (math.isnan(x) and math.isnan(y)) or x == y
    for a, b in ((x, y), (y, x)):
        assert compare_tensors(f32(a), f32(b), tolerance).within(tolerance) == same, (a, b)
