"""Finite values whose squares or differences pass the float they are computed in: float32 (fp32,
bf16) past ~1.8e19 squares past its max, 3e38 - -3e38 differs by more than it holds, float64 past
~1e154. The cosine stays the cosine of the values (it was NaN, clamped to a perfect 1.0), max_abs
and max_rel the true ones. Expected figures are computed from the tensors in each test, exactly
(fractions) or in float64."""

import json
import math
from fractions import Fraction

import pytest
import torch

import tdiff
from tdiff.compare.metrics import EXACT, Tolerance, bits_of, compare_tensors
from tests.helpers import tdiff_cli

pytestmark = pytest.mark.filterwarnings("error")   # numpy's RuntimeWarnings fail the test

WIDE_RANGE = [torch.float32, torch.bfloat16]   # computed in float32; fp16 squares stay far below its max
MAGNITUDES = [1e20, 1e30, 1e36, 3e38]
FLOAT64_MAGNITUDES = [1e80, 1e160, 1e250, 1e307]   # 1e80: the norms multiply past float64


def exact_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """a.b / (|a| |b|) of the tensors' values in exact rational arithmetic, rounded once at the end."""
    x, y = [Fraction(v) for v in a.double().tolist()], [Fraction(v) for v in b.double().tolist()]
    dot = sum(u * v for u, v in zip(x, y))
    squared = dot * dot / (sum(u * u for u in x) * sum(v * v for v in y))
    return math.sqrt(float(squared)) if dot >= 0 else -math.sqrt(float(squared))


def one_ulp_up(t: torch.Tensor) -> torch.Tensor:
    return (bits_of(t) + 1).view(t.dtype).reshape(t.shape)


