"""Infinities in abs and rel error: an infinity against a finite value or the other infinity is a
mismatch with infinite errors, against the same infinity it is equal, against NaN it is a NaN
mismatch; no numpy warning reaches the user. Expected figures come from the tensors in each test."""

import json
import math

import pytest
import torch

import tdiff
from tdiff.compare.metrics import EXACT, ReportedMetrics, Tolerance, bits_of, compare_tensors
from tests.helpers import tdiff_cli

pytestmark = pytest.mark.filterwarnings("error")   # numpy's RuntimeWarnings fail the test

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2]
LOOSE = Tolerance(atol=1.0, rtol=0.5)   # admits every finite pair below, no infinity
INF = math.inf


def tensors(a: list[float], b: list[float], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(a).to(dtype), torch.tensor(b).to(dtype)


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((bits_of(a) != bits_of(b)).sum())


def finite_errors(a: torch.Tensor, b: torch.Tensor) -> tuple[list[float], list[float]]:
    """|a-b| and |a-b| / max(|a|, |b|) in float64 of the elements finite on both sides."""
    x, y = a.double(), b.double()
    finite = torch.isfinite(x) & torch.isfinite(y)
    x, y = x[finite], y[finite]
    absolute = (x - y).abs()
    return absolute.tolist(), (absolute / torch.maximum(x.abs(), y.abs())).tolist()


def finite_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    x, y = a.double(), b.double()
    finite = torch.isfinite(x) & torch.isfinite(y)
    return float(torch.nn.functional.cosine_similarity(x[finite], y[finite], dim=0))


def same_value(u: float | None, v: float) -> bool:
    return u == v or (u is not None and math.isnan(u) and math.isnan(v))


AGAINST = [(INF, 3.0), (-INF, 3.0), (INF, -INF)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x, y", [pair for a, b in AGAINST for pair in ((a, b), (b, a))])
def test_an_infinity_against_another_value_has_infinite_errors_and_fails_any_tolerance(dtype, x, y):
    a, b = tensors([1.0, x, 2.0], [1.0, y, 2.5], dtype)
    m = compare_tensors(a, b, LOOSE)
    assert (m.mismatched, m.nan_mismatch) == (differing(a, b), 0) == (2, 0)
    assert m.max_abs == m.mean_abs == m.max_rel == m.max_ulp_at_scale == math.inf
    assert (m.worst_index, m.worst_a, m.worst_b) == ((1,), float(a[1]), float(b[1]))
    assert m.outside_tolerance == 1 and not m.within(LOOSE) and not m.within(EXACT)
    assert compare_tensors(a, b).outside_tolerance == 2
    assert m.cosine == pytest.approx(finite_cosine(a, b), abs=1e-6)
    reported = ReportedMetrics.of(m)
    assert (reported.max_abs, reported.mean_abs, reported.max_rel) == ("inf", "inf", "inf")
    alone = compare_tensors(a[1:2], b[1:2], LOOSE)   # a chunk with nothing finite to differ
    assert (alone.max_abs, alone.max_rel, alone.outside_tolerance) == (math.inf, math.inf, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("same", [INF, -INF])
def test_an_infinity_against_the_same_infinity_is_equal(dtype, same):
    a, b = tensors([1.0, same, 2.0], [1.0, same, 2.5], dtype)
    absolute, relative = finite_errors(a, b)
    for x, y in ((a, b), (b, a)):
        m = compare_tensors(x, y, LOOSE)
        assert (m.mismatched, m.nan_mismatch, m.outside_tolerance) == (differing(a, b), 0, 0) == (1, 0, 0)
        assert m.max_abs == max(absolute) and m.max_rel == pytest.approx(max(relative), rel=1e-6)
        assert m.mean_abs == sum(absolute) / a.numel()
        assert m.within(LOOSE) and not m.within(EXACT) and m.worst_index == (2,)
        assert m.cosine == pytest.approx(finite_cosine(a, b), abs=1e-6) and m.cosine < 1.0
    assert compare_tensors(a, a.clone()).bitwise_equal


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x, y", [(INF, math.nan), (math.nan, INF), (-INF, math.nan), (math.nan, -INF)])
def test_an_infinity_against_nan_follows_the_nan_rule(dtype, x, y):
    a, b = tensors([1.0, x, 2.0], [1.0, y, 2.5], dtype)
    absolute, relative = finite_errors(a, b)
    m = compare_tensors(a, b, LOOSE)
    assert (m.mismatched, m.nan_mismatch, m.outside_tolerance) == (differing(a, b), 1, 1) == (2, 1, 1)
    assert m.max_abs == max(absolute) and m.max_rel == pytest.approx(max(relative), rel=1e-6)  # NaN left out
    assert not m.within(LOOSE)
    alone = compare_tensors(a[1:2], b[1:2], LOOSE)
    assert (alone.max_abs, alone.max_rel, alone.nan_mismatch, alone.outside_tolerance) == (0.0, 0.0, 1, 1)
    assert alone.worst_index == (0,)   # with the values as they are, not the NaN-masked ones
    assert same_value(alone.worst_a, float(a[1])) and same_value(alone.worst_b, float(b[1]))


def test_a_chunk_of_equal_infinities_leaves_the_cosine_of_the_finite_elements(monkeypatch):
    from tdiff.compare import metrics

    a, b = torch.tensor([INF, -INF, 1.0, 2.0]), torch.tensor([INF, -INF, 1.0, 2.5])
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 2)   # the first chunk is bitwise equal
    m = compare_tensors(a, b)
    assert m.cosine == pytest.approx(finite_cosine(a, b), abs=1e-9) and m.cosine < 1.0


def test_compare_json_reports_an_infinity_against_a_number_as_an_infinite_error(tmp_path):
    a, b = [1.0, INF, 2.0], [1.0, 3.0, 2.5]
    sides = {"a": (a, [INF, 1.0]), "b": (b, [INF, 1.25])}
    for name, (diverging, same_inf) in sides.items():
        with tdiff.capture(tmp_path / name):
            tdiff.dump("diverging", torch.tensor(diverging))
            tdiff.dump("same_inf", torch.tensor(same_inf))
    for first, second in (("a", "b"), ("b", "a")):
        out = tdiff_cli("compare", tmp_path / first, tmp_path / second, "--json", "--atol", "1", "--rtol", "0.5",
                        expect=1).output
        tensors = {t["name"]: t for t in json.loads(out)["tensors"]}
        diverging = tensors["diverging"]
        assert diverging["status"] == "mismatch"
        metrics = diverging["metrics"]
        assert (metrics["max_abs"], metrics["mean_abs"], metrics["max_rel"]) == ("inf", "inf", "inf")
        assert (metrics["mismatched"], metrics["outside_tolerance"], metrics["worst_index"]) == (2, 1, [1])
        assert tensors["same_inf"]["status"] == "match" and tensors["same_inf"]["metrics"]["max_abs"] == 0.25
