"""SGLang's layers share one rotary module (named after layer 0): a fault in the call layer 1
makes belongs to layer 1 in compare --layer, bisect and report (two tdiff captures of a real
SGLang Qwen2)."""

import pytest

from tests.align.conftest import compare_json
from tests.helpers import tdiff_cli

pytestmark = pytest.mark.slow

ROTARY = "model.layers.0.self_attn.rotary_emb"


def test_a_fault_in_layer_1s_call_of_the_shared_rotary_module_belongs_to_layer_1(dumps, tmp_path):
    clean, planted = dumps["sglang:qwen2"], dumps["sglang_rope1:qwen2"]
    first = compare_json(clean, planted, expect=1)["first_divergence"]
    assert (first["module"], first["call"], first["layer"]) == (ROTARY, 1, 1)
    layer_0 = compare_json(clean, planted, "--layer", "0", expect=0)["tensors"]
    assert {t["call"] for t in layer_0 if t["module"] == ROTARY} == {0}
    layer_1 = compare_json(clean, planted, "--layer", "1", expect=1)["tensors"]
    assert {t["call"] for t in layer_1 if t["module"] == ROTARY} == {1}
    assert "(rope, layer 1), step 0 call 1" in tdiff_cli("bisect", clean, planted, expect=1).output
    tdiff_cli("report", clean, planted, "-o", tmp_path / "r.md", expect=1)
    assert "| **1** ◀ first |" in (tmp_path / "r.md").read_text()
