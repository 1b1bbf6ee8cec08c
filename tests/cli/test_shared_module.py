"""A module object shared by all decoder layers is named after its first owner (layer 0's path);
each of its calls belongs to the layer that made it: in the manifest, compare --layer, bisect,
report, and capture --layers. (SGLang shares one rotary_emb this way: tests/align/
test_sglang_shared_rope.py and test_sglang_dumper_megatron.py run the real one.)"""

import json
import shutil

import pytest
import torch

import tdiff
from tdiff.store import open_dump
from tests.helpers import tdiff_cli, tiny_qwen2, token_ids

LAYERS, FAULTY = 4, 3
SHARED = "model.layers.0.mlp.act_fn"


def shared_activation_model():
    """A real Qwen2 whose layers all call one activation module, as SGLang's layers call one
    rotary embedding."""
    model = tiny_qwen2(layers=LAYERS)
    shared = model.model.layers[0].mlp.act_fn
    for layer in model.model.layers:
        layer.mlp.act_fn = shared
    return model, shared


def plant_fault_in_call(module, faulty_call: int):
    """Change the module's output in one call of each forward only (the call from one layer)."""
    calls = {"n": 0}

    def hook(_module, _inputs, output):
        calls["n"] += 1
        return output + 1e-3 if (calls["n"] - 1) % LAYERS == faulty_call else output

    module.register_forward_hook(hook)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    for side in ("a", "b"):
        model, shared = shared_activation_model()
        if side == "b":
            plant_fault_in_call(shared, FAULTY)
        with torch.no_grad(), tdiff.capture(root / side):
            model(token_ids())
    return root / "a", root / "b"


def test_the_manifest_records_the_calling_layer_of_a_shared_module(dumps):
    calls = [r for r in open_dump(dumps[0]).records if r.module == SHARED and r.role == "output"]
    assert [(r.call, r.layer) for r in calls] == [(0, None), (1, 1), (2, 2), (3, 3)]
    manifest = next((dumps[0] / "manifests").glob("*.jsonl")).read_text()
    assert '"layer":3' in manifest.replace(" ", "")


def test_compare_attributes_the_fault_to_the_calling_layer(dumps):
    first = json.loads(tdiff_cli("compare", *dumps, "--json", expect=1).output)["first_divergence"]
    assert (first["module"], first["call"], first["layer"]) == (SHARED, FAULTY, FAULTY)
    in_layer = json.loads(tdiff_cli("compare", *dumps, "--layer", FAULTY, "--json", expect=1).output)["tensors"]
    assert {(t["name"], t["call"]) for t in in_layer if t["module"] == SHARED} == \
        {(f"{SHARED}[0]", FAULTY), (SHARED, FAULTY)}
    # layer 0 holds only the shared module's first call, which matches
    layer_0 = json.loads(tdiff_cli("compare", *dumps, "--layer", 0, "--json", expect=0).output)["tensors"]
    assert {t["call"] for t in layer_0 if t["module"] == SHARED} == {0}


def test_bisect_names_the_calling_layer(dumps):
    result = tdiff_cli("bisect", *dumps, expect=1)
    assert f"(activation, layer {FAULTY}), step 0 call {FAULTY}" in result.output
    first = json.loads(tdiff_cli("bisect", *dumps, "--json", expect=1).output)["first_divergence"]
    assert (first["module"], first["layer"], first["kind"]) == (SHARED, FAULTY, "activation")


def test_report_marks_the_calling_layer_first(dumps, tmp_path):
    tdiff_cli("report", *dumps, "--format", "json", "-o", tmp_path / "r.json", expect=1)
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["culprit"]["layer"], report["culprit"]["boundary"]) == (FAULTY, "mlp.act_fn")
    assert next(row["layer"] for row in report["layers"] if row["diverged"]) == FAULTY
    tdiff_cli("report", *dumps, "-o", tmp_path / "r.md", expect=1)
    assert f"| **{FAULTY}** ◀ first |" in (tmp_path / "r.md").read_text()
    # layer 0 alone matches: the match says what --layer left out
    tdiff_cli("report", *dumps, "--layer", 0, "-o", tmp_path / "0.md", expect=0)
    assert "tensors were left out by --layers/--select/--exclude" in (tmp_path / "0.md").read_text()


def test_capture_layers_records_the_calls_each_layer_made(tmp_path):
    model, _ = shared_activation_model()
    with torch.no_grad(), tdiff.capture(tmp_path / "d", layers=str(FAULTY)):
        model(token_ids())
    calls = {r.call for r in open_dump(tmp_path / "d").records if r.module == SHARED}
    assert calls == {FAULTY}


def test_dumps_written_before_the_layer_field_derive_it_from_the_caller(dumps, tmp_path):
    old = tmp_path / "b-without-layer"
    shutil.copytree(dumps[1], old)
    for manifest in (old / "manifests").glob("*.jsonl"):
        lines = [json.loads(line) for line in manifest.read_text().splitlines()]
        for line in lines:
            line.pop("layer", None)
        manifest.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
    assert all(r.layer is None for r in open_dump(old).records)
    first = json.loads(tdiff_cli("compare", dumps[0], old, "--json", expect=1).output)["first_divergence"]
    assert (first["module"], first["call"], first["layer"]) == (SHARED, FAULTY, FAULTY)
    first = json.loads(tdiff_cli("bisect", dumps[0], old, "--json", expect=1).output)["first_divergence"]
    assert first["layer"] == FAULTY
