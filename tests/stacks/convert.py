"""Hugging Face -> megatron-core weight conversion for Qwen2 / Llama / Qwen3-MoE-shaped models,
and the tensor-parallel split of the result.

Megatron's fused QKV weight is ordered per query group: for each group, its query heads, then
its key head, then its value head (HF keeps q, k and v in separate matrices). Its gated MLP fuses
gate and up into one ``linear_fc1`` (gate rows first). Transformers 5.x stores MoE experts as 3-D
parameters (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]).
"""

from __future__ import annotations

import re

import torch


def hf_to_megatron(hf_state: dict, *, heads: int, groups: int, head_dim: int) -> dict:
    """A full (unsharded) megatron-core GPTModel state dict from a transformers state dict."""
    out = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_state["model.norm.weight"],
           "output_layer.weight": hf_state.get("lm_head.weight", hf_state["model.embed_tokens.weight"])}
    layers = sorted({int(m.group(1)) for key in hf_state if (m := re.match(r"model\.layers\.(\d+)\.", key))})
    for n in layers:
        hf, mg = f"model.layers.{n}.", f"decoder.layers.{n}."
        attn = hf + "self_attn."
        out[mg + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"]
        out[mg + "self_attention.linear_proj.weight"] = hf_state[attn + "o_proj.weight"]
        for part in ("weight", "bias"):
            if attn + f"q_proj.{part}" in hf_state:
                out[mg + f"self_attention.linear_qkv.{part}"] = grouped_qkv(
                    hf_state[attn + f"q_proj.{part}"], hf_state[attn + f"k_proj.{part}"],
                    hf_state[attn + f"v_proj.{part}"], heads=heads, groups=groups, head_dim=head_dim)
        for hf_norm, mg_norm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            if attn + f"{hf_norm}.weight" in hf_state:
                out[mg + f"self_attention.{mg_norm}.weight"] = hf_state[attn + f"{hf_norm}.weight"]
        mlp = hf + "mlp."
        if mlp + "gate_proj.weight" in hf_state:
            out[mg + "mlp.linear_fc1.weight"] = torch.cat([hf_state[mlp + "gate_proj.weight"],
                                                          hf_state[mlp + "up_proj.weight"]])
            out[mg + "mlp.linear_fc2.weight"] = hf_state[mlp + "down_proj.weight"]
        if mlp + "gate.weight" in hf_state:
            out[mg + "mlp.router.weight"] = hf_state[mlp + "gate.weight"]
            gate_up, down = hf_state[mlp + "experts.gate_up_proj"], hf_state[mlp + "experts.down_proj"]
            for e in range(gate_up.shape[0]):
                expert = mg + f"mlp.experts.local_experts.{e}."
                out[expert + "linear_fc1.weight"] = gate_up[e]
                out[expert + "linear_fc2.weight"] = down[e]
        if mlp + "shared_expert.gate_proj.weight" in hf_state:
            shared = mlp + "shared_expert."
            out[mg + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [hf_state[shared + "gate_proj.weight"], hf_state[shared + "up_proj.weight"]])
            out[mg + "mlp.shared_experts.linear_fc2.weight"] = hf_state[shared + "down_proj.weight"]
    return out


def grouped_qkv(q, k, v, *, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Interleave per query group: [q heads of group g | k_g | v_g] for each group g."""
    per_group = heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * head_dim, *rest)
    k = k.reshape(groups, head_dim, *rest)
    v = v.reshape(groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


_COLUMN = re.compile(r"(linear_qkv|linear_fc1|word_embeddings|output_layer)\.(weight|bias)$")
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")
_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def tensor_parallel_shard(state: dict, rank: int, size: int, *, experts: bool = True) -> dict:
    """The part of a full Megatron state dict that tensor-parallel rank ``rank`` of ``size`` holds.

    Column-parallel weights split their output rows (gate and up separately for the fused GLU
    ``linear_fc1``; QKV rows are grouped per query group, so a contiguous split keeps whole
    groups); row-parallel weights split their input columns; everything else is replicated.
    ``experts=False``: the routed experts stay whole (expert tensor parallelism 1).
    """
    out = {}
    for key, value in state.items():
        if not experts and _EXPERT.fullmatch(key):
            out[key] = value
        elif _COLUMN.search(key):
            if "linear_fc1" in key:
                gate, up = value.chunk(2)
                value = torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
            else:
                value = value.chunk(size)[rank]
        elif _ROW.search(key):
            value = value.chunk(size, dim=1)[rank]
        out[key] = value.clone()
    return out


def expert_parallel_shard(state: dict, rank: int, size: int, *, experts: int) -> dict:
    """The part of a Megatron state dict that expert-parallel rank ``rank`` of ``size`` holds:
    experts ``rank * experts / size`` onwards, renumbered from 0 (Megatron names local experts by
    their local index); everything else is replicated."""
    local = experts // size
    out = {}
    for key, value in state.items():
        match = _EXPERT.fullmatch(key)
        if match is None:
            out[key] = value
        elif rank * local <= int(match.group(2)) < (rank + 1) * local:
            out[f"{match.group(1)}{int(match.group(2)) - rank * local}{match.group(3)}"] = value
    return out


def load_megatron(model, state: dict) -> None:
    """Load converted weights; every parameter of the model must be given."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("_extra_state")]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise KeyError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for key, value in state.items():
            own[key].copy_(value)
