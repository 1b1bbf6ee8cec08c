"""The report model: boundaries and layers from real captures, canonical names, per-token error."""

import torch

import tdiff
from tdiff.compare.engine import Comparison, compare_dumps
from tdiff.report.model import LAYER_ITSELF, boundary_of, build_report
from tdiff.store import Record, open_dump
from tests.helpers import tiny_qwen2, token_ids


def record(name, module, role="output", **extra):
    return Record(seq=0, name=name, module=module, role=role, step=0, call=0, rank=0, dtype="float32",
                  shape=(2, 3), **extra)


def comparison(name, module, role="output", pair_name=None, kind=None, **extra):
    r = record(name, module, role, **extra)
    return Comparison(name=pair_name or name, status="match", a=r, b=r, kind=kind)


def test_boundary_of_groups_by_module_path_within_the_layer():
    assert boundary_of(comparison("model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.q_proj")) \
        == (3, "self_attn.q_proj")
    assert boundary_of(comparison("model.layers.3.self_attn[0]", "model.layers.3.self_attn")) == (3, "self_attn")
    assert boundary_of(comparison("model.layers.3", "model.layers.3")) == (3, LAYER_ITSELF)
    assert boundary_of(comparison("decoder.layers.0.mlp.experts.1.linear_fc1",
                                  "decoder.layers.0.mlp.experts.1.linear_fc1")) == (0, "mlp.experts.1.linear_fc1")
    assert boundary_of(comparison("transformer.h.2.attn", "transformer.h.2.attn")) == (2, "attn")
    assert boundary_of(comparison("model.norm", "model.norm")) == (None, "model.norm")
    assert boundary_of(comparison("(model)[logits]", "")) == (None, "(model)")
    assert boundary_of(comparison("logprobs", "model", role="explicit")) == (None, "logprobs")


def test_boundary_of_prefers_canonical_names():
    # alignment names the pair canonically, or records the canonical name in the record's attrs
    assert boundary_of(comparison("model.layers.2.self_attn.qkv_proj", "model.layers.2.self_attn.qkv_proj",
                                  pair_name="layers.2.q_proj", kind="linear")) == (2, "q_proj")
    assert boundary_of(comparison("decoder.layers.2.self_attention", "decoder.layers.2.self_attention",
                                  attrs={"canonical": "layers.2.attn_out"})) == (2, "attn_out")
    assert boundary_of(comparison("decoder.layers.5", "decoder.layers.5",
                                  pair_name="layers.5")) == (5, LAYER_ITSELF)
    assert boundary_of(comparison("output_layer", "output_layer", pair_name="logits")) == (None, "logits")


def test_rows_count_outputs_and_keep_execution_order(tmp_path):
    model = tiny_qwen2(layers=2)
    for side in ("a", "b"):
        if side == "b":
            with torch.no_grad():
                model.model.layers[1].mlp.up_proj.weight[0, 0] += 0.5
        with torch.no_grad(), tdiff.capture(tmp_path / side):
            model(token_ids())
    report = build_report(compare_dumps(open_dump(tmp_path / "a"), open_dump(tmp_path / "b")))
    assert report.culprit.comparison.name == "model.layers.1.mlp.up_proj"
    assert (report.culprit.layer, report.culprit.boundary) == (1, "mlp.up_proj")
    rows = {(row.layer, row.boundary): row for row in report.boundaries}
    # each module's output once (its inputs are earlier modules' outputs)
    assert all(row.tensors == 1 for row in rows.values() if row.layer is not None)
    assert rows[(0, "mlp")].diverged == 0 and rows[(0, "mlp")].max_ulp == 0
    up = rows[(1, "mlp.up_proj")]
    c = report.culprit.comparison
    assert up.first is c and up.mismatched == c.metrics.mismatched and up.max_abs == c.metrics.max_abs
    assert up.mismatch_fraction == c.metrics.mismatch_fraction
    assert rows[(1, "mlp.gate_proj")].diverged == 0  # runs before up_proj: unaffected
    order = [row.boundary for row in report.boundaries if row.layer == 1]
    assert order.index("mlp.up_proj") < order.index("mlp.down_proj") < order.index("mlp") \
        < order.index(LAYER_ITSELF)
    layer1 = next(row for row in report.layers if row.layer == 1)
    assert layer1.first_diverged is up and layer1.output.boundary == LAYER_ITSELF
    assert [row.label for row in report.layers] == ["before layers", "0", "1", "after layers"]
    tokens = report.culprit.tokens
    assert tokens.axis == 1 and len(tokens.max_abs) == 12 and tokens.per_token == 128
    assert tokens.tokens_differ == 12  # a changed weight changes every token's projection
