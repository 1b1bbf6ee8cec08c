"""A dump written by SGLang's own dumper on a Megatron model, against a tdiff capture of it."""

import pytest
import torch

import tdiff
from tests.align.conftest import batch_ids, by_name, compare_json
from tests.stacks.models import HF_MODELS, megatron_twin

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dumper(stacks):
    from sglang.srt.debug_utils.dumper import dumper

    yield dumper
    dumper.reset()
    dumper.configure(enable=False)


@pytest.mark.parametrize("model", ["qwen2", "qwen3_moe"])
def test_dumper_output_compares_against_a_tdiff_capture(dumper, tmp_path, model):
    from tests.stacks.megatron import gpt_forward

    megatron = megatron_twin(HF_MODELS[model]())
    dumper.reset()
    dumper.configure(enable=True, dir=str(tmp_path / "dumper"), exp_name=model, non_intrusive_mode="all",
                     enable_output_console=False)
    dumper.register_non_intrusive_dumper(megatron)
    gpt_forward(megatron, batch_ids())
    dumper.step()
    dumper.reset()
    dumper.configure(enable=False)
    with tdiff.capture(tmp_path / "tdiff", model=megatron):
        gpt_forward(megatron, batch_ids())

    report = compare_json(tmp_path / "dumper", tmp_path / "tdiff", expect=0)   # bitwise: the same run
    tensors = by_name(report)
    assert {"layers.1.attn.q", "layers.1.attn.q_rope", "layers.1.output", "logits"} <= set(tensors)
    assert all(t["status"] == "match" for t in tensors.values())
    # the dumper names Megatron's (out, None) like a bare tensor; the plan still finds it
    assert tensors["layers.0.attn.out"]["plan"]["a"][0] == "decoder.layers.0.self_attention.linear_proj"
    alignment = report["alignment"]
    assert alignment["a"]["adapter"] == "Megatron-core" and alignment["a"]["unmatched"] == []
    uncertain = {entry["name"] for entry in alignment["a"]["uncertain"]}
    if model == "qwen2":
        # without recorded classes, the IdentityOp q/k norms of the local spec cannot be told
        # from real ones: reported, not compared
        assert uncertain == {f"layers.{n}.attn.{p}_norm" for n in range(2) for p in "qk"}
    else:
        assert uncertain == set() and tensors["layers.0.attn.q_norm"]["status"] == "match"
        assert tensors["layers.0.moe.dispatch"]["status"] == "match"
    assert torch.load(next((tmp_path / "dumper" / model).glob("*.pt")), weights_only=True)["meta"]["name"]
