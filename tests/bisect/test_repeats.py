"""Determinism: `tdiff capture --repeat N` and bisect across the runs, as real subprocesses."""

import json
import sys

from tests.helpers import REPO, tdiff_cli, tdiff_process


def capture_repeats(tmp_path, runs, nondeterministic_run):
    out = tmp_path / "rep"
    result = tdiff_process("capture", "--out", out, "--repeat", runs, "--", sys.executable, "-m",
                           "tests.bisect.programs", "repeat", tmp_path / "counter",
                           "--nondeterministic-run", nondeterministic_run, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return out


def test_the_op_that_is_not_bitwise_repeatable_in_one_of_four_runs_is_named(tmp_path):
    out = capture_repeats(tmp_path, 4, nondeterministic_run=3)
    index = json.loads((out / "tdiff-repeat.json").read_text())
    assert index["runs"] == ["run-1", "run-2", "run-3", "run-4"]
    result = tdiff_cli("bisect", out, "--json", expect=1)
    report = json.loads(result.stdout)
    d = report["first_divergence"]
    assert (d["module"], d["kind"], d["event"], d["introduced"]) == (
        "model.layers.0.mlp.down_proj", "linear", "output", True)
    assert report["repeats"] == {"runs": ["run-1", "run-2", "run-3", "run-4"], "reference": "run-1",
                                 "differing": ["run-3"]}
    text = tdiff_cli("bisect", out, expect=1).output
    assert "not bitwise repeatable: run-3" in text and "model.layers.0.mlp.down_proj (linear, layer 0)" in text


def test_repeatable_runs_match(tmp_path):
    out = capture_repeats(tmp_path, 2, nondeterministic_run=0)
    report = json.loads(tdiff_cli("bisect", out, "--json", expect=0).stdout)
    assert report["status"] == "match" and report["repeats"]["differing"] == []


def test_a_folder_that_is_not_a_repeat_folder_is_refused(tmp_path):
    (tmp_path / "plain").mkdir()
    result = tdiff_cli("bisect", tmp_path / "plain", expect=2)
    assert "not a repeat folder" in result.output and "Traceback" not in result.output


def test_repeat_folders_are_replaced_only_with_force(tmp_path):
    out = tmp_path / "rep"
    command = ["--", sys.executable, "-c", "import torch, tdiff; tdiff.dump('x', torch.ones(2))"]
    tdiff_cli("capture", "--out", out, "--repeat", 2, *command, expect=0)
    assert sorted(p.name for p in out.iterdir()) == ["run-1", "run-2", "tdiff-repeat.json", "tdiff.lock"]
    assert "already holds a dump" in tdiff_cli("capture", "--out", out, "--repeat", 3, *command, expect=2).output
    tdiff_cli("capture", "--out", out, "--repeat", 3, "--force", *command, expect=0)
    assert sorted(p.name for p in out.iterdir()) == ["run-1", "run-2", "run-3", "tdiff-repeat.json", "tdiff.lock"]
    assert "--repeat" in tdiff_cli("capture", "--out", tmp_path / "x", "--repeat", 0, *command, expect=2).output


def test_a_run_that_lacks_tensors_is_not_a_match_with_allow_incomplete(tmp_path):
    """run-2 repeats run-1 exactly; run-3 failed after the first module: its missing tensors make
    the folder differ, as `tdiff compare --allow-incomplete` says of run-1 against run-3."""
    import torch

    import tdiff
    from tdiff.store.repeats import write_repeat_index

    out = tmp_path / "rep"
    torch.manual_seed(0)
    first, second, x = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.randn(2, 4)
    for k, run in enumerate(write_repeat_index(out, 3, ["python", "run.py"])):
        try:
            with torch.no_grad(), tdiff.capture(run):
                y = first(x)
                if k == 2:
                    raise RuntimeError("the run dies here")
                second(y)
        except RuntimeError:
            pass
    tdiff_cli("compare", out / "run-1", out / "run-3", "--allow-incomplete", expect=1)
    report = json.loads(tdiff_cli("bisect", out, "--allow-incomplete", "--json", expect=1).stdout)
    assert report["status"] == "diverged" and report["first_divergence"] is None
    assert report["repeats"]["differing"] == ["run-3"]
    assert any("captured on one side only" in note for note in report["notes"])
