"""The one-pass chunked metrics against a reference computed element by element, unchunked, in
float64 (Python floats and integers), on tensors of any dtype and shape: NaN, infinities, -0.0,
empty tensors and sizes that straddle the chunks' boundaries (issue 32 item 2)."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tdiff.compare import metrics
from tdiff.compare.metrics import EXACT, Tolerance, measure, ulp_at
from tdiff.compare.parallel import map_in_order
from tdiff.store.dtypes import FLOAT_BITS

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz]
INTEGERS = [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool]
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def bit_patterns(dtype: torch.dtype, count: int):
    """Any bit patterns of ``dtype``'s width: NaN payloads, infinities and -0.0 among them."""
    bits = torch.iinfo(FLOAT_BITS[dtype]).bits
    return st.lists(st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1), min_size=count, max_size=count)


@st.composite
def pairs(draw, same_dtype: bool = True):
    rows, width = draw(st.integers(0, 6)), draw(st.integers(0, 7))
    dtype = draw(st.sampled_from(FLOATS + INTEGERS))
    n = rows * width
    if dtype in FLOAT_BITS:
        a = torch.tensor(draw(bit_patterns(dtype, n)), dtype=FLOAT_BITS[dtype]).view(dtype)
    elif dtype == torch.bool:
        a = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
    else:
        info = torch.iinfo(dtype)
        a = torch.tensor(draw(st.lists(st.integers(info.min, info.max), min_size=n, max_size=n)), dtype=dtype)
    b = a.clone()
    # some elements of B changed: by a little (nearby bit patterns), or to any pattern
    for i in draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n)):
        ints = b.view(FLOAT_BITS[dtype]) if dtype in FLOAT_BITS else b
        if dtype == torch.bool:
            b[i] = not bool(b[i])
        elif draw(st.booleans()):
            info = torch.iinfo(ints.dtype)
            ints[i] = min(info.max, max(info.min, int(ints[i]) + draw(st.integers(-3, 3))))
        else:
            ints[i] = int(a.view(ints.dtype)[draw(st.integers(0, n - 1))]) if n else 0
    if not same_dtype and draw(st.booleans()):
        b = b.to(draw(st.sampled_from([torch.float32, torch.float64, torch.int64])))
    return a.reshape(rows, width), b.reshape(rows, width)


tolerances = st.one_of(st.just(EXACT),
                       st.builds(Tolerance, atol=st.floats(0, 10), rtol=st.floats(0, 2)),
                       st.builds(Tolerance, ulp=st.floats(0, 8)),
                       st.builds(Tolerance, atol=st.floats(0, 1), rtol=st.floats(0, 1), ulp=st.floats(0, 8)))


def value(t: torch.Tensor, i: int) -> float | int:
    x = t.reshape(-1)[i]
    return float(x.to(torch.float64)) if t.is_floating_point() else int(x)


def ordered(bits: int, dtype: torch.dtype) -> int:
    """The integer whose order is the float's (-0 one below +0, where the dtype has a -0)."""
    width = torch.iinfo(FLOAT_BITS[dtype]).bits
    magnitude = bits & ((1 << (width - 1)) - 1)
    steps = 0 if dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz) else 1
    return -magnitude - steps if bits < 0 else magnitude


def ulp_distance(bits_a: int, bits_b: int, dtype: torch.dtype) -> int:
    if dtype == torch.float64 and (bits_a < 0) != (bits_b < 0):
        # across zero the distance passes int64: it is summed in float64, as documented in _max_ulp
        return int(float(abs(ordered(bits_a, dtype))) + float(abs(ordered(bits_b, dtype))))
    return abs(ordered(bits_a, dtype) - ordered(bits_b, dtype))


