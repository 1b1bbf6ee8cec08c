"""Online bisection: `tdiff bisect --run-a CMD --run-b CMD` drives the captures itself."""

import json
import math
import re
import shlex
import sys

import pytest

from tests.helpers import DEMO, REPO, tdiff_cli, tdiff_process

PYTHON = shlex.quote(sys.executable)
DEMO_CMD = f"{PYTHON} {shlex.quote(str(DEMO))}"
AMPLIFY = f"cd {shlex.quote(str(REPO))} && {PYTHON} -m tests.bisect.programs amplify"


def bisect(*args, expect):
    result = tdiff_cli("bisect", *args, "--json", expect=expect)
    return json.loads(result.stdout), result.stderr


@pytest.mark.slow
def test_the_demos_planted_norm_is_named_after_a_stats_pass_and_grafting_proves_the_op(tmp_path):
    report, progress = bisect("--run-a", DEMO_CMD, "--run-b", f"{DEMO_CMD} --planted", "--graft",
                              "--work", tmp_path / "w", expect=1)
    d = report["first_divergence"]
    assert (d["module"], d["kind"], d["event"], d["introduced"], d["layer"]) == (
        "model.layers.1.post_attention_layernorm", "norm", "output", True, 1)
    assert d["metrics"]["max_ulp"] >= 1 and 0 < d["metrics"]["mismatch_fraction"] <= 1
    # the planted norm's own code: its ops, recorded once more per side, name the op and line
    assert d["op"]["function_b"] == "bf16_rmsnorm_forward" and d["op"]["source_b"].startswith("run.py:")
    runs = report["runs"]
    assert (runs["a"], runs["b"]) == (3, 4) and runs["boundaries"] is None
    assert [(r["side"], r["purpose"]) for r in runs["log"]] == [
        ("A", "stats pass"), ("B", "stats pass"), ("A", "final capture"), ("B", "final capture"),
        ("A", "ops"), ("B", "ops"), ("B", "graft")]
    graft = report["graft"]
    assert (graft["module"], graft["verdict"]) == ("model.layers.1.post_attention_layernorm", "op_differs")
    assert graft["metrics"]["max_ulp"] >= 1
    assert "run A1 (stats pass)" in progress and (tmp_path / "w" / "b4-graft").is_dir()


@pytest.mark.slow
def test_a_16_layer_model_without_stats_pass_takes_at_most_log2_boundaries_plus_2_runs_per_side(tmp_path):
    result = tdiff_process("bisect", "--run-a", f"{DEMO_CMD} --layers 16",
                           "--run-b", f"{DEMO_CMD} --layers 16 --planted", "--no-stats-pass")
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert "introduced at model.layers.1.post_attention_layernorm (norm, layer 1)" in out
    # 16 decoder layers, the outermost model's output and the explicit log-probs dump
    boundaries = 18
    bound = math.ceil(math.log2(boundaries)) + 2
    assert f"binary search over {boundaries} boundaries: at most {bound} runs per side" in out
    runs_line = next(line for line in out.splitlines() if line.startswith("runs: "))
    a_runs, b_runs = (int(part.split()[1]) for part in runs_line.split("(")[0][6:].split(", "))
    ops_runs = len(re.findall(r"^  A\d+ ops: ", out, re.MULTILINE))
    assert ops_runs == 1  # the norm's own code: one more run per side names its op
    assert a_runs - ops_runs <= bound and b_runs - ops_runs <= bound
    assert a_runs == b_runs + 1  # the discovery run is side A's only
    assert out.count(" probe: ") == 2 * (a_runs - ops_runs - 2)


@pytest.mark.slow
def test_a_tolerance_searches_and_graft_tells_an_amplifier_from_the_op_that_made_the_difference(tmp_path):
    report, progress = bisect("--run-a", AMPLIFY, "--run-b", f"{AMPLIFY} --split-k", "--atol", "1e-5",
                              "--rtol", "0", "--graft", expect=1)
    assert "stats pass skipped (fingerprints cannot judge --atol/--rtol/--ulp)" in progress
    d = report["first_divergence"]
    # `proj` differs by less than 1e-5; `amplify` scales that past the tolerance
    assert (d["module"], d["event"]) == ("amplify", "output")
    assert report["graft"]["verdict"] == "inputs_only"
    assert d["introduced"] is False
    # `amplify`'s own code made the difference beyond the tolerance: its op is named too
    assert [r["purpose"] for r in report["runs"]["log"] if r["side"] == "A"] == [
        "discovery", "probe", "final capture", "ops"]
    assert d["op"]["name"] == "aten::mul.Tensor" and d["op"]["function"] == "forward"