def pairs(scale: float, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Tensors near ``scale`` and the other side: one ULP apart, of opposite signs, orthogonal, and
    at an angle (all finite in ``dtype``: 0.9 * scale rounds below its max)."""
    a = (torch.tensor([0.9, -0.5, 0.25, 0.7], dtype=torch.float64) * scale).to(dtype)
    assert torch.isfinite(a).all()
    ulp = a.clone()
    ulp[1] = one_ulp_up(a[1:2])[0]
    zero = torch.zeros((), dtype=dtype)
    return {
        "one_ulp": (a, ulp),
        "opposite": (a, -a),
        "orthogonal": (torch.stack([a[0], zero]), torch.stack([zero, a[0]])),
        "angle": (a, torch.stack([a[0], -a[1], a[2], a[3]])),
    }


@pytest.mark.parametrize("dtype", WIDE_RANGE, ids=str)
@pytest.mark.parametrize("scale", MAGNITUDES)
@pytest.mark.parametrize("case", ["one_ulp", "opposite", "orthogonal", "angle"])
def test_the_cosine_of_values_whose_squares_pass_float32_is_theirs(dtype, scale, case):
    a, b = pairs(scale, dtype)[case]
    m = compare_tensors(a, b)
    assert m.mismatched > 0 and not m.within(EXACT)
    assert m.cosine == pytest.approx(exact_cosine(a, b), abs=1e-12)
    if case != "one_ulp":   # one ULP apart the cosine is 1 to float64's precision
        assert m.cosine < 1.0


@pytest.mark.parametrize("scale", FLOAT64_MAGNITUDES)
@pytest.mark.parametrize("case", ["one_ulp", "opposite", "orthogonal", "angle"])
def test_the_cosine_of_large_float64_values_is_theirs(scale, case):
    a, b = pairs(scale, torch.float64)[case]
    m = compare_tensors(a, b)
    assert m.mismatched > 0
    assert m.cosine == pytest.approx(exact_cosine(a, b), abs=1e-12)


@pytest.mark.parametrize("scale", [1e-100, 1e-80])
def test_the_cosine_of_float64_values_whose_norms_multiply_below_float64_is_theirs(scale):
    # the squares are normal float64 numbers, their product of norms is not (it was a division by 0)
    a, b = pairs(scale, torch.float64)["angle"]
    assert compare_tensors(a, b).cosine == pytest.approx(exact_cosine(a, b), abs=1e-12)


@pytest.mark.parametrize("dtype", [*WIDE_RANGE, torch.float64], ids=str)
def test_chunks_of_ordinary_and_overflowing_values_sum_to_the_cosine_of_all(monkeypatch, dtype):
    from tdiff.compare import metrics

    big = 1e36 if dtype != torch.float64 else 1e300
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 2)
    # an ordinary chunk that differs, an equal one past the max of squares, one that differs there
    a = torch.tensor([1.0, 2.0, 0.5 * big, -0.25 * big, 0.9 * big, 0.3 * big], dtype=torch.float64).to(dtype)
    b = torch.tensor([1.0, 3.0, 0.5 * big, -0.25 * big, 0.9 * big, -0.3 * big], dtype=torch.float64).to(dtype)
    m = compare_tensors(a, b)
    assert m.cosine == pytest.approx(exact_cosine(a, b), abs=1e-12) and m.cosine < 1.0
    ordinary = compare_tensors(a[:2], b[:2])   # the chunks of ordinary size alone: their own cosine
    assert ordinary.cosine == pytest.approx(exact_cosine(a[:2], b[:2]), abs=1e-12)


@pytest.mark.parametrize("dtype", WIDE_RANGE, ids=str)
def test_a_difference_past_float32s_max_has_its_float64_size(dtype):
    a, b = torch.tensor([1.0, 3e38, 2.0]).to(dtype), torch.tensor([1.0, -3e38, 2.5]).to(dtype)
    x, y = a.double(), b.double()
    m = compare_tensors(a, b)
    assert m.max_abs == float((x - y).abs().max()) == 2 * float(x[1])
    assert m.max_rel == 2.0
    assert m.mean_abs == pytest.approx(float((x - y).abs().mean()), rel=1e-12)
    assert (m.worst_index, m.worst_a, m.worst_b) == ((1,), float(x[1]), float(y[1]))
    assert m.cosine == pytest.approx(exact_cosine(a, b), abs=1e-12)
    # |a-b| = 2 max(|a|, |b|) is within rtol=2, not below it: the bound is computed as wide
    assert not m.within(Tolerance(rtol=1.5))
    assert compare_tensors(a, b, Tolerance(rtol=2.0, atol=0.5)).within(Tolerance(rtol=2.0, atol=0.5))


def test_compare_json_reports_a_divergence_of_overflowing_values(tmp_path):
    a, b = pairs(1e30, torch.float32)["angle"]
    for name, t in (("a", a), ("b", b)):
        with tdiff.capture(tmp_path / name):
            tdiff.dump("large", t)
    out = tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--json", expect=1).output
    report = json.loads(out)
    metrics = report["tensors"][0]["metrics"]
    assert report["tensors"][0]["status"] == "mismatch" and report["first_divergence"]["name"] == "large"
    assert metrics["cosine"] == pytest.approx(exact_cosine(a, b), abs=1e-12) and metrics["cosine"] < 1.0


TINY = [1e-20, 1e-30, 1e-39]   # float32 squares: below its smallest normal, 0, 0 (1e-39 is itself subnormal)
FLOAT64_TINY = [1e-160, 1e-250, 1e-310]


@pytest.mark.parametrize("dtype", WIDE_RANGE, ids=str)
@pytest.mark.parametrize("scale", TINY)
@pytest.mark.parametrize("case", ["opposite", "orthogonal", "angle"])
def test_the_cosine_of_values_whose_squares_vanish_in_float32_is_theirs(dtype, scale, case):
    # their squares summed in float32 were 0: the cosine came out 0, however close the tensors
    a, b = pairs(scale, dtype)[case]
    assert (a != 0).any()
    m = compare_tensors(a, b)
    assert m.cosine == pytest.approx(exact_cosine(a, b), abs=1e-12) and m.cosine < 1.0


@pytest.mark.parametrize("scale", FLOAT64_TINY)
def test_the_cosine_of_tiny_float64_values_is_theirs(scale):
    a, b = pairs(scale, torch.float64)["angle"]
    assert compare_tensors(a, b).cosine == pytest.approx(exact_cosine(a, b), abs=1e-12)


@pytest.mark.parametrize("dtype", [*WIDE_RANGE, torch.float64], ids=str)
@pytest.mark.parametrize("order", ["tiny first", "ordinary first"])
def test_chunks_of_tiny_and_ordinary_values_sum_to_the_cosine_of_all(monkeypatch, dtype, order):
    from tdiff.compare import metrics

    tiny = 1e-30 if dtype != torch.float64 else 1e-300
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 2)
    small = [[0.5 * tiny, -0.25 * tiny], [0.5 * tiny, 0.25 * tiny]]   # differ in one sign
    ordinary = [[1.0, 2.0], [1.0, 3.0]]
    chunks = (small, ordinary) if order == "tiny first" else (ordinary, small)
    a = torch.tensor(chunks[0][0] + chunks[1][0], dtype=torch.float64).to(dtype)
    b = torch.tensor(chunks[0][1] + chunks[1][1], dtype=torch.float64).to(dtype)
    assert compare_tensors(a, b).cosine == pytest.approx(exact_cosine(a, b), abs=1e-12)
    only_tiny = torch.tensor(small[0], dtype=torch.float64).to(dtype), torch.tensor(small[1], dtype=torch.float64).to(dtype)
    cosine = compare_tensors(*only_tiny).cosine
    assert cosine == pytest.approx(exact_cosine(*only_tiny), abs=1e-12) and cosine < 1.0