def reference(a: torch.Tensor, b: torch.Tensor, tolerance: Tolerance) -> dict:
    """The metrics, element by element in float64 (integers exactly), no chunks."""
    n, same = a.numel(), a.dtype == b.dtype
    bits = [t.reshape(-1).view(FLOAT_BITS[t.dtype]).tolist() if t.dtype in FLOAT_BITS else None for t in (a, b)]
    xs, ys = [value(a, i) for i in range(n)], [value(b, i) for i in range(n)]
    differ = [not same or (bits[0][i] != bits[1][i] if bits[0] is not None else xs[i] != ys[i]) for i in range(n)]
    finite = [x for x in xs + ys if math.isfinite(x)]
    magnitude = max((abs(x) for x in finite), default=0.0)
    floats = [t.dtype for t in (a, b) if t.is_floating_point()]
    unit = max(ulp_at(magnitude, dtype) for dtype in floats) if floats else 1.0
    atol = (tolerance.atol or 0.0) + (tolerance.ulp * unit if tolerance.ulp is not None else 0.0)
    fails, nan_mismatch, largest, ulps, differences = [], 0, 0.0, [0], []
    for i, (x, y) in enumerate(zip(xs, ys)):
        nan_x, nan_y = math.isnan(x), math.isnan(y)
        nan_mismatch += nan_x != nan_y or (nan_x and nan_y and differ[i])
        if tolerance.exact:
            fails.append(differ[i])
        elif nan_x or nan_y:
            fails.append(nan_x != nan_y)
        elif math.isinf(x) or math.isinf(y):
            fails.append(x != y)
        else:
            fails.append(float(abs(x - y)) > atol + (tolerance.rtol or 0.0) * max(abs(float(x)), abs(float(y))))
        if nan_x or nan_y:
            continue
        differences.append(0.0 if x == y else float(abs(x - y)))
        largest = max(largest, differences[-1])
        if same and differ[i] and bits[0] is not None:
            ulps.append(ulp_distance(bits[0][i], bits[1][i], a.dtype))
        elif same and bits[0] is None:
            ulps.append(int(float(abs(int(x) - int(y)))))   # rounded once to float64, as documented
    width = a[0].numel() if a.shape[0] else 1
    return {"mismatched": sum(differ), "bitwise_equal": same and not any(differ), "nan_mismatch": nan_mismatch,
            "outside_tolerance": sum(fails), "max_abs": largest,
            "mean_abs": math.fsum(differences) / len(differences) if differences else 0.0, "max_ulp": max(ulps) if same else None,
            "rows_differ": [any(fails[r * width:(r + 1) * width]) for r in range(a.shape[0])]}


def measured(a, b, tolerance, chunk: int, *, piece: int = 1 << 23, jobs: int = 1):
    """measure() in chunks of ``chunk`` elements, pieces of ``piece`` (rounded down to whole chunks),
    in a run of ``jobs`` threads (all but this one idle: they take pieces)."""
    with mock.patch.object(metrics, "CHUNK_ELEMENTS", chunk), mock.patch.object(metrics, "PIECE_ELEMENTS", piece):
        (result,) = map_in_order(lambda _: measure(a, b, tolerance, by_rows=True), [None], jobs=jobs)
    return result


@settings(max_examples=400, deadline=None)
@given(pairs(same_dtype=False), tolerances, st.integers(1, 9))
@example((torch.tensor([[0.1]]), torch.tensor([[0.0]])), Tolerance(atol=0.1), 1)   # float32's 0.1 is above 0.1
@example((torch.tensor([[-0.0, 1.0]]), torch.tensor([[0.0, 1.0]])), EXACT, 1)
@example((torch.tensor([[FLOAT32_MAX, 1.0]]), torch.tensor([[-FLOAT32_MAX, 1.0]])), Tolerance(rtol=0.5), 1)
def test_chunked_metrics_equal_an_unchunked_float64_reference(pair, tolerance, chunk):
    a, b = pair
    expected = reference(a, b, tolerance)
    result = measured(a, b, tolerance, chunk)
    m = result.metrics
    assert result.rows_differ is not None and result.rows_differ.tolist() == expected["rows_differ"]
    assert m.numel == a.numel() and m.bitwise_equal == expected["bitwise_equal"]
    if m.bitwise_equal:
        return
    assert m.mismatched == expected["mismatched"]
    assert m.outside_tolerance == expected["outside_tolerance"]
    assert m.nan_mismatch == expected["nan_mismatch"]
    assert m.max_ulp == expected["max_ulp"]
    # |a-b| of floats of 32 bits or fewer is computed in float32: exact or one rounding away
    assert m.max_abs == pytest.approx(expected["max_abs"], rel=2 ** -23, abs=0)
    assert m.mean_abs == pytest.approx(expected["mean_abs"], rel=2 ** -22, abs=0)


@settings(max_examples=200, deadline=None)
@given(pairs(same_dtype=False), tolerances, st.integers(1, 9))
def test_chunks_of_any_size_give_the_metrics_of_one_chunk(pair, tolerance, chunk):
    a, b = pair
    whole, chunked = measured(a, b, tolerance, 1 << 20), measured(a, b, tolerance, chunk)
    assert np.array_equal(chunked.rows_differ, whole.rows_differ)
    w, c = whole.metrics, chunked.metrics
    for field in ("numel", "bitwise_equal", "mismatched", "outside_tolerance", "nan_mismatch", "max_ulp",
                  "worst_index"):
        assert getattr(c, field) == getattr(w, field), field
    for field in ("max_abs", "mean_abs", "max_ulp_at_scale"):   # sums in float64: rounding order only
        expected = getattr(w, field)
        assert getattr(c, field) == (expected if expected is None else pytest.approx(expected, rel=1e-6)), field


