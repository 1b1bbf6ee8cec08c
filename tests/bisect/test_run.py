"""tdiff.bisect.run: bisection as a library call, and the typed result `tdiff bisect --json` prints."""

import json

import pytest

import tdiff
import tdiff.bisect
import tdiff.compare
from tdiff.bisect import BisectResult
from tdiff.errors import TdiffError
from tdiff.report.console import fmt_number, make_console, render_bisect
from tests.helpers import planted_norm_dumps, tdiff_cli

PLANTED = "model.layers.1.post_attention_layernorm"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return planted_norm_dumps(tmp_path_factory.mktemp("dumps"))


def test_run_on_two_dumps_names_the_planted_norm(dumps):
    a, b = dumps
    result = tdiff.bisect.run(a, b)
    d = result.first_divergence
    assert (result.status, result.exit_code) == ("diverged", 1)
    assert (d.module, d.kind, d.event, d.introduced, d.layer) == (PLANTED, "norm", "output", True, 1)
    assert [t.module for t in result.trail] == ["model.layers.1", "model", ""]
    assert result.runs is None and result.graft is None and result.trials is None


def test_run_on_one_dump_twice_matches(dumps):
    a, _ = dumps
    result = tdiff.bisect.run(a, a)
    assert (result.status, result.first_divergence, result.exit_code) == ("match", None, 0)
    assert result.checked > 0


def test_run_refuses_a_graft_without_the_command_that_reruns_side_b(dumps):
    a, b = dumps
    with pytest.raises(TdiffError, match="need --run-b"):
        tdiff.bisect.run(a, b, graft=True)


@pytest.mark.parametrize("args", [(), ("--atol", "1e-2")], ids=["bitwise", "tolerance"])
def test_the_cli_prints_the_json_of_the_result_run_returns(dumps, args):
    a, b = dumps
    printed = json.loads(tdiff_cli("bisect", a, b, "--json", *args, expect=None).stdout)
    tolerance = tdiff.compare.Tolerance(atol=1e-2) if args else tdiff.compare.EXACT
    assert printed == json.loads(json.dumps(tdiff.bisect.run(a, b, tolerance=tolerance).to_json()))


def test_a_result_read_back_from_its_json_equals_it(dumps):
    a, b = dumps
    for result in (tdiff.bisect.run(a, b), tdiff.bisect.run(a, a)):
        text = json.dumps(result.to_json())
        assert BisectResult.from_json(json.loads(text)) == result
        assert json.dumps(BisectResult.from_json(json.loads(text)).to_json()) == text


def test_a_result_read_back_renders_as_the_one_computed_save_the_element_counts(dumps):
    a, b = dumps
    result = tdiff.bisect.run(a, b)
    lines = {}
    for label, shown in (("computed", result), ("read back", BisectResult.from_json(result.to_json()))):
        console = make_console()
        with console.capture() as captured:
            render_bisect(shown, console)
        # (the notes first: here the one that says how to record the norm's ops)
        lines[label] = [line for line in captured.get().splitlines() if not line.startswith("note: ")]
    assert lines["computed"][0] == lines["read back"][0]   # the verdict line: where, kind, layer, step, call
    assert lines["computed"][0].startswith(f"diverged: introduced at {PLANTED} (norm, layer 1)")
    figures = result.first_divergence.metrics
    assert "elements differ" in lines["computed"][2]        # the comparison made here counts them
    assert f"max abs {fmt_number(figures.max_abs)}" in lines["read back"][2]
    assert lines["computed"][3:] == lines["read back"][3:]  # the trail and the events checked
