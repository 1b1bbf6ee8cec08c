"""The canonical vocabulary of transformer op boundaries (docs/BOUNDARIES.md).

A canonical name is a layer prefix plus a boundary, ``layers.3.mlp.down``, or a model-level
boundary, ``embedding``. Every canonical tensor has the layout [tokens, features] with tokens in
natural order (sequence by sequence, position by position); MoE dispatch tensors have one row per
routed (token, expert) pair instead, ordered by expert and then token.

Examples:
    >>> kind_of("layers.3.mlp.down"), kind_of("logits")
    ('linear', 'logits')
    >>> layer_index("layers.3.attn.q_rope")
    3
"""

from __future__ import annotations

import re

# Model-level boundaries before the decoder layers, in execution order.
MODEL_INPUTS = {
    "input_ids": "other",        # token ids as the model received them
    "positions": "other",        # position ids
    "embedding": "embedding",
}

# Per-layer boundaries (after "layers.N."), in execution order.
LAYER_BOUNDARIES = {
    "input_norm": "norm",
    "attn.q": "linear",
    "attn.k": "linear",
    "attn.v": "linear",
    "attn.q_norm": "norm",
    "attn.k_norm": "norm",
    "attn.q_rope": "rope",
    "attn.k_rope": "rope",
    "attn.core": "attention",
    "attn.out": "linear",
    "attn.residual": "residual",     # residual stream after the attention block
    "pre_mlp_norm": "norm",
    "mlp.gate": "linear",
    "mlp.up": "linear",
    "mlp.act": "activation",        # act(gate) * up: the down projection's input
    "mlp.down": "linear",
    "moe.router": "moe_router",     # router logits [tokens, experts]
    "moe.topk_ids": "moe_topk",     # [tokens, k], ascending expert id per token
    "moe.topk_weights": "moe_topk",  # [tokens, k], in the order of moe.topk_ids
    "moe.dispatch": "moe_dispatch",  # routed tokens, grouped by expert then token
    "moe.experts": "moe_experts",   # expert outputs, rows as in moe.dispatch
    "moe.combine": "moe_combine",   # weighted sum of the routed experts' outputs per token
    "moe.shared": "mlp",            # shared-expert output
    "moe.out": "moe_combine",       # the MoE block's output (combine + shared experts)
    "output": "residual",           # residual stream after the layer
}

# Model-level boundaries after the decoder layers, in execution order.
MODEL_OUTPUTS = {
    "final_norm": "norm",
    "logits": "logits",
    "logprobs": "logprobs",
}

_IN_LAYER = re.compile(r"layers\.(\d+)(?:\.(.+))?")


def layer_name(layer: int, boundary: str) -> str:
    if boundary not in LAYER_BOUNDARIES:
        raise ValueError(f"unknown layer boundary {boundary!r}")
    return f"layers.{layer}.{boundary}"


def parse_layer_name(name: str) -> tuple[int, str | None] | None:
    """(layer, the rest) of a name under a decoder layer, ``layers.N[.rest]``, whether or not the
    rest is a boundary of the vocabulary (rest None for ``layers.N`` itself); None otherwise."""
    match = _IN_LAYER.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def split_name(name: str) -> tuple[int | None, str]:
    """(layer, boundary) of a canonical name; layer is None for model-level boundaries."""
    parsed = parse_layer_name(name)
    if parsed and parsed[1] in LAYER_BOUNDARIES:
        return parsed[0], parsed[1]
    return None, name


def kind_of(name: str) -> str:
    layer, boundary = split_name(name)
    if layer is not None:
        return LAYER_BOUNDARIES[boundary]
    return MODEL_INPUTS.get(boundary) or MODEL_OUTPUTS.get(boundary) or "other"


def layer_index(name: str) -> int | None:
    return split_name(name)[0]


_INPUT_ORDER = {name: i for i, name in enumerate(MODEL_INPUTS)}
_LAYER_ORDER = {name: i for i, name in enumerate(LAYER_BOUNDARIES)}
_OUTPUT_ORDER = {name: i for i, name in enumerate(MODEL_OUTPUTS)}


def order_key(name: str) -> tuple:
    """Sorts canonical names in execution order; names outside the vocabulary come last."""
    layer, boundary = split_name(name)
    if layer is not None:
        return (1, layer, _LAYER_ORDER[boundary], "")
    if boundary in _INPUT_ORDER:
        return (0, 0, _INPUT_ORDER[boundary], "")
    if boundary in _OUTPUT_ORDER:
        return (2, 0, _OUTPUT_ORDER[boundary], "")
    return (3, 0, 0, name)
