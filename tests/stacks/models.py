"""The same tiny models in transformers, megatron-core and SGLang, with the same random weights.

transformers builds the reference from a seed; the Megatron twin gets its weights through
tests/stacks/convert.py (split over tensor-parallel ranks when asked); SGLang's loads the
transformers state dict itself (tests/stacks/sglang.py).
"""

from __future__ import annotations

import torch

from tests.helpers import tiny_qwen2
from tests.stacks.convert import expert_parallel_shard, hf_to_megatron, load_megatron, tensor_parallel_shard


def tiny_qwen3_moe(dtype=torch.float32, layers: int = 2, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).to(dtype).eval()


def tiny_llama(dtype=torch.float32, layers: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_deepseek_v3(dtype=torch.float32, seed: int = 0):
    """Two layers: a dense one, then a MoE one with a shared expert; multi-head latent attention."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                              topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(config).to(dtype).eval()


HF_MODELS = {"qwen2": tiny_qwen2, "llama": tiny_llama, "qwen3_moe": tiny_qwen3_moe}


def megatron_twin(hf_model, *, tensor_parallel: int = 1, rank: int = 0, expert_parallel: int = 1,
                  expert_rank: int = 0, **overrides):
    """A megatron-core GPTModel computing what ``hf_model`` computes (Megatron initialised), the
    part of it tensor-parallel rank ``rank`` and expert-parallel rank ``expert_rank`` hold.

    With expert parallelism the experts are not split over tensor-parallel ranks (expert tensor
    parallelism 1); ``overrides`` go to the TransformerConfig (``sequence_parallel=True``...)."""
    from tests.stacks.megatron import build_gpt, gpt_config

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    experts = getattr(c, "num_experts", None)
    qk_norm = hasattr(hf_model.model.layers[0].self_attn, "q_norm")
    config = gpt_config(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                        query_groups=c.num_key_value_heads, kv_channels=head_dim,
                        ffn=c.moe_intermediate_size if experts else c.intermediate_size, experts=experts,
                        topk=getattr(c, "num_experts_per_tok", 2), layernorm_epsilon=c.rms_norm_eps,
                        add_qkv_bias=bool(getattr(c, "attention_bias", False)) or c.model_type == "qwen2",
                        tensor_model_parallel_size=tensor_parallel,
                        expert_model_parallel_size=expert_parallel,
                        dtype=next(hf_model.parameters()).dtype, qk_layernorm=qk_norm,
                        **({"expert_tensor_parallel_size": 1} if expert_parallel > 1 else {}), **overrides)
    model = build_gpt(config, vocab=c.vocab_size, max_sequence=c.max_position_embeddings,
                      qk_layernorm=qk_norm,
                      rotary_base=int(_rope_theta(c)))
    state = hf_to_megatron(hf_model.state_dict(), heads=c.num_attention_heads, groups=c.num_key_value_heads,
                           head_dim=head_dim)
    if tensor_parallel > 1:
        state = tensor_parallel_shard(state, rank, tensor_parallel, experts=expert_parallel == 1)
    if expert_parallel > 1:
        state = expert_parallel_shard(state, expert_rank, expert_parallel, experts=experts)
    load_megatron(model, state)
    return model


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