@settings(max_examples=200, deadline=None)
@given(pairs(same_dtype=False), tolerances, st.integers(1, 4), st.integers(1, 9), st.integers(2, 5))
def test_pieces_on_any_number_of_threads_give_the_metrics_of_one_pass(pair, tolerance, chunk, piece, jobs):
    """A large tensor's pieces, measured on idle threads and folded in order: the verdicts of one
    pass, and the same result to the last bit on one thread or on ``jobs``."""
    a, b = pair
    whole = measured(a, b, tolerance, chunk, piece=1 << 20)
    alone = measured(a, b, tolerance, chunk, piece=piece * chunk)
    spread = measured(a, b, tolerance, chunk, piece=piece * chunk, jobs=jobs)
    assert repr(spread.metrics) == repr(alone.metrics)   # every float to the last bit (NaN too)
    assert np.array_equal(spread.rows_differ, alone.rows_differ)
    assert np.array_equal(alone.rows_differ, whole.rows_differ)
    w, p = whole.metrics, alone.metrics
    for field in ("numel", "bitwise_equal", "mismatched", "outside_tolerance", "nan_mismatch", "max_ulp",
                  "worst_index", "max_abs", "max_rel"):
        assert getattr(p, field) == getattr(w, field), field
    for field in ("mean_abs", "max_ulp_at_scale", "cosine"):   # sums folded piece by piece: rounding order only
        expected = getattr(w, field)
        if expected is None or math.isnan(expected):
            assert getattr(p, field) is expected or math.isnan(getattr(p, field)), field
        else:
            assert getattr(p, field) == pytest.approx(expected, rel=1e-6, abs=1e-12), field


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]), st.integers(1, 40),
       st.integers(1, 9), st.integers(0, 2**31))
def test_cosine_of_nearly_equal_tensors_is_the_float64_cosine(dtype, n, chunk, seed):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(n, 3, generator=generator).to(dtype)
    b = (a.to(torch.float64) * (1 + 0.01 * torch.randn(n, 3, generator=generator, dtype=torch.float64))).to(dtype)
    x, y = a.to(torch.float64).reshape(-1), b.to(torch.float64).reshape(-1)
    expected = float(x @ y / (x.norm() * y.norm()))
    assert measured(a, b, EXACT, chunk).metrics.cosine == pytest.approx(expected, abs=1e-6)


def test_rows_without_elements_never_differ():
    a, b = torch.zeros(3, 0), torch.ones(3, 0)
    assert measure(a, b, by_rows=True).rows_differ.tolist() == [False, False, False]
    assert measure(torch.zeros(0, 4), torch.ones(0, 4), by_rows=True).rows_differ.tolist() == []


finite_floats = {torch.float32: st.floats(width=32, allow_nan=False, allow_infinity=False),
                 torch.bfloat16: st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-2.0 ** 126,
                                           max_value=2.0 ** 126),
                 torch.float16: st.floats(width=16, allow_nan=False, allow_infinity=False)}


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(list(finite_floats)), st.data(), st.sampled_from(["atol", "rtol"]),
       st.sampled_from([0.0, 2.0 ** -52, 2.0 ** -30, 2.0 ** -24, 2.0 ** -22, 2.0 ** -20, 2.0 ** -18]),
       st.sampled_from([-1, 1]))
def test_elements_at_the_bound_are_judged_as_in_float64(dtype, data, kind, nudge, sign):
    """|a-b| within float32's rounding of the bound: the float32 decision must not decide these."""
    xs = data.draw(st.lists(finite_floats[dtype], min_size=1, max_size=5))
    ys = data.draw(st.lists(finite_floats[dtype], min_size=len(xs), max_size=len(xs)))
    a, b = torch.tensor(xs).to(dtype).reshape(1, -1), torch.tensor(ys).to(dtype).reshape(1, -1)
    x, y = a[0, 0].item(), b[0, 0].item()
    distance, largest = abs(x - y), max(abs(x), abs(y))
    if kind == "atol":
        tolerance = Tolerance(atol=distance * (1 + sign * nudge), rtol=0.0)
    elif largest:
        tolerance = Tolerance(atol=0.0, rtol=distance / largest * (1 + sign * nudge))
    else:
        return
    expected = reference(a, b, tolerance)
    result = measured(a, b, tolerance, 2)
    assert result.metrics.outside_tolerance == (expected["outside_tolerance"] if not result.metrics.bitwise_equal else 0)
    assert result.rows_differ.tolist() == expected["rows_differ"]
