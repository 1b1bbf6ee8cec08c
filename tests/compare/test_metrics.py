"""Metric functions: bitwise, ULP, abs/rel, cosine, NaN/inf and ±0 rules."""

import math

import pytest
import torch

from tdiff.compare.metrics import Tolerance, compare_tensors, ordered_bits, ulp_at, ulp_distance


def next_up(t: torch.Tensor, ulps: int = 1) -> torch.Tensor:
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return (t.view(bits) + ulps).view(t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_ulp_in_each_float_dtype(dtype):
    a = torch.linspace(0.5, 2.0, 16).to(dtype)
    b = a.clone()
    b[7] = next_up(a[7:8])[0]
    m = compare_tensors(a, b)
    assert (m.bitwise_equal, m.mismatched, m.max_ulp, m.worst_index) == (False, 1, 1, (7,))
    assert m.max_abs > 0 and m.cosine < 1.0 + 1e-12


def test_equal_tensors():
    a = torch.randn(4, 5)
    m = compare_tensors(a, a.clone())
    assert m.bitwise_equal and m.mismatched == 0 and m.cosine == 1.0 and m.max_ulp == 0


def test_ulp_across_zero_counts_the_signed_zeros():
    pos, neg = torch.tensor([0.0]), torch.tensor([-0.0])
    assert int(ulp_distance(pos, neg)[0]) == 1
    tiny = torch.tensor([1.4e-45])  # the smallest positive subnormal
    assert int(ulp_distance(-tiny, tiny)[0]) == 3  # -tiny, -0, +0, +tiny
    m = compare_tensors(pos, neg)
    assert not m.bitwise_equal and m.max_abs == 0.0 and m.max_ulp == 1


def test_ordered_bits_sort_like_the_floats():
    values = torch.tensor([-math.inf, -3.0, -1e-40, -0.0, 0.0, 1e-40, 2.0, math.inf])
    order = ordered_bits(values)
    assert torch.all(order[1:] > order[:-1])


def test_nan_with_the_same_bits_is_equal_and_nan_against_a_number_is_a_mismatch():
    a = torch.tensor([1.0, math.nan, 3.0])
    assert compare_tensors(a, a.clone()).bitwise_equal
    b = torch.tensor([1.0, 2.0, 3.0])
    m = compare_tensors(a, b)
    assert (m.mismatched, m.nan_mismatch, m.max_abs, m.max_ulp) == (1, 1, 0.0, 0)
    assert not m.within(Tolerance(atol=1e9))


def test_infinities():
    a = torch.tensor([math.inf, 1.0])
    m = compare_tensors(a, torch.tensor([math.inf, 2.0]))
    assert m.mismatched == 1 and m.max_abs == 1.0
    m = compare_tensors(a, torch.tensor([1.0, 1.0]))
    assert m.max_abs == math.inf


def test_tolerance_relaxes_the_verdict():
    a = torch.tensor([1.0, 2.0])
    b = torch.tensor([1.0, 2.0001])
    m = compare_tensors(a, b, Tolerance(atol=1e-3))
    assert m.within(Tolerance(atol=1e-3)) and m.outside_tolerance == 0
    m = compare_tensors(a, b, Tolerance(rtol=1e-6))
    assert not m.within(Tolerance(rtol=1e-6)) and m.outside_tolerance == 1


def test_under_a_tolerance_an_infinity_matches_only_the_same_infinity():
    loose = Tolerance(atol=1.0, rtol=0.5)
    for a, b in [(1.0, math.inf), (-math.inf, math.inf), (math.inf, math.nan), (-math.inf, -1e38)]:
        for x, y in ((a, b), (b, a)):
            m = compare_tensors(torch.tensor([x, 2.0]), torch.tensor([y, 2.0]), loose)
            assert m.outside_tolerance == 1 and not m.within(loose), (x, y)
    for same in (math.inf, -math.inf, math.nan):
        m = compare_tensors(torch.tensor([same, 1.0]), torch.tensor([same, 1.25]), loose)
        assert m.within(loose), same


def test_the_relative_tolerance_scales_with_the_larger_magnitude_on_either_side():
    # |1 - 2| = 1 <= 0.5 * max(1, 2), whichever side holds the 2
    for a, b in ((1.0, 2.0), (2.0, 1.0)):
        assert compare_tensors(torch.tensor([a]), torch.tensor([b]), Tolerance(rtol=0.5)).within(Tolerance(rtol=0.5))
        assert not compare_tensors(torch.tensor([a]), torch.tensor([b]),
                                   Tolerance(rtol=0.49)).within(Tolerance(rtol=0.49))


def test_integers_and_bool():
    m = compare_tensors(torch.tensor([1, 5, 9]), torch.tensor([1, 7, 9]))
    assert (m.mismatched, m.max_ulp, m.max_abs) == (1, 2, 2.0)
    m = compare_tensors(torch.tensor([True, False]), torch.tensor([True, True]))
    assert m.mismatched == 1



@pytest.mark.parametrize("dtype", [torch.int64, torch.uint64])
def test_integers_past_float64s_precision_differ_by_their_exact_difference(dtype):
    """2**60 and 2**60 + 1 are one float64: their difference is still 1, under any tolerance."""
    big = 1 << 60
    a, b = torch.tensor([big, 7], dtype=dtype), torch.tensor([big + 1, 7], dtype=dtype)
    for x, y in ((a, b), (b, a)):
        m = compare_tensors(x, y, Tolerance(atol=0.0))
        assert (m.outside_tolerance, m.max_abs, m.max_ulp) == (1, 1.0, 1)
        assert not m.within(Tolerance(atol=0.0))
        assert compare_tensors(x, y, Tolerance(atol=1.0)).within(Tolerance(atol=1.0))
    signed = torch.tensor([-(1 << 62)]), torch.tensor([1 << 62])   # the difference passes int64
    assert compare_tensors(*signed, Tolerance(atol=0.0)).max_abs == 2.0 ** 63

def test_different_dtypes_are_compared_by_value_without_ulp():
    a = torch.tensor([1.0, 2.5])
    m = compare_tensors(a, a.bfloat16())
    assert m.max_ulp is None and m.max_abs == 0.0


def test_chunked_metrics_equal_one_pass(monkeypatch):
    from tdiff.compare import metrics

    a = torch.randn(10_000)
    b = a + torch.randn(10_000) * 1e-6
    whole = compare_tensors(a, b)
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 999)
    chunked = compare_tensors(a, b)
    assert chunked.mismatched == whole.mismatched and chunked.max_ulp == whole.max_ulp
    assert chunked.worst_index == whole.worst_index and chunked.max_abs == whole.max_abs
    assert chunked.cosine == pytest.approx(whole.cosine, abs=1e-12)
    b[:999] = a[:999]
    a[5] = b[5] = 100.0  # the largest magnitude, in a chunk where nothing differs
    chunked = compare_tensors(a, b)
    assert chunked.max_ulp_at_scale == chunked.max_abs / ulp_at(100.0, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ulp_at_is_the_spacing_of_the_dtypes_values(dtype):
    for x in (0.0, 1e-3, 0.75, 1.0, 3.0, 1000.0):
        v = torch.tensor([x], dtype=dtype)
        assert ulp_at(float(v), dtype) == float(next_up(v).double() - v.double()), x


def test_a_sign_flip_near_zero_is_huge_in_raw_ulp_and_small_at_the_tensors_scale():
    a = torch.tensor([3.0, 1e-9, -2.0])
    b = torch.tensor([3.0, -1e-9, -2.0])
    m = compare_tensors(a, b)
    assert m.max_ulp > 1e9  # every float between -1e-9 and 1e-9
    assert m.max_ulp_at_scale == m.max_abs / ulp_at(3.0, torch.float32) < 0.01
    one_step = a.clone()
    one_step[2] = -next_up(torch.tensor([2.0]))[0]
    assert compare_tensors(a, one_step).max_ulp_at_scale == 1.0  # one step at 2 is one at the scale of 3
    assert compare_tensors(torch.tensor([1, 5]), torch.tensor([1, 9])).max_ulp_at_scale == 4.0
    assert compare_tensors(a, a.double()).max_ulp_at_scale is None  # no ULP across dtypes


def test_complex_tensors_compare_as_real_pairs():
    a = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)
    b = a.clone()
    b[1] = 3 + 5j
    m = compare_tensors(a, b)
    assert m.mismatched == 1 and m.worst_index == (1, 1)
