"""bisect says "its inputs match" only when every input of the named module or op was compared
and equal (issue 27 §8): a parameter or buffer the culprit reads, an operand made on a helper
thread, an input one side alone passes are named as not compared, with why."""

from concurrent.futures import ThreadPoolExecutor

import torch

import tdiff
from tdiff.bisect import bisect_dumps
from tests.helpers import tiny_qwen2, token_ids

NOT_RECORDED = "weight (parameters and buffers are not recorded)"


def capture(path, forward, ops=(), model=None, params=False):
    with torch.no_grad(), tdiff.capture(path, ops=list(ops), model=model, params=params):
        forward()
    return path


def stale_weight_pair(tmp_path, ops=(), params=False):
    """A tiny Qwen2; side B's layer-0 down projection holds a stale weight (one element off)."""
    model = tiny_qwen2()
    a = capture(tmp_path / "a", lambda: model(token_ids()), ops, params=params)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    return bisect_dumps(a, capture(tmp_path / "b", lambda: model(token_ids()), ops, params=params))


def test_a_stale_weight_both_runs_stored_is_named_as_differing(tmp_path):
    divergence = stale_weight_pair(tmp_path, params=True).first_divergence
    assert divergence.module == "model.layers.0.mlp.down_proj"
    assert divergence.description == ("`model.layers.0.mlp.down_proj`: its parameters differ between the runs: "
                                      "weight (their fingerprints, stored by --params); its other inputs match; "
                                      "its output differs")


def test_parameters_both_runs_stored_and_equal_count_as_compared(tmp_path):
    model = tiny_qwen2()
    a = capture(tmp_path / "a", lambda: model(token_ids()), params=True)
    norm = model.model.layers[0].post_attention_layernorm
    norm.register_forward_hook(lambda module, args, output: output + 1e-2)   # the op, not its weight
    divergence = bisect_dumps(a, capture(tmp_path / "b", lambda: model(token_ids()), params=True)).first_divergence
    assert divergence.module == "model.layers.0.post_attention_layernorm"
    assert divergence.not_compared is None
    assert divergence.description.endswith(": its inputs match, its output differs")


def test_a_stale_weight_is_not_blamed_on_a_module_whose_inputs_match(tmp_path):
    divergence = stale_weight_pair(tmp_path).first_divergence
    assert divergence.module == "model.layers.0.mlp.down_proj" and divergence.event == "output"
    assert divergence.not_compared == NOT_RECORDED
    assert divergence.description == ("`model.layers.0.mlp.down_proj`: its compared inputs match; not compared: "
                                      f"{NOT_RECORDED}; its output differs")
    assert "its inputs match" not in divergence.description


def test_a_stale_weight_is_not_blamed_on_aten_t_with_inputs_matching(tmp_path):
    result = stale_weight_pair(tmp_path, ops=[r"^model\.layers\.0\.mlp\.down_proj$"])
    op = result.first_divergence.op
    assert op is not None and not op.parted, result.to_json()
    assert op.not_compared == NOT_RECORDED
    assert op.describe().endswith(f": its compared inputs match; not compared: {NOT_RECORDED}; its output differs")
    assert result.to_json()["first_divergence"]["op"]["not_compared"] == NOT_RECORDED


class HelperThreadScale(torch.nn.Module):
    """Multiplies by a factor computed on a helper thread (outside the traced ops)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor
        self.pool = ThreadPoolExecutor(1)

    def forward(self, x):
        scale = self.pool.submit(lambda: torch.full((x.shape[-1],), 1.0) * self.factor).result()
        return x * scale


def test_an_operand_made_on_a_helper_thread_is_named_as_not_compared(tmp_path):
    x = torch.arange(6.0).reshape(2, 3)
    dumps = []
    for side, factor in (("a", 2.0), ("b", 2.0 + 1e-6)):
        module = HelperThreadScale(factor)
        dumps.append(capture(tmp_path / side, lambda module=module: module(x), ops=[r"^$"], model=module))
    result = bisect_dumps(*dumps)
    divergence = result.first_divergence
    assert divergence.op is not None and divergence.op.name == "aten::mul.Tensor", result.to_json()
    assert divergence.op.not_compared.startswith("input 1 (made where no op record holds it")
    assert "its compared inputs match" in divergence.op.describe()

