"""`tdiff patch try` speaks compare's metric language: candidates rank and show by ULP at scale
(the JSON keeps raw max ULP beside it), and a shape mismatch that is a batch against one of its
sequences says so, pointing at --batch-row."""

import io
import json

import torch

import tdiff
from tdiff.compare import compare_dumps
from tdiff.report.console import describe, make_console, render_trials
from tdiff.source_patcher.trial import TrialReport, TrialResult, _measure, _rank
from tdiff.store import open_dump

BASELINE = torch.tensor([1e-9, 3.0, 2.0])


def dump_of(path, **tensors):
    with tdiff.capture(path):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    return open_dump(path)


def trial(tmp_path, name: str, x: torch.Tensor) -> TrialResult:
    baseline = dump_of(tmp_path / "baseline", x=BASELINE) if not (tmp_path / "baseline").exists() \
        else open_dump(tmp_path / "baseline")
    result = TrialResult(name=name, patches=[name], status="error", dump="", log="")
    _measure(result, compare_dumps(baseline, dump_of(tmp_path / name, x=x)))
    return result


def test_candidates_rank_and_show_by_ulp_at_scale_and_json_keeps_both(tmp_path):
    # a sign flip near zero: ~2e9 raw ULP, a fraction of one rounding step of the tensor's values
    flip = trial(tmp_path, "sign-flip", torch.tensor([-1e-9, 3.0, 2.0]))
    # three rounding steps off at the tensor's scale, a handful of raw ULP
    off = trial(tmp_path, "three-steps", torch.tensor([1e-9, float(torch.nextafter(torch.nextafter(
        torch.nextafter(torch.tensor(3.0), torch.tensor(4.0)), torch.tensor(4.0)), torch.tensor(4.0))), 2.0]))
    assert flip.max_ulp > off.max_ulp and flip.max_ulp_at_scale < off.max_ulp_at_scale
    assert sorted([off, flip], key=_rank) == [flip, off]
    data = flip.to_json()
    assert (data["max_ulp"], data["max_ulp_at_scale"]) == (flip.max_ulp, flip.max_ulp_at_scale)
    assert TrialResult.from_json(json.loads(json.dumps(data))).max_ulp_at_scale == flip.max_ulp_at_scale

    control = trial(tmp_path, "control", BASELINE * 2)
    report = TrialReport(baseline="b", command=["python"], workdir="w", tolerance="bitwise", control=control,
                         candidates=[flip, off])
    console = make_console()
    console.file, console.width = io.StringIO(), 200
    render_trials(report, console)
    table = console.file.getvalue()
    header = next(line for line in table.splitlines() if "candidate" in line)
    assert "ULP at scale" in header and "max ULP" not in header
    row = next(line for line in table.splitlines() if "three-steps" in line)
    assert row.rstrip(" │").endswith(f" {off.max_ulp_at_scale:g}"), row


def test_a_leading_dimension_that_differs_hints_at_batch_row(tmp_path):
    a = dump_of(tmp_path / "a", hidden=torch.ones(4, 8))
    b = dump_of(tmp_path / "b", hidden=torch.ones(1, 8), other=torch.ones(2, 3))
    (c,) = [c for c in compare_dumps(a, b).comparisons if c.name == "hidden"]
    assert c.status == "shape_mismatch" and "--batch-row" in c.reason and "[4, 8] vs [1, 8]" in c.reason
    result = TrialResult(name="x", patches=[], status="error", dump="", log="")
    _measure(result, compare_dumps(a, b))
    assert "--batch-row" in result.first_divergence.reason
    c2 = compare_dumps(dump_of(tmp_path / "c", hidden=torch.ones(4, 8)), dump_of(tmp_path / "d", hidden=torch.ones(4, 9)))
    assert "--batch-row" not in c2.comparisons[0].reason


def test_a_cosine_that_rounds_to_one_is_printed_with_its_distance_from_one(tmp_path):
    base = torch.linspace(1.0, 2.0, 1000, dtype=torch.float64)
    a = dump_of(tmp_path / "a", x=base)
    b = dump_of(tmp_path / "b", x=base * (1 + 1e-12) + 1e-13)   # every element differs
    (c,) = compare_dumps(a, b).comparisons
    assert c.metrics.mismatched == c.metrics.numel
    assert "cosine 1.000000000" not in describe(c) and "cosine 1-" in describe(c)