def test_identical_commands_match(tmp_path):
    report, _ = bisect("--run-a", AMPLIFY, "--run-b", AMPLIFY, expect=0)
    assert report["status"] == "match" and report["first_divergence"] is None
    assert report["runs"]["a"] == report["runs"]["b"] == 1


@pytest.mark.slow
def test_offline_graft_reruns_side_b_only(tmp_path):
    for side, flag in (("a", ""), ("b", " --split-k")):
        result = tdiff_process("capture", "--out", tmp_path / side, "--", "/bin/sh", "-c", AMPLIFY + flag)
        assert result.returncode == 0, result.stderr
    report, _ = bisect(tmp_path / "a", tmp_path / "b", expect=1)
    assert report["first_divergence"]["module"] == "proj" and "runs" not in report
    report, _ = bisect(tmp_path / "a", tmp_path / "b", "--graft", "--run-b", f"{AMPLIFY} --split-k", expect=1)
    assert report["graft"]["verdict"] == "op_differs" and report["graft"]["module"] == "proj"
    assert (report["runs"]["a"], report["runs"]["b"]) == (0, 1)


# The demo's decoder layer with everything in it takes about 65 KB per side; the planted norm
# with the calls around it about 10 KB, the layer's children without their insides about 20 KB.
BUDGET_GB = "3e-5"  # 32 KB


@pytest.mark.slow
def test_a_budget_shrinks_the_full_capture_after_a_stats_pass(tmp_path):
    report, _ = bisect("--run-a", DEMO_CMD, "--run-b", f"{DEMO_CMD} --planted", "--budget-gb", BUDGET_GB,
                       "--work", tmp_path / "w", expect=1)
    assert report["first_divergence"]["module"] == "model.layers.1.post_attention_layernorm"
    assert report["first_divergence"]["metrics"]["max_ulp"] >= 1
    final = next(r for r in report["runs"]["log"] if r["purpose"] == "final capture")
    assert "model.layers.1.post_attention_layernorm and everything in it" in final["why"]
    assert "model.layers.1 and everything in it" not in final["why"]


@pytest.mark.slow
def test_a_budget_too_small_for_any_region_reports_the_stats_verdict_without_metrics(tmp_path):
    report, _ = bisect("--run-a", DEMO_CMD, "--run-b", f"{DEMO_CMD} --planted", "--budget-gb", "1e-9",
                       expect=1)
    d = report["first_divergence"]
    assert (d["module"], d["kind"]) == ("model.layers.1.post_attention_layernorm", "norm")
    assert d["metrics"] == {"max_abs": None, "max_ulp": None, "max_ulp_at_scale": None, "mismatch_fraction": None,
                            "outside_fraction": None,
                            "cosine": None}
    assert "fingerprints differ" in d["reason"]
    assert any("larger than --budget-gb" in note for note in report["notes"])
    # the ops run stores no tensor (stats mode): the budget does not stop it naming the op
    assert [r["purpose"] for r in report["runs"]["log"]] == ["stats pass", "stats pass", "ops", "ops"]
    assert d["op"] is not None


@pytest.mark.slow
def test_a_budget_after_a_search_measures_the_layer_and_captures_its_children_only(tmp_path):
    report, _ = bisect("--run-a", f"{DEMO_CMD} --layers 2", "--run-b", f"{DEMO_CMD} --layers 2 --planted",
                       "--no-stats-pass", "--budget-gb", BUDGET_GB, expect=1)
    d = report["first_divergence"]
    assert (d["module"], d["kind"], d["event"]) == ("model.layers.1.post_attention_layernorm", "norm", "output")
    log = [r for r in report["runs"]["log"] if r["purpose"] != "ops"]
    purposes = [r["purpose"] for r in log if r["side"] == "A"]
    assert purposes[0] == purposes[-2] == "discovery" and purposes[-1] == "final capture"
    assert "sizes inside `model.layers.1`" in log[-3]["why"]
    assert "everything in it" not in log[-1]["why"]


