"""Offline bisection of planted faults in real transformers models (tiny configs, random weights)."""

import pytest
import torch

import tdiff
from tdiff.bisect import bisect_dumps
from tests.bisect import planted
from tests.helpers import tiny_qwen2, token_ids


def capture(path, model, *, logprobs_dtype=torch.float32):
    with torch.no_grad(), tdiff.capture(path):
        logits = model(token_ids()).logits
        tdiff.dump("logprobs", torch.log_softmax(logits.to(logprobs_dtype), -1).float())
    return path


def bisect_planted(tmp_path, plant, *, dtype=torch.float32, layers=3, **b_options):
    a = capture(tmp_path / "a", tiny_qwen2(dtype, layers=layers))
    model = tiny_qwen2(dtype, layers=layers)
    if plant is not None:
        plant(model)
    b = capture(tmp_path / "b", model, **b_options)
    return bisect_dumps(a, b)


def named(result):
    d = result.first_divergence
    return d.module, d.kind, d.event, d.introduced


def test_identical_runs_match(tmp_path):
    result = bisect_planted(tmp_path, None)
    assert result.status == "match" and result.exit_code == 0
    assert result.first_divergence is None and result.trail == []
    assert result.checked > 60


def test_bf16_variance_in_one_rmsnorm_is_named_with_kind_norm(tmp_path):
    result = bisect_planted(tmp_path, lambda m: planted.bf16_variance_rmsnorm(
        m.model.layers[1].input_layernorm), dtype=torch.bfloat16)
    assert named(result) == ("model.layers.1.input_layernorm", "norm", "output", True)
    d = result.first_divergence
    assert d.name == "model.layers.1.input_layernorm" and d.layer == 1 and d.step == 0
    assert d.metrics.max_ulp >= 1
    # everything that encloses the norm diverged too, innermost first
    assert [t.module for t in result.trail] == ["model.layers.1", "model", ""]


def test_rope_cos_sin_at_lower_precision_is_named_with_kind_rope(tmp_path):
    result = bisect_planted(tmp_path, lambda m: planted.bf16_rope(m.model.rotary_emb))
    assert named(result) == ("model.rotary_emb", "rope", "output", True)
    assert result.first_divergence.name.startswith("model.rotary_emb[")


def test_residual_add_in_bf16_names_the_layers_own_forward_not_the_next_norm(tmp_path):
    result = bisect_planted(tmp_path, lambda m: planted.bf16_residual(m.model.layers[1]))
    assert named(result) == ("model.layers.1", "residual", "between", True)
    d = result.first_divergence
    assert d.name == "model.layers.1.post_attention_layernorm[0]"
    assert d.description == ("in `model.layers.1` forward, between `self_attn` output and "
                             "`post_attention_layernorm` input")
    assert [t.module for t in result.trail] == ["model", ""]


def test_log_softmax_in_bf16_is_named_at_the_explicit_dump(tmp_path):
    result = bisect_planted(tmp_path, None, logprobs_dtype=torch.bfloat16)
    d = result.first_divergence
    assert (d.name, d.module, d.kind, d.event, d.introduced) == ("logprobs", None, "logprobs", "between", True)
    assert d.layer is None
    assert d.description == "outside any module, between `(model)` output and the dump `logprobs`"
    json = result.to_json()["first_divergence"]
    assert json["module"] is None and json["kind"] == "logprobs"


def test_a_difference_already_in_the_models_inputs_is_not_called_introduced(tmp_path):
    model = tiny_qwen2()
    a = capture(tmp_path / "a", model)
    with torch.no_grad(), tdiff.capture(tmp_path / "b"):
        logits = model(token_ids(seed=2)).logits
        tdiff.dump("logprobs", torch.log_softmax(logits, -1))
    d = bisect_dumps(a, tmp_path / "b").first_divergence
    assert (d.name, d.module, d.event, d.introduced) == ("(model)[0]", "", "input", False)


@pytest.mark.parametrize("tolerance_hides_it", [True, False])
def test_a_tolerance_decides_what_counts_as_a_divergence(tmp_path, tolerance_hides_it):
    from tdiff.compare.metrics import Tolerance

    model = tiny_qwen2()
    a = capture(tmp_path / "a", model)
    planted.split_k_linear(model.model.layers[0].mlp.down_proj)
    b = capture(tmp_path / "b", model)
    assert bisect_dumps(a, b).first_divergence.module == "model.layers.0.mlp.down_proj"
    result = bisect_dumps(a, b, tolerance=Tolerance(atol=1e-3 if tolerance_hides_it else 1e-12, rtol=0))
    assert result.status == ("match" if tolerance_hides_it else "diverged")
    assert result.tolerance.startswith("atol=")
