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
