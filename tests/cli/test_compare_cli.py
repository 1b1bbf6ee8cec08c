"""tdiff compare through click's CliRunner: exit codes, JSON, messages."""

import json

import torch

import tdiff
from tdiff.compare import CompareOptions, Tolerance, compare_dumps
from tdiff.store import open_dump
from tests.helpers import tdiff_cli


def dump_of(path, **tensors):
    with tdiff.capture(path):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    return path


def test_match_exits_0_and_divergence_exits_1_with_json(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.ones(3), y=torch.arange(4.0))
    b = dump_of(tmp_path / "b", x=torch.ones(3), y=torch.arange(4.0) * 1.5)
    same = dump_of(tmp_path / "same", x=torch.ones(3), y=torch.arange(4.0))
    result = tdiff_cli("compare", a, same, expect=0)
    assert "match: all 2 tensors equal" in result.output
    result = tdiff_cli("compare", a, b, "--json", expect=1)
    report = json.loads(result.output)
    assert report["status"] == "diverged" and report["first_divergence"]["name"] == "y"
    assert report["summary"] == {"compared": 2, "match": 1, "mismatch": 1, "only_a": 0, "only_b": 0,
                                 "shape_mismatch": 0, "dtype_mismatch": 0}
    assert report["first_divergence"]["metrics"]["mismatched"] == 3


def test_the_json_printed_is_the_json_of_the_comparison_compare_dumps_returns(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.ones(3), y=torch.arange(4.0), z=torch.zeros(2))
    b = dump_of(tmp_path / "b", x=torch.ones(3), y=torch.arange(4.0) * 1.5, z=torch.zeros(2, 1))
    printed = json.loads(tdiff_cli("compare", a, b, "--json", "--atol", "0.5", expect=1).output)
    report = compare_dumps(open_dump(a), open_dump(b), CompareOptions(tolerance=Tolerance(atol=0.5)))
    assert printed == json.loads(json.dumps(report.to_json()))
    assert [t["status"] for t in printed["tensors"]] == ["match", "mismatch", "shape_mismatch"]


def test_the_same_dump_as_a_and_b_is_said_to_be_the_same_dump(tmp_path):
    import shutil

    a = dump_of(tmp_path / "a", x=torch.ones(3))
    shutil.copytree(a, tmp_path / "copy")
    same = f"A and B are the same dump ({a})"
    assert same in tdiff_cli("compare", a, tmp_path / "." / "a", expect=0).output
    assert json.loads(tdiff_cli("compare", a, a, "--json", expect=0).output)["same_dump"] is True
    assert f"note: {same}: it matches itself" in tdiff_cli("bisect", a, a, expect=0).output
    assert f"**Match:** A and B are the same dump (`{a}`)" in tdiff_cli("report", a, a, expect=0).output
    assert json.loads(tdiff_cli("report", a, a, "--format", "json", expect=0).output)["same_dump"] is True
    copy = tdiff_cli("compare", a, tmp_path / "copy", expect=0).output
    assert "same dump" not in copy and "match: all 1 tensors equal" in copy
    assert json.loads(tdiff_cli("compare", a, tmp_path / "copy", "--json", expect=0).output)["same_dump"] is False
    assert "same dump" not in tdiff_cli("bisect", a, tmp_path / "copy", expect=0).output


def test_bad_input_exits_2_with_one_line(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.ones(3))
    for args, message in [((a, tmp_path / "nope"), "no such dump directory"),
                          ((a, a, "--exact", "--atol", "1"), "--exact cannot be combined"),
                          ((a, a, "--atol", "-1"), "--atol must be a non-negative number"),
                          ((a, a, "--layer", "4"), "nothing to compare")]:
        result = tdiff_cli("compare", *args, expect=2)
        assert message in result.output
        assert "Traceback" not in result.output


def test_layer_option_restricts_to_one_layer(tmp_path):
    from tests.helpers import tiny_qwen2, token_ids

    model = tiny_qwen2()
    for side in ("a", "b"):
        with torch.no_grad(), tdiff.capture(tmp_path / side):
            model(token_ids())
    report = json.loads(tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--layer", "1", "--json",
                                  expect=0).output)
    assert report["tensors"] and all(t["layer"] == 1 for t in report["tensors"])


