"""--select and --exclude keep the same tensors in compare and bisect (by name, re.search)."""

import json

import pytest

from tests.cli.test_swapped_module import capture_swapped
from tests.helpers import tdiff_cli


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return capture_swapped(tmp_path_factory.mktemp("filters"))   # B: layers.1.linear2 in fp16


def names(report: dict) -> set[str]:
    return {t["name"] for t in report["tensors"]}


def test_compare_exclude_skips_the_tensors_it_matches(dumps):
    everything = names(json.loads(tdiff_cli("compare", *dumps, "--json", expect=1).output))
    report = json.loads(tdiff_cli("compare", *dumps, "--exclude", "linear2", "--exclude", r"^\(model\)",
                                  "--json", expect=1).output)
    assert names(report) == {n for n in everything if "linear2" not in n and not n.startswith("(model)")}
    assert report["first_divergence"]["name"].startswith("layers.1.")
    # layer 0 without its norms: all match
    kept = json.loads(tdiff_cli("compare", *dumps, "--select", r"^layers\.0\.", "--exclude", "norm", "--json",
                                expect=0).output)
    assert names(kept) == {n for n in everything if n.startswith("layers.0.") and "norm" not in n}



def test_a_match_says_how_many_tensors_the_filters_left_out(dumps):
    """Layer 0 matches while layer 1 differs: the match must not read as the runs' verdict."""
    everything = json.loads(tdiff_cli("compare", *dumps, "--json", expect=1).output)["tensors"]
    kept = json.loads(tdiff_cli("compare", *dumps, "--select", r"^layers\.0\.", "--json", expect=0).output)
    left_out = len(everything) - len(kept["tensors"])
    assert kept["left_out"] == left_out > 0
    text = tdiff_cli("compare", *dumps, "--select", r"^layers\.0\.", expect=0).output
    assert f"{left_out} tensor(s) left out by --layers/--select/--exclude" in text
    assert "left out" not in tdiff_cli("compare", *dumps, expect=1).output
    bisected = json.loads(tdiff_cli("bisect", *dumps, "--select", r"^layers\.0\.", "--json", expect=0).output)
    assert any("left out by --select/--exclude" in note for note in bisected["notes"])

def test_bisect_select_and_exclude_keep_what_compare_keeps(dumps):
    assert json.loads(tdiff_cli("bisect", *dumps, "--select", r"^layers\.0\.", "--json",
                                expect=0).output)["status"] == "match"
    first = json.loads(tdiff_cli("bisect", *dumps, "--json", expect=1).output)["first_divergence"]
    assert first["name"] == "layers.1.linear2"
    # the swapped module left out: what follows it in layer 1 is where the runs part
    first = json.loads(tdiff_cli("bisect", *dumps, "--exclude", "linear2", "--json", expect=1).output)[
        "first_divergence"]
    assert "linear2" not in first["name"] and first["layer"] == 1


@pytest.mark.parametrize("command", ["compare", "bisect"])
def test_a_filter_that_leaves_nothing_exits_2_in_one_line(dumps, command):
    result = tdiff_cli(command, *dumps, "--select", "nothing-is-named-so", "--exclude", "x", expect=2)
    assert result.output.strip().endswith(
        "nothing to compare: no tensor is left by --select nothing-is-named-so and --exclude x")
    assert len(result.output.strip().splitlines()) == 1
    assert "not a valid regular expression" in tdiff_cli(command, *dumps, "--exclude", "(", expect=2).output
