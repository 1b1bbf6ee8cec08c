"""tdiff.testing.assert_match: the CI parity gate over two real captures of a tiny Qwen2."""

import re

import pytest
import torch

import tdiff
from tdiff.testing import assert_match
from tests.bisect import planted
from tests.helpers import tiny_qwen2, token_ids

PLANTED = "model.layers.1.post_attention_layernorm"


def capture_run(path, *, planted_layer=None, logprob_offset=0.0):
    """A tiny Qwen2 scoring one sequence; ``planted_layer``: that layer's post-attention RMSNorm
    computes its variance in bf16 (under a bf16 model); ``logprob_offset`` shifts the log-probs."""
    model = tiny_qwen2(torch.bfloat16)
    if planted_layer is not None:
        planted.bf16_variance_rmsnorm(model.model.layers[planted_layer].post_attention_layernorm)
    with tdiff.capture(path, model=model), torch.no_grad():
        logits = model(token_ids()).logits.float()
        tdiff.dump("logprobs", torch.log_softmax(logits, -1) + logprob_offset)
    return path


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    return {"a": capture_run(root / "a"), "again": capture_run(root / "again"),
            "planted": capture_run(root / "planted", planted_layer=1),
            "shifted": capture_run(root / "shifted", logprob_offset=1e-3)}


def test_two_runs_of_the_same_program_pass_bitwise(dumps):
    assert_match(dumps["a"], dumps["again"])


def test_a_divergence_fails_with_the_bisect_summary_naming_the_op(dumps):
    with pytest.raises(AssertionError) as failed:
        assert_match(dumps["a"], dumps["planted"])
    message = str(failed.value)
    assert message.startswith("diverged: introduced at ")
    assert f"introduced at {PLANTED} (norm, layer 1)" in message
    assert "its compared inputs match; not compared: weight (parameters and buffers are not recorded); " \
           "its output differs" in message


def test_layers_limit_the_gate_to_those_decoder_layers(dumps):
    assert_match(dumps["a"], dumps["planted"], layers="0")   # the fault sits in layer 1
    with pytest.raises(AssertionError, match=re.escape(PLANTED)):
        assert_match(dumps["a"], dumps["planted"], layers="0-1")


def test_select_and_a_tolerance_gate_one_value(dumps):
    shifted = torch.log_softmax(torch.zeros(1), -1)  # the offset is added in fp32: its size there
    offset = float((shifted + 1e-3 - shifted).abs().max())
    with pytest.raises(AssertionError, match="logprobs"):
        assert_match(dumps["a"], dumps["shifted"], select="logprobs")
    with pytest.raises(AssertionError, match="logprobs"):
        assert_match(dumps["a"], dumps["shifted"], select="logprobs", atol=offset / 2)
    assert_match(dumps["a"], dumps["shifted"], select="logprobs", atol=offset * 1.01)
    # only the explicit dump differs: every module output is still bitwise equal
    assert_match(dumps["a"], dumps["shifted"], select=r"^model")


def test_filters_that_leave_nothing_and_bad_tolerances_are_errors_not_passes(dumps, tmp_path):
    with pytest.raises(tdiff.TdiffError, match="nothing to compare"):
        assert_match(dumps["a"], dumps["again"], layers="7")
    with pytest.raises(tdiff.TdiffError, match="nothing to compare"):
        assert_match(dumps["a"], dumps["again"], select="no-such-tensor")
    with pytest.raises(tdiff.TdiffError, match="atol"):
        assert_match(dumps["a"], dumps["again"], atol=-1.0)
    with pytest.raises(tdiff.TdiffError):
        assert_match(dumps["a"], tmp_path / "never-captured")
