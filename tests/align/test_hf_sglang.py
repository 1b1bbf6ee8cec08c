"""Hugging Face transformers vs SGLang's model classes (run on the CPU), through `tdiff compare`."""

import pytest

from tests.align.conftest import by_name, compare_json
from tests.align.test_hf_megatron import ATTENTION, DENSE, MOE

pytestmark = pytest.mark.slow

MODEL_LEVEL = ["input_ids", "positions", "embedding", "final_norm"]


@pytest.mark.parametrize("model, per_layer", [("qwen2", DENSE), ("qwen3_moe", MOE + ["moe.router"])])
def test_every_canonical_boundary_aligns_within_fp32_tolerance(dumps, model, per_layer):
    report = compare_json(dumps[f"hf1:{model}"], dumps[f"sglang:{model}"], "--atol", "1e-5", expect=0)
    tensors = by_name(report)
    assert set(tensors) == set(MODEL_LEVEL) | {f"layers.{n}.{b}" for n in range(2) for b in ATTENTION + per_layer}
    assert all(t["status"] == "match" and t["metrics"]["max_abs"] < 1e-5 for t in tensors.values())
    alignment = report["alignment"]
    assert alignment["b"]["adapter"] == "SGLang"
    assert set(alignment["a"]["not_exposed"]) == {"attn.q_rope", "attn.k_rope"}
    assert set(alignment["b"]["not_exposed"]) == {"logits"}
    assert all(alignment[side]["unmatched"] == [] and alignment[side]["unresolved"] == [] for side in "ab")


def test_sglang_residual_stream_is_rebuilt_from_its_fused_norms(dumps):
    tensors = by_name(compare_json(dumps["hf1:qwen2"], dumps["sglang:qwen2"], "--atol", "1e-5"))
    assert tensors["layers.0.attn.residual"]["plan"]["b"][0] == "model.layers.0.post_attention_layernorm[1]"
    # layer 0's output is the residual the next layer's input norm returns; the last layer's
    # output is rebuilt as post-attention residual + MLP output
    assert tensors["layers.0.output"]["plan"]["b"][0] == "model.layers.1.input_layernorm[1]"
    assert tensors["layers.1.output"]["plan"]["b"][0].startswith(
        "model.layers.1.post_attention_layernorm[1] + model.layers.1.mlp (residual stream rebuilt")


@pytest.mark.parametrize("model, per_layer, megatron_hides", [
    ("qwen2", DENSE, set()), ("qwen3_moe", MOE, {"moe.router"})])
def test_megatron_trainer_against_sglang_engine(dumps, model, per_layer, megatron_hides):
    """The pair tdiff is for; both expose q and k after RoPE (SGLang through its one rotary
    module shared by all layers, whose calls belong to the calling attention module)."""
    report = compare_json(dumps[f"megatron1:{model}"], dumps[f"sglang:{model}"], "--atol", "1e-5", expect=0)
    tensors = by_name(report)
    rope = {f"layers.{n}.attn.{b}" for n in range(2) for b in ("q_rope", "k_rope")}
    assert set(tensors) == set(MODEL_LEVEL) | rope | {f"layers.{n}.{b}" for n in range(2)
                                                      for b in ATTENTION + per_layer}
    # the shared module is named after its first owner; the match shows each call went to its layer
    assert tensors["layers.1.attn.q_rope"]["plan"]["b"][0] == "model.layers.0.self_attn.rotary_emb[0]"
    assert tensors["layers.1.attn.q_rope"]["status"] == "match"
    alignment = report["alignment"]
    assert set(alignment["a"]["not_exposed"]) == megatron_hides
    hidden = {"logits"} | ({"moe.dispatch", "moe.experts"} if model == "qwen3_moe" else set())
    assert set(alignment["b"]["not_exposed"]) == hidden
