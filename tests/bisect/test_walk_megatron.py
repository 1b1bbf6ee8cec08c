"""Offline bisection of planted faults in real megatron-core GPT models (CPU, gloo)."""


import tdiff
from tdiff.bisect import bisect_dumps
from tests.bisect import planted
from tests.helpers import token_ids


def capture(path, megatron, config, plant=None):
    model = megatron.build_gpt(config)  # a fresh model per side: Megatron caches RoPE per instance
    if plant is not None:
        plant(model)
    with tdiff.capture(path):
        megatron.gpt_forward(model, token_ids(tokens=8))
    return path


def test_moe_expert_outputs_combined_in_another_order_are_named_moe_combine(tmp_path, megatron):
    config = megatron.gpt_config(layers=2, experts=4, topk=3)
    a = capture(tmp_path / "a", megatron, config)
    b = capture(tmp_path / "b", megatron, config,
                lambda m: planted.reversed_moe_combine(m.decoder.layers[1].mlp))
    result = bisect_dumps(a, b)
    d = result.first_divergence
    assert (d.module, d.kind, d.event, d.introduced) == ("decoder.layers.1.mlp", "moe_combine", "between", True)
    assert d.description.startswith("in `decoder.layers.1.mlp` forward, between `experts` output and its output")
    assert d.layer == 1 and d.name == "decoder.layers.1.mlp[0]"
    assert [t.module for t in result.trail] == ["decoder.layers.1", "decoder", ""]


def test_megatron_rope_at_lower_precision_is_named_with_kind_rope(tmp_path, megatron):
    config = megatron.gpt_config(layers=2)
    a = capture(tmp_path / "a", megatron, config)
    b = capture(tmp_path / "b", megatron, config, lambda m: planted.bf16_rope_megatron(m.rotary_pos_emb))
    d = bisect_dumps(a, b).first_divergence
    # RoPE takes only the sequence length: no tensor input, so its output event introduces it
    assert (d.module, d.kind, d.event, d.introduced) == ("rotary_pos_emb", "rope", "output", True)


def test_identical_megatron_runs_match(tmp_path, megatron):
    config = megatron.gpt_config(layers=2, experts=4, topk=3)
    result = bisect_dumps(capture(tmp_path / "a", megatron, config), capture(tmp_path / "b", megatron, config))
    assert result.status == "match" and result.checked > 100
