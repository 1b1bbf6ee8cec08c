"""transformers' DeepSeek-V3 (a dense layer, then MoE with a shared expert; latent attention)
through the transformers adapter: the boundaries it finds and the invariants between them."""

import torch

import tdiff
from tdiff.align.adapters import HuggingFaceAdapter, framework_of
from tdiff.store import open_dump
from tests.align.conftest import batch_ids
from tests.stacks.models import tiny_deepseek_v3


def test_deepseek_v3_boundaries(tmp_path):
    model = tiny_deepseek_v3()
    with tdiff.capture(tmp_path / "d", model=model), torch.no_grad():
        model(batch_ids())
    dump = open_dump(tmp_path / "d")
    assert framework_of(dump) == "transformers"
    found = HuggingFaceAdapter().canonicalize(dump)
    tensors = {t.name: t for t in found.tensors}
    assert {"layers.0.mlp.gate", "layers.0.mlp.down", "layers.1.moe.router", "layers.1.moe.topk_ids",
            "layers.1.moe.combine", "layers.1.moe.shared", "layers.1.moe.out", "layers.1.attn.q",
            "layers.1.attn.core", "logits"} <= set(tensors)
    assert not {"layers.1.attn.k", "layers.1.attn.v", "layers.0.moe.router", "layers.1.mlp.gate"} & set(tensors)
    assert "multi-head latent attention" in found.not_exposed["attn.k"] and found.unresolved == []

    def load(name):
        return tensors[name].load(dump, warn=lambda message: None)

    ids = load("layers.1.moe.topk_ids")
    assert ids.shape == (16, 2) and bool((ids[:, 0] < ids[:, 1]).all())       # sorted per token
    assert torch.allclose(load("layers.1.moe.out"), load("layers.1.moe.combine") + load("layers.1.moe.shared"),
                          atol=1e-6)
    assert load("layers.1.attn.q").shape == (16, 4 * 16)                        # heads x (nope + rope)
