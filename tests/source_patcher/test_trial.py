"""`tdiff patch try` on planted faults in tiny real transformers models: the true fix ranks first
and the unpatched control still diverges."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from tdiff.bisect import BisectResult
from tdiff.source_patcher.trial import TrialReport
from tests.helpers import DEMO, REPO, tdiff_cli, tdiff_process

PLANTED = Path(__file__).with_name("planted.py")
pytestmark = pytest.mark.slow

BROKEN = {"name": "broken",  # a candidate whose run crashes
          "target": "examples.demo.run.bf16_rmsnorm_forward",
          "edits": [{"match": "return self.weight * hidden_states",
                     "prepend": "raise RuntimeError('broken candidate')"}]}


def demo_candidates() -> str:
    """The candidates the README's walkthrough tries, plus one that crashes."""
    candidates = yaml.safe_load((REPO / "examples" / "demo" / "candidates.yaml").read_text())
    candidates["patches"].append(BROKEN)
    return yaml.safe_dump(candidates, sort_keys=False, width=1 << 16)


def capture(out: Path, *command, patches: str | None = None, options=()):
    wrapper = ("patch", "apply", "--config", patches, "--", sys.executable, "-m", "tdiff") if patches else ()
    result = tdiff_process(*wrapper, "capture", "--out", out, *options, "--", *command, cwd=REPO)
    assert result.returncode == 0, result.stderr


def trial(candidates, baseline: Path, workdir: Path, *command, extra=()):
    result = tdiff_process("patch", "try", "--candidates", candidates, "--baseline", baseline, "--workdir", workdir,
                           "--json", *extra, "--", *command, cwd=REPO)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def by_name(report) -> dict:
    return {c["name"]: c for c in report["candidates"]}


def test_the_demos_bf16_rmsnorm_variance_is_fixed_by_the_true_candidate(tmp_path):
    capture(tmp_path / "a", sys.executable, DEMO, "--layers", "2")
    candidates = tmp_path / "candidates.yaml"
    candidates.write_text(demo_candidates())
    command_b = (sys.executable, "-c", "from examples.demo.run import main; main(['--planted', '--layers', '2'])")
    code, report = trial(candidates, tmp_path / "a", tmp_path / "work", *command_b)
    assert code == 0
    control = report["control"]
    assert control["status"] == "diverged"
    assert control["first_divergence"]["module"] == "model.layers.1.post_attention_layernorm"
    assert control["first_divergence"]["kind"] == "norm"  # the kind bisect names
    ranked = [c["name"] for c in report["candidates"]]
    assert ranked[:2] == ["fp32-variance", "fp32-variance-rounded"] and ranked[-1] == "broken"
    assert report["best"] == "fp32-variance"
    runs = by_name(report)
    assert runs["fp32-variance"]["status"] == "match" and runs["fp32-variance"]["mismatched"] == 0
    assert runs["fp32-variance"]["applied"] == ["fp32-variance"]
    assert runs["fp32-variance-rounded"]["moved_by"] == 0 and runs["fp32-variance-rounded"]["status"] == "diverged"
    assert runs["mlp-in-fp32"]["moved_by"] < 0 and runs["fp32-variance+mlp-in-fp32"]["moved_by"] < 0
    assert runs["broken"]["status"] == "error" and "broken candidate" in runs["broken"]["reason"]
    for run in report["candidates"]:
        assert {"name", "status", "first_divergence", "moved_by", "mismatched", "max_ulp"} <= set(run)
        assert Path(run["dump"]).parent == tmp_path / "work" and Path(run["log"]).is_file()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("baseline") / "a"
    capture(out, sys.executable, PLANTED)
    return out


@pytest.mark.parametrize("fault, fix, other, boundary", [
    ("logsoftmax-bf16", "logsoftmax-fp32", "rope-fp32", "logprobs"),
    ("rope-bf16", "rope-fp32", "logsoftmax-fp32", "model.rotary_emb["),
])
def test_a_planted_fault_is_fixed_by_its_catalogue_entry(tmp_path, baseline, fault, fix, other, boundary):
    code, report = trial(f"builtin:{other},{fix}", baseline, tmp_path / "work", sys.executable, PLANTED,
                         "--fault", fault)
    assert code == 0 and report["best"] == fix
    assert report["control"]["status"] == "diverged"
    assert report["control"]["first_divergence"]["name"].startswith(boundary)
    assert by_name(report)[other]["status"] == "diverged"


def test_a_bf16_residual_add_is_fixed_by_the_fp32_residual_contract(tmp_path):
    # the reference carries its residual stream in fp32; run B adds in bf16 (transformers' default)
    capture(tmp_path / "a", sys.executable, PLANTED, patches="builtin:residual-fp32")
    code, report = trial("builtin:rmsnorm-fp32,residual-fp32", tmp_path / "a", tmp_path / "work",
                         sys.executable, PLANTED)
    assert code == 0 and report["best"] == "residual-fp32"
    first = report["control"]["first_divergence"]   # the fp32 sum reaching layer 0's second norm
    assert first["module"] == "model.layers.0.post_attention_layernorm" and first["role"] == "input"


