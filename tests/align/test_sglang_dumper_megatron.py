"""Dumps written by SGLang's own dumper (of a Megatron model, and of an SGLang model) against tdiff captures."""

import json

import pytest

from tests.align.conftest import by_name, compare_json
from tests.helpers import tdiff_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model", ["qwen2", "qwen3_moe"])
def test_dumper_output_compares_against_a_tdiff_capture(dumps, model):
    dumper_dir = dumps[f"dumper:{model}"] / model
    report = compare_json(dumper_dir, dumps.root / f"dumper-tdiff-{model}", expect=0)   # bitwise: one run
    tensors = by_name(report)
    assert {"layers.1.attn.q", "layers.1.attn.q_rope", "layers.1.output", "logits"} <= set(tensors)
    assert all(t["status"] == "match" for t in tensors.values())
    # the dumper names Megatron's (out, None) like a bare tensor; the plan still finds it
    assert tensors["layers.0.attn.out"]["plan"]["a"][0] == "decoder.layers.0.self_attention.linear_proj"
    alignment = report["alignment"]
    assert alignment["a"]["adapter"] == "Megatron-core" and alignment["a"]["unmatched"] == []
    uncertain = {entry["name"] for entry in alignment["a"]["uncertain"]}
    if model == "qwen2":
        # without recorded classes, the IdentityOp q/k norms of the local spec cannot be told
        # from real ones: reported, not compared
        assert uncertain == {f"layers.{n}.attn.{p}_norm" for n in range(2) for p in "qk"}
    else:
        assert uncertain == set() and tensors["layers.0.attn.q_norm"]["status"] == "match"
        assert tensors["layers.0.moe.dispatch"]["status"] == "match"


@pytest.mark.parametrize("model, per_layer", [("qwen2", ()), ("qwen3_moe", ("attn.q_norm", "moe.topk_ids"))])
def test_sglang_dumper_output_of_an_sglang_model_matches_megatron(dumps, model, per_layer):
    """SGLang's dumper tags each call of the one rotary module all layers share with the layer id
    of its caller: every layer's RoPE boundaries pair with Megatron's, whichever side is A. With
    no module classes recorded, the SGLang adapter is picked because it builds the most
    boundaries (transformers shares most module names); the dumper numbers TopKOutput's fields."""
    sglang, megatron = dumps[f"sgldumper:{model}"] / model, dumps[f"megatron1:{model}"]
    compare_json(megatron, sglang, "--atol", "1e-5", expect=0)
    report = compare_json(sglang, megatron, "--atol", "1e-5", expect=0)
    tensors = by_name(report)
    expected = {f"layers.{n}.{b}" for n in range(2) for b in ("attn.q_rope", "attn.k_rope", "attn.q", *per_layer)}
    assert expected <= set(tensors) and all(t["status"] == "match" for t in tensors.values())
    assert tensors["layers.1.attn.q_rope"]["plan"]["a"][0] == "model.layers.0.self_attn.rotary_emb[0]"
    assert report["alignment"]["a"]["adapter"] == "SGLang" and report["alignment"]["a"]["unmatched"] == []


@pytest.mark.parametrize("fault, boundary, kind", [("rope1", "layers.1.attn.q_rope", "rope"),
                                                   ("attn1", "layers.1.attn.core", "attention")])
def test_bisect_names_the_layer_of_a_fault_planted_in_sglang_under_its_dumper(dumps, fault, boundary, kind):
    planted, megatron = dumps[f"sgldumper_{fault}:qwen2"] / "qwen2", dumps["megatron1:qwen2"]
    for a, b in ((megatron, planted), (planted, megatron)):
        found = json.loads(tdiff_cli("bisect", a, b, "--atol", "1e-5", "--json", expect=1).output)
        first = found["first_divergence"]
        assert (first["name"], first["layer"], first["kind"]) == (boundary, 1, kind)