def test_under_a_tolerance_summaries_and_tables_count_the_elements_outside_it(tmp_path):
    # "close" differs bitwise but lies within the tolerance (a match); "far" has some elements
    # within it and some beyond
    close_a, far_a = torch.ones(1, 4, 2), torch.arange(8.0).reshape(1, 4, 2)
    close_b, far_b = close_a + 1e-3, far_a * 1.01
    a = dump_of(tmp_path / "a", close=close_a, far=far_a)
    b = dump_of(tmp_path / "b", close=close_b, far=far_b)
    atol = 0.02
    outside = (far_a - far_b).abs() > atol
    bitwise = int((far_a != far_b).sum())
    assert 0 < int(outside.sum()) < bitwise  # the case this test is about

    line = tdiff_cli("compare", a, b, "--atol", atol, expect=1).output
    assert f"{int(outside.sum())}/8 elements outside atol={atol:g} rtol=0 ({100 * outside.float().mean():.3g}%; " \
           f"{bitwise} differ bitwise)" in " ".join(line.split())

    text = tdiff_cli("report", a, b, "--atol", atol, expect=1).stdout
    tokens = int(outside.any(dim=2).sum())
    assert f"Per token (dim 1 of \\[1, 4, 2\\]): {tokens} of 4 tokens differ" in text
    assert "| layer | boundary | kind | tensors differ | outside tolerance |" in text
    rows = {row.split("|")[2].strip(): row.split("|")[5].strip() for row in text.splitlines()
            if row.startswith("| - | `")}
    assert rows == {"`close`": "0%", "`far` ◀ first": f"{100 * outside.float().mean():.3g}%"}

    data = json.loads(tdiff_cli("report", a, b, "--atol", atol, "--format", "json", expect=1).stdout)
    assert data["culprit"]["tokens"]["outside_tolerance"] == outside.sum(dim=(0, 2)).tolist()
    assert data["culprit"]["tokens"]["mismatched"] == (far_a != far_b).sum(dim=(0, 2)).tolist()  # bitwise, kept
    (row,) = [r["output"] for r in data["layers"]]
    assert (row["mismatched"], row["outside_tolerance"]) == (bitwise, int(outside.sum()))


def stats_dump_of(path, **tensors):
    with tdiff.capture(path, mode="stats"):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    return path


def test_stats_mode_under_a_tolerance_never_calls_an_undecided_difference_a_divergence(tmp_path):
    """Stats mode keeps fingerprints, not values: a difference its statistics cannot size is no
    verdict under --atol (exit 2, for compare and bisect alike); one whose minimum or maximum
    alone moves past the tolerance is a divergence."""
    x = torch.tensor([1.0, 2.0, 3.0])
    a = stats_dump_of(tmp_path / "a", x=x)
    slightly = stats_dump_of(tmp_path / "slightly", x=torch.tensor([1.0, 2.0001, 3.0]))
    far = stats_dump_of(tmp_path / "far", x=torch.tensor([1.0, 2.0, 13.0]))
    tdiff_cli("compare", a, slightly, expect=1)   # bitwise: the fingerprints decide
    for command in ("compare", "bisect"):
        undecided = tdiff_cli(command, a, slightly, "--atol", "0.01", expect=2).output
        assert "stats mode" in undecided and "full mode" in undecided and len(undecided.splitlines()) == 1
        tdiff_cli(command, a, far, "--atol", "0.01", "--rtol", "0.5", expect=1)   # max 3 -> 13
    nan = stats_dump_of(tmp_path / "nan", x=torch.tensor([1.0, float("nan"), 3.0]))
    tdiff_cli("compare", a, nan, "--atol", "100", expect=1)   # NaN matches only NaN


def test_a_reader_that_stops_early_leaves_the_verdicts_exit_status(tmp_path):
    """`tdiff compare A B | head`: the pipe breaks mid-table; a match still exits 0 (rich's default
    exit on a broken pipe is 1, which means "diverged")."""
    import subprocess

    from tests.helpers import installed_tdiff

    tensors = {f"x{i}": torch.ones(2) for i in range(1200)}   # a table far larger than a pipe's buffer
    a, b = dump_of(tmp_path / "a", **tensors), dump_of(tmp_path / "b", **tensors)
    process = subprocess.Popen([installed_tdiff(), "compare", a, b, "--top", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.read(10)
    process.stdout.close()   # the reader is gone
    assert process.wait(timeout=120) == 0, process.stderr.read().decode()[-2000:]
