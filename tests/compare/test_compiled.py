"""The compiled pass (tdiff/compare/measure_kernel.c) against numpy's: the same verdicts and
figures, sums to their last bits aside, on any bit patterns of the dtypes it knows (NaN and
infinities go to numpy), with rows, in pieces."""

from __future__ import annotations

import platform
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tdiff.compare import compiled, metrics
from tdiff.compare.metrics import measure
from tdiff.store.dtypes import FLOAT_BITS


def test_setup_built_the_compiled_pass_for_this_processor(monkeypatch):
    assert compiled.kernel is not None, f"{compiled.LIBRARY} is missing: scripts/setup.sh builds it"
    if platform.machine() == "x86_64":
        assert compiled.LIBRARY_X86_64_V3.exists()
        monkeypatch.setattr(compiled, "_processor_flags", lambda: frozenset({"sse2", "avx"}))
        assert compiled.library() == compiled.LIBRARY   # no AVX2: the build for any processor
        monkeypatch.setattr(compiled, "_processor_flags", lambda: compiled.X86_64_V3_FLAGS | {"avx512f"})
        assert compiled.library() == compiled.LIBRARY_X86_64_V3


@st.composite
def pairs(draw):
    dtype = draw(st.sampled_from(sorted(compiled.KINDS, key=str)))
    rows, width = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    bits = torch.iinfo(FLOAT_BITS[dtype]).bits
    finite = draw(st.booleans())   # mostly finite values: the pass's own ground
    patterns = st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    values = draw(st.lists(patterns, min_size=rows * width, max_size=rows * width))
    a = torch.tensor(values, dtype=FLOAT_BITS[dtype]).view(dtype)
    if finite:
        a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=dtype))
    b = a.clone()
    ints = b.view(FLOAT_BITS[dtype])
    for i in draw(st.lists(st.integers(0, rows * width - 1), max_size=rows * width)):
        changed = int(ints[i]) + draw(st.sampled_from([-1, 1, 1 << (bits - 1), 7]))   # a step, a sign, more
        ints[i] = (changed + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))   # wrapped to the width
    if finite:
        b = torch.where(torch.isfinite(b), b, torch.zeros((), dtype=dtype))
    return a.reshape(rows, width), b.reshape(rows, width)


def measured(a, b, *, use_compiled: bool, piece: int):
    with mock.patch.object(metrics, "CHUNK_ELEMENTS", 4), mock.patch.object(metrics, "PIECE_ELEMENTS", piece), \
            mock.patch.object(compiled, "kernel", compiled.kernel if use_compiled else None):
        return measure(a, b, by_rows=True)


@settings(max_examples=400, deadline=None)
@given(pairs(), st.sampled_from([4, 8, 1 << 20]))
def test_the_compiled_pass_gives_numpys_figures(pair, piece):
    a, b = pair
    fast, slow = measured(a, b, use_compiled=True, piece=piece), measured(a, b, use_compiled=False, piece=piece)
    assert np.array_equal(fast.rows_differ, slow.rows_differ)
    f, s = fast.metrics, slow.metrics
    for field in ("numel", "bitwise_equal", "mismatched", "outside_tolerance", "nan_mismatch", "max_ulp",
                  "worst_index", "max_abs", "max_rel", "max_ulp_at_scale"):
        assert repr(getattr(f, field)) == repr(getattr(s, field)), field
    for field in ("worst_a", "worst_b"):
        assert repr(getattr(f, field)) == repr(getattr(s, field)), field
    # sums in another order: the last bits
    assert f.mean_abs == pytest.approx(s.mean_abs, rel=1e-6, abs=1e-12)
    # both square |a-b| as float32 computed it, but numpy, where the squares of a chunk vanish in
    # float32 (values under ~1e-19), computes that chunk again in float64, |a-b| exactly: a cosine
    # of nearly opposite subnormals moved by 1.4e-7 (float32's rounding of |a-b|)
    assert f.cosine == pytest.approx(s.cosine, rel=1e-6, abs=1e-6)


def test_a_large_bfloat16_pair_is_measured_by_the_compiled_pass():
    """The logits of the issue's case in small: every element differs by one ULP but one, which
    differs most; the figures are read off the tensors."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 1000, generator=generator).to(torch.bfloat16)
    b = a.clone()
    b.view(torch.int16).add_(1)
    b[17, 3] = a[17, 3] * 2 + 1
    with mock.patch.object(metrics.np, "count_nonzero", side_effect=AssertionError("numpy measured the pair")):
        m = measure(a, b, by_rows=True).metrics
    differences = (a.double() - b.double()).abs()
    assert m.mismatched == a.numel() - int((a.view(torch.int16) == b.view(torch.int16)).sum())
    assert m.max_abs == float(differences.max()) and m.worst_index == (17, 3)
    assert m.worst_a == float(a[17, 3]) and m.worst_b == float(b[17, 3])
    assert m.mean_abs == pytest.approx(float(differences.mean()), rel=1e-9)


@pytest.mark.parametrize("dtype", sorted(compiled.KINDS, key=str))
def test_strided_views_are_measured_by_their_own_elements(dtype):
    """Every other element of two tensors (a view whose bytes interleave with others'): a change
    outside the view is no difference, one inside it is, wherever it falls."""
    base_a = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    outside, inside = base_a.clone(), base_a.clone()
    outside[1::2] += 1
    inside[3000] += 1
    assert measure(base_a[::2], outside[::2]).metrics.bitwise_equal
    m = measure(base_a[::2], inside[::2]).metrics
    assert m.mismatched == 1 and m.worst_index == (1500,)
