"""A dump written by SGLang's own dumper on a Megatron model, against a tdiff capture of it."""

import pytest

from tests.align.conftest import by_name, compare_json

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
