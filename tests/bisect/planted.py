"""Planted faults in real models: each changes one op the way real inference/training mismatches
do, on one module instance only. Every function patches the given module in place."""

from __future__ import annotations

import types

import torch


def bf16_variance_rmsnorm(norm) -> None:
    """An RMSNorm (HF Qwen2) computing its variance in the input dtype instead of fp32."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    norm.forward = types.MethodType(forward, norm)


def bf16_rope(rotary) -> None:
    """HF rotary embedding whose angles (position x inverse frequency) are computed in bf16."""

    def forward(self, x, position_ids):
        freqs = (position_ids[..., None].to(torch.bfloat16) * self.inv_freq.to(torch.bfloat16)).float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.attention_scaling).to(x.dtype),
                (emb.sin() * self.attention_scaling).to(x.dtype))

    rotary.forward = types.MethodType(forward, rotary)


def bf16_residual(layer) -> None:
    """A HF Qwen2 decoder layer whose first residual add (after attention) runs in bf16."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, cache=cache, use_cache=use_cache,
                                          position_embeddings=position_embeddings, **kwargs)
        hidden_states = (residual.bfloat16() + hidden_states.bfloat16()).to(residual.dtype)
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states

    layer.forward = types.MethodType(forward, layer)


def split_k_linear(linear) -> None:
    """A linear layer that reduces over its input features in two halves (another reduction order,
    as a different kernel or split-K GEMM would)."""

    def forward(self, x):
        half = x.shape[-1] // 2
        out = torch.nn.functional.linear(x[..., :half], self.weight[:, :half])
        out = out + torch.nn.functional.linear(x[..., half:], self.weight[:, half:])
        return out + self.bias if self.bias is not None else out

    linear.forward = types.MethodType(forward, linear)


def reversed_moe_combine(moe_layer) -> None:
    """A Megatron MoE layer whose token combine adds the experts' outputs in reverse order."""
    from megatron.core.transformer.moe.moe_utils import unpermute

    dispatcher = moe_layer.token_dispatcher

    def combine_preprocess(hidden_states):
        return unpermute(hidden_states.flip(0), dispatcher.reversed_local_input_permutation_mapping.flip(0),
                         restore_shape=dispatcher.hidden_shape_before_permute,
                         routing_map=dispatcher.local_map, fused=False)

    dispatcher.combine_preprocess = combine_preprocess


def bf16_rope_megatron(rotary) -> None:
    """Megatron's RotaryEmbedding computing its angles in bf16."""

    def get_freqs_non_repeated(self, max_seq_len, offset=0):
        seq = torch.arange(max_seq_len, dtype=torch.bfloat16) + offset
        return torch.outer(seq, self.inv_freq.to(torch.bfloat16)).float()

    rotary.get_freqs_non_repeated = types.MethodType(get_freqs_non_repeated, rotary)


# ---- changes inside a module's own code, for op-level bisection (capture --ops) ----
def bf16_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """HF's ``apply_rotary_pos_emb`` rotating the keys in bf16, as a lower-precision RoPE kernel
    would (replaces ``modeling_qwen2.apply_rotary_pos_emb``)."""
    from transformers.models.qwen2.modeling_qwen2 import rotate_half

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k16, cos16, sin16 = k.bfloat16(), cos.bfloat16(), sin.bfloat16()
    k_embed = ((k16 * cos16) + (rotate_half(k16) * sin16)).to(k.dtype)
    return q_embed, k_embed


def bf16_softmax_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """HF's ``eager_attention_forward`` with its softmax in bf16 instead of fp32 (replaces
    ``modeling_qwen2.eager_attention_forward``)."""
    from transformers.models.qwen2.modeling_qwen2 import repeat_kv

    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights.bfloat16(), dim=-1).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
    return attn_output, attn_weights


def reversed_index_add_combine(experts) -> None:
    """HF MoE experts (``Qwen2MoeExperts``) that add the experts' outputs into the tokens' rows in
    reverse expert order, as a kernel summing each token's top-k in another order would."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        contributions = []
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = torch.nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = self.act_fn(gate) * up
            current_hidden_states = torch.nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            contributions.append((token_idx, current_hidden_states.to(final_hidden_states.dtype)))
        for token_idx, current_hidden_states in reversed(contributions):
            final_hidden_states.index_add_(0, token_idx, current_hidden_states)
        return final_hidden_states

    experts.forward = types.MethodType(forward, experts)


def bf16_bias_dropout_add(x_with_bias, residual, prob, training):
    """Megatron's ``_bias_dropout_add_func`` adding the residual in bf16 (replaces
    ``megatron.core.fusions.fused_bias_dropout._bias_dropout_add_func``)."""
    x, bias = x_with_bias
    if bias is not None:
        x = x + bias
    out = torch.nn.functional.dropout(x, p=prob, training=training)
    return (residual.bfloat16() + out.bfloat16()).to(out.dtype)
