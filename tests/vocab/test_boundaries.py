"""The canonical vocabulary and its documentation."""

import re

from tdiff.vocab.boundaries import (LAYER_BOUNDARIES, MODEL_INPUTS, MODEL_OUTPUTS, kind_of, layer_index, layer_name,
                                    order_key, parse_layer_name, split_name)
from tdiff.vocab.kinds import KINDS
from tests.helpers import REPO


def test_every_boundary_has_a_kind_bisect_knows():
    for kind in list(LAYER_BOUNDARIES.values()) + list(MODEL_INPUTS.values()) + list(MODEL_OUTPUTS.values()):
        assert kind in KINDS
    assert kind_of("layers.3.mlp.down") == "linear" and kind_of("my_value") == "other"
    assert layer_index("layers.12.attn.q_rope") == 12 and layer_index("logits") is None
    assert split_name("layers.0.moe.topk_ids") == (0, "moe.topk_ids")
    assert split_name("layers.0.unknown") == (None, "layers.0.unknown")


def test_names_under_a_layer_parse_whatever_their_boundary():
    # the report groups user-annotated canonical names (outside the vocabulary) by layer too
    assert parse_layer_name("layers.3.q_proj") == (3, "q_proj")
    assert parse_layer_name("layers.3") == (3, None)
    assert parse_layer_name("layers.3.") is None and parse_layer_name("model.layers.3.mlp") is None
    assert parse_layer_name("logits") is None


def test_names_sort_in_execution_order():
    names = ["logits", "layers.1.input_norm", "layers.0.output", "embedding", "layers.0.attn.q", "zzz",
             "layers.0.mlp.act", "input_ids", "layers.10.input_norm"]
    assert sorted(names, key=order_key) == ["input_ids", "embedding", "layers.0.attn.q", "layers.0.mlp.act",
                                            "layers.0.output", "layers.1.input_norm", "layers.10.input_norm",
                                            "logits", "zzz"]
    assert layer_name(2, "attn.core") == "layers.2.attn.core"


def test_docs_describe_every_boundary():
    text = (REPO / "docs" / "BOUNDARIES.md").read_text()
    rows = re.findall(r"^\| `([a-z_.]+)` \| ([a-z_]+) \|", text, re.MULTILINE)
    vocabulary = {**MODEL_INPUTS, **LAYER_BOUNDARIES, **MODEL_OUTPUTS}
    assert {name: kind for name, kind in rows if kind in KINDS} == vocabulary