def row_alone_equals_row_in_batch(*modes: str) -> bool:
    """Measured here, on this CPU's kernels and without tdiff: with the override ``modes`` on, does
    the first sequence scored inside a batch of 4 give the bits of that sequence scored alone under
    every batch-invariant override (the baseline)? Which ops depend on the batch is the kernels'
    choice (AVX2 and AVX-512 differ), so the verdicts the test expects are measured, never assumed."""
    import torch

    from tdiff.source_patcher.fixes import aten
    from tests.source_patcher.planted import build, score

    network = build("qwen2", torch.float32, "none")
    everything = [aten.enable(mode) for mode in (aten.BATCH_INVARIANT_MATMUL, aten.BATCH_INVARIANT_MEAN,
                                                 aten.BATCH_INVARIANT_LOG_SOFTMAX)]
    try:
        alone = score(network, batch=1, tokens=12, fault="none")
    finally:
        for disable in everything:
            disable()
    chosen = [aten.enable(mode) for mode in modes]
    try:
        in_batch = score(network, batch=4, tokens=12, fault="none")
    finally:
        for disable in chosen:
            disable()
    return torch.equal(alone.view(torch.int32), in_batch.view(torch.int32))


def test_batch_invariant_overrides_make_a_row_in_a_batch_match_the_row_alone(tmp_path):
    from tdiff.source_patcher.fixes import aten

    only_logprobs = ("--select", "^no-module$")
    capture(tmp_path / "a", sys.executable, PLANTED, "--dtype", "float32", patches="builtin:batch-invariant",
            options=only_logprobs)
    candidates = {"batch-invariant-mean": aten.BATCH_INVARIANT_MEAN,
                  "batch-invariant-matmul": aten.BATCH_INVARIANT_MATMUL}
    code, report = trial("builtin:" + ",".join(candidates), tmp_path / "a", tmp_path / "work",
                         sys.executable, PLANTED, "--dtype", "float32", "--batch", "4", extra=only_logprobs)
    expected = {name: "match" if row_alone_equals_row_in_batch(mode) else "diverged"
                for name, mode in candidates.items()}
    assert report["control"]["status"] == ("match" if row_alone_equals_row_in_batch() else "diverged")
    assert {name: run["status"] for name, run in by_name(report).items()} == expected
    matching = [name for name in candidates if expected[name] == "match"]
    assert code == (0 if matching else 1)
    if matching:  # among equal matches the first listed ranks first (both are one patch)
        assert report["best"] == matching[0]


def test_a_shared_fix_reruns_side_a_and_compares_every_module_of_the_batch_row(tmp_path):
    # the baseline is the lone row, unpatched; each candidate runs on both sides (--rerun-baseline)
    # and only row 0 of the batched run is captured (--batch-row), so every module is compared.
    # (On this CPU a row scored inside a batch of 4 equals the row alone, bit for bit, so the
    # control matches too; on a GPU it does not: docs/GPU.md.)
    from tdiff.store import open_dump

    alone = (sys.executable, str(PLANTED), "--dtype", "float32")
    capture(tmp_path / "a", *alone)
    code, report = trial("builtin:batch-invariant-matmul", tmp_path / "a", tmp_path / "work", *alone, "--batch", "4",
                         extra=("--batch-row", "0", "--rerun-baseline", " ".join(alone)))
    assert code == 0 and report["control"]["status"] == "match"
    (candidate,) = report["candidates"]
    assert candidate["status"] == "match" and candidate["applied"] == ["batch-invariant-matmul.aten"]
    side_a, side_b = open_dump(candidate["dump"] + ".baseline"), open_dump(candidate["dump"])
    assert [(r.name, r.shape) for r in side_a.records] == [(r.name, r.shape) for r in side_b.records]
    assert side_b.records[0].shape[0] == 1 and len(side_b.records) > 50


def test_no_candidate_matching_exits_1_and_a_stale_candidate_exits_2(tmp_path, baseline):
    code, report = trial("builtin:rope-fp32", baseline, tmp_path / "work", sys.executable, PLANTED,
                         "--fault", "logsoftmax-bf16")
    assert code == 1 and report["best"] == "rope-fp32" and report["candidates"][0]["status"] == "diverged"
    stale = tmp_path / "stale.yaml"
    stale.write_text("patches:\n  - name: gone\n    target: examples.demo.run.bf16_rmsnorm_forward\n"
                     "    edits:\n      - match: 'no such line'\n        replacement: 'pass'\n")
    result = tdiff_cli("patch", "try", "--candidates", stale, "--baseline", baseline, "--", "true", expect=2)
    assert "patch 'gone'" in result.output and "match not found" in result.output


def test_bisect_try_builtin_trials_the_catalogue_entries_for_the_culprits_kind(tmp_path):
    capture(tmp_path / "a", sys.executable, PLANTED)
    capture(tmp_path / "b", sys.executable, PLANTED, "--fault", "logsoftmax-bf16")
    result = tdiff_process("bisect", tmp_path / "a", tmp_path / "b", "--json", "--try", "builtin",
                           "--run-b", f"{sys.executable} {PLANTED} --fault logsoftmax-bf16", cwd=REPO)
    assert result.returncode == 1, result.stderr
    found = json.loads(result.stdout)
    assert found["first_divergence"]["kind"] == "logprobs"
    trials = found["trials"]
    assert trials["best"] == "logsoftmax-fp32" and trials["control"]["status"] == "diverged"
    assert by_name(trials)["logsoftmax-fp32"]["status"] == "match"
    assert "logsoftmax-fp32" in result.stderr  # progress, one line per run
    # the printed JSON reads back into the typed result, trials included, and writes out as printed
    assert BisectResult.from_json(found).to_json() == found
    assert TrialReport.from_json(trials) == BisectResult.from_json(found).trials
