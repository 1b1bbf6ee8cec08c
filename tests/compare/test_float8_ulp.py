"""ULP distance of float8 tensors, built from explicit bit patterns and checked against a reference
computed here with plain Python ints: symmetric, -0 one ULP below +0, NaN left out."""

import json
import math
import random

import pytest
import torch

import tdiff
from tdiff.compare.metrics import compare_tensors, ulp_at, ulp_distance
from tests.helpers import tdiff_cli

# every float8 dtype this torch offers, but float8_e8m0fnu: it has no sign bit (a power-of-two
# scale), and tdiff defines no ULP distance for it
FLOAT8 = [getattr(torch, name) for name in dir(torch)
          if name.startswith("float8_") and name != "float8_e8m0fnu" and isinstance(getattr(torch, name), torch.dtype)]


def of_patterns(patterns: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.uint8).view(dtype)


def value_of(pattern: int, dtype: torch.dtype) -> float:
    return float(of_patterns([pattern], dtype).to(torch.float64)[0])


def ordinal(pattern: int, dtype: torch.dtype) -> int:
    """Sign-magnitude order: the magnitude, negated below zero, with a -0 step where 0x80 is -0
    (the fnuz types spend it on their one NaN)."""
    magnitude = pattern & 0x7F
    if pattern < 0x80:
        return magnitude
    return -magnitude - (0 if math.isnan(value_of(0x80, dtype)) else 1)


def reference_ulp(a: int, b: int, dtype: torch.dtype) -> int:
    return abs(ordinal(a, dtype) - ordinal(b, dtype))


def max_ulp_both_orders(a: list[int], b: list[int], dtype: torch.dtype) -> int:
    ta, tb = of_patterns(a, dtype), of_patterns(b, dtype)
    forward, backward = compare_tensors(ta, tb).max_ulp, compare_tensors(tb, ta).max_ulp
    assert forward == backward, (a, b, forward, backward)
    assert ulp_distance(ta, tb).tolist() == ulp_distance(tb, ta).tolist()
    return forward


def largest_finite_pattern(dtype: torch.dtype) -> int:
    return max(p for p in range(0x80) if value_of(p, dtype) == torch.finfo(dtype).max)


def test_every_float8_dtype_is_covered():
    assert {torch.float8_e4m3fn, torch.float8_e5m2} <= set(FLOAT8)


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_adjacent_patterns_are_one_ulp_apart_in_both_orders(dtype):
    for low in (0x01, 0x30, 0x40, largest_finite_pattern(dtype) - 1):
        for sign in (0x00, 0x80):
            assert max_ulp_both_orders([sign | low], [sign | (low + 1)], dtype) == 1, (hex(low), sign)


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_across_zero(dtype):
    smallest_subnormals = max_ulp_both_orders([0x81], [0x01], dtype)
    if math.isnan(value_of(0x80, dtype)):  # fnuz: no -0, so -s, +0, +s
        assert smallest_subnormals == 2
    else:  # -s, -0, +0, +s
        assert max_ulp_both_orders([0x80], [0x00], dtype) == 1
        assert smallest_subnormals == 3
    assert smallest_subnormals == reference_ulp(0x81, 0x01, dtype)


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_the_largest_finite_value_against_its_neighbours(dtype):
    top = largest_finite_pattern(dtype)
    assert max_ulp_both_orders([top, 0x80 | top], [top - 1, 0x80 | (top - 1)], dtype) == 1
    assert max_ulp_both_orders([top], [0x80 | top], dtype) == reference_ulp(top, 0x80 | top, dtype)
    if math.isinf(value_of(top + 1, dtype)):  # e5m2: the next pattern is +inf
        assert max_ulp_both_orders([top + 1], [top], dtype) == 1
    # one rounding step at the tensor's largest magnitude
    m = compare_tensors(of_patterns([top], dtype), of_patterns([top - 1], dtype))
    assert m.max_ulp_at_scale == 1.0


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_random_pairs_match_the_reference(dtype):
    rng = random.Random(str(dtype))
    numbers = [p for p in range(256) if not math.isnan(value_of(p, dtype))]
    pairs = [(rng.choice(numbers), rng.choice(numbers)) for _ in range(300)]
    for a, b in pairs:
        assert max_ulp_both_orders([a], [b], dtype) == reference_ulp(a, b, dtype), (hex(a), hex(b))
    a, b = [p for p, _ in pairs], [q for _, q in pairs]
    assert max_ulp_both_orders(a, b, dtype) == max(reference_ulp(p, q, dtype) for p, q in pairs)
    assert ulp_distance(of_patterns(a, dtype), of_patterns(b, dtype)).tolist() == \
        [reference_ulp(p, q, dtype) for p, q in pairs]


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_nan_is_left_out_of_max_ulp(dtype):
    nan = next(p for p in range(256) if math.isnan(value_of(p, dtype)))
    ta, tb = of_patterns([nan, 0x30], dtype), of_patterns([0x01, 0x31], dtype)
    for x, y in ((ta, tb), (tb, ta)):
        m = compare_tensors(x, y)
        assert (m.nan_mismatch, m.max_ulp) == (1, 1)


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_ulp_at_is_the_spacing_of_the_dtype_values(dtype):
    for p in range(largest_finite_pattern(dtype)):
        assert ulp_at(value_of(p, dtype), dtype) == value_of(p + 1, dtype) - value_of(p, dtype), hex(p)


def test_compare_json_reports_the_float8_max_ulp(tmp_path):
    dtype = torch.float8_e4m3fn
    for name, patterns in (("a", [0x30, 0x81, 0x40]), ("b", [0x31, 0x01, 0x40])):
        with tdiff.capture(tmp_path / name):
            tdiff.dump("x", of_patterns(patterns, dtype))
    for a, b in (("a", "b"), ("b", "a")):
        report = json.loads(tdiff_cli("compare", tmp_path / a, tmp_path / b, "--json", expect=1).output)
        metrics = report["first_divergence"]["metrics"]
        assert (metrics["mismatched"], metrics["max_ulp"]) == (2, reference_ulp(0x81, 0x01, dtype))
