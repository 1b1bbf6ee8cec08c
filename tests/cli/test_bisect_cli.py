"""tdiff bisect through click's CliRunner and as a subprocess: the JSON contract, exit codes,
one-line errors."""

import json
import sys

import pytest
import torch

import tdiff
from tests.helpers import planted_norm_dumps, tdiff_cli, tdiff_process, tiny_qwen2, token_ids

CONTRACT = {"name", "module", "module_b", "layer", "kind", "step", "event", "introduced", "metrics"}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return planted_norm_dumps(tmp_path_factory.mktemp("dumps"))


def test_json_keeps_the_contract_and_the_exit_code_says_diverged(dumps):
    a, b = dumps
    report = json.loads(tdiff_cli("bisect", a, b, "--json", expect=1).stdout)
    assert report["status"] == "diverged"
    first = report["first_divergence"]
    assert CONTRACT <= set(first)
    assert set(first["metrics"]) == {"max_abs", "max_ulp", "max_ulp_at_scale", "mismatch_fraction",
                                     "outside_fraction", "cosine"}
    assert (first["module"], first["module_b"], first["layer"], first["kind"], first["step"],
            first["event"], first["introduced"]) == (
        "model.layers.1.post_attention_layernorm", "model.layers.1.post_attention_layernorm", 1, "norm", 0,
        "output", True)
    assert isinstance(report["checked"], int) and report["checked"] > 0
    assert [t["module"] for t in report["trail"]] == ["model.layers.1", "model", ""]


def test_match_exits_0_with_status_match(dumps):
    a, _ = dumps
    report = json.loads(tdiff_cli("bisect", a, a, "--json", expect=0).stdout)
    assert report["status"] == "match" and report["first_divergence"] is None and report["trail"] == []
    assert "match: all" in tdiff_cli("bisect", a, a, expect=0).output


def test_the_summary_names_the_culprit(dumps):
    a, b = dumps
    output = tdiff_cli("bisect", a, b, expect=1).output
    assert "diverged: introduced at model.layers.1.post_attention_layernorm (norm, layer 1)" in output
    assert "enclosing modules that diverged too: model.layers.1" in output


@pytest.mark.parametrize("args, message", [
    ((), "give two dumps"),
    (("{a}", "{b}", "--run-a", "x"), "not both"),
    (("--run-a", "x"), "--run-a needs --run-b"),
    (("{a}", "{b}", "--graft"), "--graft and --try on two dumps need --run-b"),
    (("{a}", "{b}", "--try", "builtin"), "--graft and --try on two dumps need --run-b"),
    (("{a}", "{b}", "--no-stats-pass"), "apply to online bisection"),
    (("{a}", "{b}", "--exact", "--atol", "1"), "--exact cannot be combined"),
    (("--run-a", "x", "--run-b", "y", "--budget-gb", "0"), "--budget-gb must be a positive"),
    (("{a}", "{missing}"), "no such dump directory"),
])
def test_usage_errors_exit_2_with_one_line(dumps, tmp_path, args, message):
    a, b = dumps
    filled = [arg.format(a=a, b=b, missing=tmp_path / "missing") for arg in args]
    result = tdiff_cli("bisect", *filled, expect=2)
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_failing_command_is_reported_in_one_line(tmp_path):
    result = tdiff_cli("bisect", "--run-a", "exit 3", "--run-b", "exit 3", "--work", tmp_path / "w", expect=2)
    assert "run A1 (stats pass) failed: the command exited with code 3" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_quiet_hides_the_runs_progress_and_the_note_on_removed_captures():
    run = f"{sys.executable} -c 'import torch, tdiff; tdiff.dump(\"x\", torch.ones(2))'"
    loud = tdiff_cli("bisect", "--run-a", run, "--run-b", run, expect=0)
    assert "run A1 (stats pass)" in loud.stderr and "pass --workdir DIR to keep them" in loud.stdout
    quiet = tdiff_cli("bisect", "--run-a", run, "--run-b", run, "--quiet", expect=0)
    assert quiet.stderr == "" and "--workdir" not in quiet.stdout
    assert quiet.stdout.startswith("match: all 1 events compared are equal")


def test_as_a_subprocess(dumps):
    a, b = dumps
    result = tdiff_process("bisect", a, b, "--json")
    assert result.returncode == 1 and json.loads(result.stdout)["status"] == "diverged"


def capture_in_small_shards(path, model, plant=None):
    handle = model.get_submodule(plant).register_forward_hook(lambda m, args, out: out * 1.01) if plant else None
    with torch.no_grad(), tdiff.capture(path, shard_bytes=8000):
        model(token_ids())
    if handle is not None:
        handle.remove()
    return path


def drop_the_shard_of(dump_path, name: str) -> set[str]:
    """Delete the shard holding ``name``'s output; the names of the records it held."""
    from tdiff.store import open_dump

    records = open_dump(dump_path).records
    shard = next(r.file for r in records if r.name == name and r.role == "output")
    (dump_path / "data" / shard).unlink()
    return {r.name for r in records if r.file == shard}


def test_with_allow_incomplete_a_missing_tensor_is_reported_missing_never_named_the_culprit(tmp_path):
    model = tiny_qwen2()
    a = capture_in_small_shards(tmp_path / "a", model)
    planted = "model.layers.1.mlp.up_proj"
    b = capture_in_small_shards(tmp_path / "b", model, plant=planted)
    lost = drop_the_shard_of(b, "model.layers.0.mlp.up_proj")
    assert lost and not any(name.startswith("model.layers.1.") for name in lost)

    report = json.loads(tdiff_cli("bisect", a, b, "--allow-incomplete", "--json", expect=1).stdout)
    first = report["first_divergence"]
    assert (first["module"], first["event"], first["introduced"]) == (planted, "output", True)
    assert any("captured on one side only were not compared" in note for note in report["notes"])

    # nothing differs but the missing tensors: reported, exit 1 as compare says, and no op named
    clean = capture_in_small_shards(tmp_path / "clean", model)
    drop_the_shard_of(clean, "model.layers.0.mlp.up_proj")
    report = json.loads(tdiff_cli("bisect", a, clean, "--allow-incomplete", "--json", expect=1).stdout)
    assert report["status"] == "diverged" and report["first_divergence"] is None
    assert any("captured on one side only" in note and "side A only" in note for note in report["notes"])
    assert tdiff_cli("compare", a, clean, "--allow-incomplete", expect=1)
    text = tdiff_cli("bisect", a, clean, "--allow-incomplete", expect=1).output
    assert "missing on one side" in text and "no op is named" in text
    report_text = tdiff_cli("report", a, clean, "--allow-incomplete", "--bisect", expect=1).stdout
    assert "tensors are missing on one side, so no op is named" in report_text.split("### Bisect")[1]
