"""Hugging Face transformers vs megatron-core with converted weights, through `tdiff compare`."""

import pytest

from tdiff.align import choose_pairing
from tdiff.compare import CompareOptions, Tolerance, compare_dumps
from tdiff.report.model import build_report
from tdiff.store import open_dump
from tests.align.conftest import by_name, compare_json
from tests.helpers import tdiff_cli

pytestmark = pytest.mark.slow

MODEL_LEVEL = ["input_ids", "positions", "embedding", "final_norm", "logits"]
ATTENTION = ["input_norm", "attn.q", "attn.k", "attn.v", "attn.core", "attn.out", "attn.residual", "pre_mlp_norm",
             "output"]
DENSE = ["mlp.gate", "mlp.up", "mlp.act", "mlp.down"]
MOE = ["attn.q_norm", "attn.k_norm", "moe.topk_ids", "moe.topk_weights", "moe.combine", "moe.out"]
HF_HIDES = {"attn.q_rope", "attn.k_rope"}


def expected(per_layer: list[str]) -> set[str]:
    return set(MODEL_LEVEL) | {f"layers.{n}.{b}" for n in range(2) for b in ATTENTION + per_layer}


@pytest.mark.parametrize("model, per_layer, hf_hides, megatron_hides", [
    ("qwen2", DENSE, HF_HIDES, set()),
    ("llama", DENSE, HF_HIDES, set()),
    ("qwen3_moe", MOE, HF_HIDES | {"moe.dispatch", "moe.experts"}, {"moe.router"}),
])
def test_every_canonical_boundary_aligns_within_fp32_tolerance(dumps, model, per_layer, hf_hides, megatron_hides):
    report = compare_json(dumps[f"hf:{model}"], dumps[f"megatron:{model}"], "--atol", "1e-5", expect=0)
    tensors = by_name(report)
    assert set(tensors) == expected(per_layer)
    assert all(t["status"] == "match" and t["metrics"]["max_abs"] < 1e-5 for t in tensors.values())
    alignment = report["alignment"]
    assert alignment["a"]["adapter"] == "Hugging Face transformers" and alignment["b"]["adapter"] == "Megatron-core"
    assert set(alignment["a"]["not_exposed"]) == hf_hides
    assert set(alignment["b"]["not_exposed"]) == megatron_hides
    assert all(entry["skipped"] == 2 and entry["reason"] for entry in alignment["a"]["not_exposed"].values())
    for side in "ab":
        assert alignment[side]["unmatched"] == [] and alignment[side]["unresolved"] == []
        assert alignment[side]["unmapped"], "tensors outside the vocabulary are listed, not dropped"


def test_plan_shows_how_megatron_tensors_were_aligned(dumps):
    report = compare_json(dumps["hf:qwen2"], dumps["megatron:qwen2"], "--atol", "1e-5")
    q = by_name(report)["layers.0.attn.q"]
    assert q["kind"] == "linear"
    assert q["plan"]["a"] == ["model.layers.0.self_attn.q_proj", "[batch, seq, ...] -> [tokens, features]"]
    assert q["plan"]["b"][0] == "decoder.layers.0.self_attention.linear_qkv[0]"
    assert "ordered per query group" in q["plan"]["b"][1]
    assert q["plan"]["b"][2] == "[seq, batch, ...] -> [tokens, features]"
    topk = by_name(compare_json(dumps["hf:qwen3_moe"], dumps["megatron:qwen3_moe"], "--atol", "1e-5"))
    assert "routing map" not in topk["layers.0.moe.topk_ids"]["plan"]["a"][0]
    assert any("natural token order" in step for step in topk["layers.0.moe.topk_ids"]["plan"]["b"])


def test_a_planted_weight_change_is_found_at_its_boundary(dumps):
    """The Megatron twin with one weight of layer 1's down projection changed."""
    report = compare_json(dumps["hf:qwen2"], dumps["planted:qwen2"], "--atol", "1e-5", expect=1)
    first = report["first_divergence"]
    assert (first["name"], first["kind"]) == ("layers.1.mlp.down", "linear")
    assert by_name(report)["layers.1.mlp.act"]["status"] == "match"


def test_text_report_names_what_a_framework_does_not_expose(dumps):
    result = tdiff_cli("compare", dumps["hf:qwen3_moe"], dumps["megatron:qwen3_moe"], "--atol", "1e-5", expect=0)
    assert "aligned by canonical boundary" in result.output
    assert "not exposed by A (Hugging Face transformers), 2 not compared: attn.q_rope" in result.output
    assert "not exposed by B (Megatron-core), 2 not compared: moe.router" in result.output


def test_a_cross_framework_report_keeps_its_culprits_per_token_plot(dumps, tmp_path):
    """The comparison carries its canonical pairing, and the report reloads the culprit through it:
    paired again by name, `layers.1.mlp.down` (no record's name) would not be found."""
    hf, planted = open_dump(dumps["hf:qwen2"]), open_dump(dumps["planted:qwen2"])
    compared = compare_dumps(hf, planted, CompareOptions(tolerance=Tolerance(atol=1e-5)),
                             pairing=choose_pairing(hf, planted))
    culprit = build_report(compared).culprit
    assert culprit.comparison.name == "layers.1.mlp.down" and culprit.tokens_note is None
    tokens = culprit.tokens
    assert max(tokens.max_abs) > 1e-5 and tokens.tokens_differ > 0
    tdiff_cli("report", dumps["hf:qwen2"], dumps["planted:qwen2"], "--atol", "1e-5", "--format", "html",
              "-o", tmp_path / "r.html", expect=1)
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert 'id="plot-tokens"' in page and "No per-token plot" not in page
