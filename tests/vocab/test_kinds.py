"""Boundary kinds from module classes and paths (HF, Megatron and SGLang names), and of the code
between two events."""

import pytest

from tdiff.vocab.kinds import KINDS, between_kind, explicit_kind, module_kind, op_kind


@pytest.mark.parametrize("path, cls, kind", [
    # transformers Qwen2 / Qwen3-MoE
    ("model.embed_tokens", "Embedding", "embedding"),
    ("model.rotary_emb", "Qwen2RotaryEmbedding", "rope"),
    ("model.layers.0.input_layernorm", "Qwen2RMSNorm", "norm"),
    ("model.layers.0.self_attn", "Qwen2Attention", "attention"),
    ("model.layers.0.self_attn.q_proj", "Linear", "linear"),
    ("model.layers.0.mlp", "Qwen2MLP", "mlp"),
    ("model.layers.0.mlp.act_fn", "SiLUActivation", "activation"),
    ("model.layers.0.mlp", "Qwen3MoeSparseMoeBlock", "mlp"),
    ("model.layers.0.mlp.gate", "Qwen3MoeTopKRouter", "moe_router"),
    ("model.layers.0.mlp.experts", "Qwen3MoeExperts", "moe_experts"),
    ("model.norm", "Qwen2RMSNorm", "norm"),
    ("lm_head", "Linear", "logits"),
    # megatron-core
    ("embedding.word_embeddings", "VocabParallelEmbedding", "embedding"),
    ("rotary_pos_emb", "RotaryEmbedding", "rope"),
    ("decoder.layers.1.self_attention.linear_qkv", "ColumnParallelLinear", "linear"),
    ("decoder.layers.1.self_attention.core_attention", "DotProductAttention", "attention"),
    ("decoder.layers.1.pre_mlp_layernorm", "RMSNorm", "norm"),
    ("decoder.layers.1.mlp", "MoELayer", "mlp"),
    ("decoder.layers.1.mlp.router", "TopKRouter", "moe_router"),
    ("decoder.layers.1.mlp.experts", "SequentialMLP", "moe_experts"),
    ("decoder.layers.1.mlp.experts.local_experts.3", "MLP", "moe_experts"),
    ("decoder.layers.1.mlp.shared_experts", "SharedExpertMLP", "mlp"),
    ("output_layer", "ColumnParallelLinear", "logits"),
    # SGLang
    ("model.layers.0.self_attn.qkv_proj", "QKVParallelLinear", "linear"),
    ("model.layers.0.self_attn.attn", "RadixAttention", "attention"),
    ("model.layers.0.mlp.gate", "ReplicatedLinear", "moe_router"),
    ("model.layers.0.mlp.topk", "TopK", "moe_topk"),
    ("model.layers.0.mlp.experts", "FusedMoE", "moe_experts"),
    ("logits_processor", "LogitsProcessor", "logits"),
    # no idea
    ("model.layers.0", "Qwen2DecoderLayer", "other"),
    ("decoder.layers.1.self_attention.core_attention.attention_dropout", "Dropout", "other"),
])
def test_module_kinds(path, cls, kind):
    assert module_kind(path, cls) == kind


def test_explicit_dump_names():
    assert explicit_kind("logprobs") == "logprobs"
    assert explicit_kind("token_log_probs") == "logprobs"
    assert explicit_kind("final_logits") == "logits"
    assert explicit_kind("hidden") is None


@pytest.mark.parametrize("parent, parent_kind, before, after, kind", [
    ("model.layers.1", "other", "attention", "norm", "residual"),
    ("model.layers.1", "other", "mlp", None, "residual"),
    ("decoder.layers.1.mlp", "mlp", "moe_experts", None, "moe_combine"),
    ("model.layers.1.mlp", "mlp", "moe_router", "moe_experts", "moe_dispatch"),
    ("model.layers.1.self_attn", "attention", "linear", "linear", "attention"),
    ("model.layers.1.mlp", "mlp", "activation", "linear", "mlp"),
    ("model", "other", "embedding", "rope", "embedding"),
    ("", "other", "logits", None, "logits"),
    ("model", "other", "other", "norm", "other"),
])
def test_kinds_of_the_code_between_events(parent, parent_kind, before, after, kind):
    assert between_kind(parent=parent, parent_kind=parent_kind, before=before, after=after) == kind
    assert kind in KINDS


@pytest.mark.parametrize("op, function, module_kind, kind", [
    ("aten::mul.Tensor", "apply_rotary_pos_emb", "attention", "rope"),
    ("aten::cat", "rotate_half", "attention", "rope"),
    ("aten::mul.Tensor", "_apply_rotary_pos_emb_bshd", "attention", "rope"),
    ("aten::_softmax", "eager_attention_forward", "attention", "attention"),
    ("aten::_softmax", "forward", "other", "attention"),
    ("aten::_log_softmax", "forward", "other", "logprobs"),
    ("aten::index_add_", "forward", "moe_experts", "moe_combine"),
    ("aten::scatter_add_", "combine", "mlp", "moe_combine"),
    ("aten::add.Tensor", "_bias_dropout_add_func", "other", "residual"),
    ("aten::rsqrt", "rms_norm_forward", "norm", "norm"),
    ("aten::silu", "forward", "mlp", "activation"),
    ("aten::add.Tensor", "forward", "other", None),        # the module-level kind stands
    ("aten::index_add_", "forward", "other", None),        # not in a MoE module
])
def test_kinds_of_ops_from_the_op_and_its_function(op, function, module_kind, kind):
    assert op_kind(op, function, module_kind) == kind
    assert kind is None or kind in KINDS