@pytest.mark.slow
def test_exclude_leaves_the_planted_norm_out_of_every_run_compared(tmp_path):
    report, _ = bisect("--run-a", DEMO_CMD, "--run-b", f"{DEMO_CMD} --planted", "--exclude", "post_attention_layernorm",
                       expect=1)
    d = report["first_divergence"]
    assert "post_attention_layernorm" not in d["name"] and d["layer"] == 1


ZOOM = f"cd {shlex.quote(str(REPO))} && {PYTHON} -m tests.bisect.programs zoom"


@pytest.mark.slow
@pytest.mark.parametrize(("case", "module", "kind", "function_b"), [
    ("rope", "model.layers.0.self_attn", "rope", "bf16_apply_rotary_pos_emb"),
    ("softmax", "model.layers.0.self_attn", "attention", "bf16_softmax_eager_attention"),
    ("residual", "model.layers.1", "residual", "forward"),
    ("moe", "model.layers.1.mlp.experts", "moe_combine", "forward"),
    ("bda", "decoder.layers.0", "residual", "bf16_bias_dropout_add"),
])
def test_the_two_commands_alone_name_the_planted_op_its_function_and_line(case, module, kind, function_b):
    report, _ = bisect("--run-a", f"{ZOOM} {case}", "--run-b", f"{ZOOM} {case} --planted", expect=1)
    d = report["first_divergence"]
    assert (d["module"], d["kind"]) == (module, kind)
    op = d["op"]
    assert op is not None and op["function_b"] == function_b and op["source_b"].startswith("planted.py:")
    assert op["name"].startswith("aten::") and op["source"].split(":")[1].isdigit()
    assert [r["purpose"] for r in report["runs"]["log"]][-2:] == ["ops", "ops"]
    assert f"--ops ^{re.escape(module)}$" in report["runs"]["log"][-1]["why"]


def token_program(layout: str, *flags: str) -> str:
    """tests.align.token_layouts under capture: its sequences scored by a trainer, or rolled out by
    an engine (prefill, then decode steps): runs of two token layouts, aligned by token."""
    return f"cd {shlex.quote(str(REPO))} && {PYTHON} -m tests.align.token_layouts {layout} {' '.join(flags)}"


@pytest.mark.slow
@pytest.mark.parametrize("search", [False, True], ids=["stats-pass", "search"])
def test_online_runs_aligned_by_token_fail_closed_on_tokens_left_uncompared(tmp_path, search):
    """Coverage is part of the online verdict as of compare's: the engine's third forward has no token
    metadata, so its rows cannot be located; a match exits 2 saying so unless --allow-unaligned,
    and a real divergence still exits 1."""
    flags = ["--no-stats-pass"] if search else []
    trainer, engine = token_program("trainer"), token_program("engine", "--no-tokens", "2")
    assert bisect("--run-a", trainer, "--run-b", token_program("engine"), *flags, expect=0)[0]["status"] == "match"
    refused = tdiff_cli("bisect", "--run-a", trainer, "--run-b", engine, *flags, expect=2)
    assert re.search(r"tdiff: error: \d+ tensor-tokens fed by both runs were not compared; first: hidden seq "
                     r"\S+/\S+ position \S+: side B's step 3 has no token metadata on rank 0; --allow-unaligned "
                     "accepts that", refused.output), refused.output
    allowed, _ = bisect("--run-a", trainer, "--run-b", engine, *flags, "--allow-unaligned", expect=0)
    assert any(re.match(r"\d+ tensor-tokens fed by both runs were not compared; first: hidden", note)
               for note in allowed["notes"]), allowed["notes"]
    assert allowed["runs"]["log"][-1]["purpose"] == "final capture"   # every boundary, in full: rows to align
    planted, _ = bisect("--run-a", trainer, "--run-b", token_program("engine", "--no-tokens", "2", "--planted", "r1:3"),
                        *flags, expect=1)
    first = planted["first_divergence"]
    assert first["name"] == "hidden" and first["token"]["position"] == 3, first
    assert any("tensor-tokens fed by both runs were not compared" in note for note in planted["notes"])
