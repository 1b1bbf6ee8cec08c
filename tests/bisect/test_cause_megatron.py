"""Which side is right on real megatron-core GPT models (CPU, gloo, local layer spec): the norm's
eps and the attention core's scale and precision, replayed from Megatron's own modules' records."""

import pytest
import torch

import tdiff
from tdiff.bisect import bisect_dumps
from tests.helpers import token_ids


def bisected(tmp_path, megatron, plant):
    config = megatron.gpt_config(layers=2)
    for side in ("a", "b"):
        model = megatron.build_gpt(config)  # a fresh model per side: Megatron caches RoPE per instance
        if side == "b":
            plant(model.decoder.layers[1])
        with tdiff.capture(tmp_path / side, params=True):
            megatron.gpt_forward(model, token_ids(tokens=8))
    return bisect_dumps(tmp_path / "a", tmp_path / "b").first_divergence


def test_another_eps_in_megatrons_rmsnorm_is_logic(tmp_path, megatron):
    d = bisected(tmp_path, megatron, lambda layer: setattr(layer.pre_mlp_layernorm, "eps", 0.1))
    assert d.module == "decoder.layers.1.pre_mlp_layernorm"
    assert (d.cause.cause_class, d.cause.op, d.cause.differing) == ("logic", "RMSNorm", ["eps 1e-06 vs 0.1"])


def test_another_softmax_scale_in_megatrons_attention_core_is_logic(tmp_path, megatron):
    d = bisected(tmp_path, megatron, lambda layer: setattr(layer.self_attention.core_attention, "softmax_scale", 0.3))
    assert d.module == "decoder.layers.1.self_attention.core_attention"
    assert (d.cause.cause_class, d.cause.op) == ("logic", "attention core")
    assert d.cause.differing == ["softmax_scale 0.25 vs 0.3"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inputs_rounded_to_16_bits_in_megatrons_attention_core_are_precision_on_that_side(tmp_path, megatron, dtype):
    def plant(layer):
        core = layer.self_attention.core_attention
        own = core.forward
        core.forward = lambda q, k, v, *args, **kwargs: own(*(t.to(dtype).float() for t in (q, k, v)), *args, **kwargs)

    d = bisected(tmp_path, megatron, plant)
    assert d.module == "decoder.layers.1.self_attention.core_attention"
    assert (d.cause.cause_class, d.cause.side, d.cause.op) == ("precision", "b", "attention core")
    assert d.cause.equal_a > d.cause.equal_b
