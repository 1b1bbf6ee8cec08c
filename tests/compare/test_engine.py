"""compare_dumps on real dumps: shape/dtype differences, one-sided tensors, filters, aliases."""

import pytest
import torch

import tdiff
from tdiff.compare import CompareOptions, Tolerance, compare_dumps
from tdiff.errors import TdiffError
from tdiff.store import open_dump


def dump_of(path, **tensors):
    with tdiff.capture(path):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    return open_dump(path)


def test_shape_and_dtype_differences_are_divergences_with_a_reason(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.ones(2, 3), y=torch.ones(4))
    b = dump_of(tmp_path / "b", x=torch.ones(3, 2), y=torch.ones(4, dtype=torch.float64))
    report = compare_dumps(a, b)
    by_name = {c.name: c for c in report.comparisons}
    assert by_name["x"].status == "shape_mismatch" and "[2, 3] vs [3, 2]" in by_name["x"].reason
    assert by_name["y"].status == "dtype_mismatch" and by_name["y"].metrics.max_abs == 0.0
    assert report.status == "diverged"


def test_a_tensor_on_one_side_only_is_a_divergence(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.ones(2), extra=torch.zeros(1))
    b = dump_of(tmp_path / "b", x=torch.ones(2))
    report = compare_dumps(a, b)
    assert [(c.name, c.status) for c in report.comparisons] == [("x", "match"), ("extra", "only_a")]
    assert report.status == "diverged"


def test_tolerance_turns_small_differences_into_matches(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.tensor([1.0, 2.0]))
    b = dump_of(tmp_path / "b", x=torch.tensor([1.0, 2.0 + 1e-6]))
    assert compare_dumps(a, b).status == "diverged"
    assert compare_dumps(a, b, CompareOptions(tolerance=Tolerance(atol=1e-5))).status == "match"


def test_filters_and_nothing_to_compare(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.ones(2), y=torch.ones(2))
    b = dump_of(tmp_path / "b", x=torch.ones(2), y=torch.zeros(2))
    assert compare_dumps(a, b, CompareOptions(select=["^x$"])).status == "match"
    with pytest.raises(TdiffError, match="nothing to compare"):
        compare_dumps(a, b, CompareOptions(layers="3"))
