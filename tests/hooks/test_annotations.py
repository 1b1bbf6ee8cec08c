"""Record annotations: each module record's framework, and what a framework's annotator adds."""

import torch
from torch import nn

import tdiff
from tdiff.hooks import annotations
from tdiff.store import open_dump
from tests.helpers import tiny_qwen2


class Outer(nn.Module):
    """A model from a 'framework' of its own (this test package), holding a plain torch module."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 2)

    def forward(self, x):
        return self.inner(x)


def records_by_name(path):
    return {(r.name, r.role): r for r in open_dump(path).records}


def test_every_module_record_names_the_package_of_its_class(tmp_path):
    model = tiny_qwen2(layers=1)
    with tdiff.capture(tmp_path / "d", model=model), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
        tdiff.dump("extra", torch.ones(2))
    records = records_by_name(tmp_path / "d")
    assert records[("model.layers.0", "output")].attrs["framework"] == "transformers"
    # a torch module inside a transformers model: read batch-first, as its model is (issue 27 §5)
    assert records[("model.layers.0.mlp.down_proj", "output")].attrs == {
        "framework": "torch", "state": ["weight"], "layout": "batch-first"}
    assert records[("extra", "explicit")].attrs == {}


def register_for_this_test(monkeypatch, annotate):
    """Annotate this test package's classes (framework ``tests``) until the test ends: both
    registries are swapped for copies, so nothing resolved here outlives the test (other tests'
    classes come from ``tests`` too)."""
    monkeypatch.setattr(annotations, "_registered", {**annotations._registered, "tests": annotate})
    monkeypatch.setattr(annotations, "_resolved", {})


def test_an_annotator_describes_its_frameworks_modules_and_the_torch_modules_inside(tmp_path, monkeypatch):
    seen = []

    def annotate(module, path, role, sub, tensor):
        seen.append((type(module).__name__, path, role, sub))
        return {"parallel": {"tp": [0, 1]}, "shape_seen": list(tensor.shape)}

    register_for_this_test(monkeypatch, annotate)
    with tdiff.capture(tmp_path / "d"):
        Outer()(torch.ones(4, 3))
    records = records_by_name(tmp_path / "d")
    assert records[("inner", "output")].attrs == {"framework": "torch", "parallel": {"tp": [0, 1]},
                                                  "shape_seen": [4, 2], "state": ["weight", "bias"]}
    assert records[("(model)[0]", "input")].attrs["framework"] == "tests"
    assert ("Linear", "inner", "output", "") in seen


def test_a_failing_annotator_never_breaks_the_captured_program(tmp_path, monkeypatch, capsys):
    def annotate(module, path, role, sub, tensor):
        raise RuntimeError("boom")

    register_for_this_test(monkeypatch, annotate)
    with tdiff.capture(tmp_path / "d"):
        out = Outer()(torch.ones(4, 3))
    assert out.shape == (4, 2)
    assert "the tests annotator failed (RuntimeError: boom)" in capsys.readouterr().err
    assert records_by_name(tmp_path / "d")[("inner", "output")].attrs == {"framework": "torch",
                                                                          "state": ["weight", "bias"]}


def test_an_annotator_registered_during_a_capture_describes_the_records_from_then_on(tmp_path, monkeypatch):
    monkeypatch.setattr(annotations, "_registered", dict(annotations._registered))
    monkeypatch.setattr(annotations, "_resolved", {})
    model = Outer()
    with tdiff.capture(tmp_path / "d"):
        model(torch.ones(4, 3))
        tdiff.step()
        annotations.register("tests", lambda module, path, role, sub, tensor: {"parallel": {"tp": [0, 1]}})
        model(torch.ones(4, 3))
    attrs = {(r.step, r.name, r.role): r.attrs for r in open_dump(tmp_path / "d").records}
    assert attrs[(0, "inner", "output")] == {"framework": "torch", "state": ["weight", "bias"]}
    assert attrs[(1, "inner", "output")] == {"framework": "torch", "state": ["weight", "bias"], "parallel": {"tp": [0, 1]}}
