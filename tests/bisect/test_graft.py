"""Graft on the capture side: one call of a real model runs on another run's recorded inputs."""

import pytest
import torch

import tdiff
from tdiff.compare import compare_dumps
from tdiff.errors import TdiffError
from tdiff.store import open_dump
from tests.bisect import planted
from tests.helpers import tiny_qwen2, token_ids


def capture(path, model, tokens=12, **options):
    with torch.no_grad(), tdiff.capture(path, **options):
        model(token_ids(tokens=tokens))
    return open_dump(path)


def spec(a, module, **overrides):
    return {"dump": str(a.path), "module": module, "module_b": module, "step": 0, "call": 0, **overrides}


def test_a_grafted_call_sees_side_as_inputs_nested_ones_included(tmp_path):
    a = capture(tmp_path / "a", tiny_qwen2())
    model = tiny_qwen2()
    planted.split_k_linear(model.model.layers[0].mlp.down_proj)  # layer 1's inputs now differ
    b = capture(tmp_path / "b", model, select=["^model\\.layers\\.1$"])
    assert compare_dumps(a, b).status == "diverged"
    grafted = capture(tmp_path / "g", model, select=["^model\\.layers\\.1$"], graft=spec(a, "model.layers.1"))
    report = compare_dumps(a, grafted)
    layer_1 = [c for c in report.comparisons if c.record.module == "model.layers.1" and c.b is not None]
    inputs = {c.record.sub for c in layer_1 if c.record.role == "input"}
    assert inputs == {"0", "position_embeddings.0", "position_embeddings.1", "position_ids"}
    # identical inputs (the positional tuple included), so the unplanted layer gives A's output
    assert all(not c.diverged for c in layer_1)


def test_a_graft_whose_inputs_do_not_fit_is_an_error(tmp_path):
    a = capture(tmp_path / "a", tiny_qwen2(), tokens=12)
    with pytest.raises(TdiffError, match="on side A but"):
        capture(tmp_path / "g", tiny_qwen2(), tokens=10, graft=spec(a, "model.layers.1"))
    without = capture(tmp_path / "w", tiny_qwen2(), exclude=["^model\\.layers\\.1$"])
    with pytest.raises(TdiffError, match="holds no inputs of `model.layers.1`"):
        capture(tmp_path / "h", tiny_qwen2(), graft=spec(without, "model.layers.1"))
