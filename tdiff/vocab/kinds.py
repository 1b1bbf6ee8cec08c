"""Boundary kinds: what sort of op a module (or the code between two events) is.

An adapter that knows the framework sets ``Pair.kind`` (a canonical kind); otherwise the kind is
read from the module's class and the last part of its path.

Examples:
    >>> module_kind("model.layers.1.post_attention_layernorm", "Qwen2RMSNorm")
    'norm'
    >>> module_kind("decoder.layers.0.mlp.experts", "SequentialMLP")
    'moe_experts'
    >>> between_kind(parent="model.layers.1", parent_kind="other", before="attention", after="norm")
    'residual'
"""

from __future__ import annotations

import re

from tdiff.vocab.paths import DECODER_LAYER

# Every kind a boundary can have: bisect names the culprit's, compare and the report show them,
# mapping files and the fix catalogue (tdiff.source_patcher) refer to them.
KINDS = ("embedding", "norm", "rope", "attention", "linear", "activation", "mlp", "moe_router",
         "moe_topk", "moe_dispatch", "moe_experts", "moe_combine", "residual", "logits", "logprobs",
         "other")

# (kind, class-name pattern, last-path-part pattern); the first rule that matches wins, so the
# specific ones come first (RotaryEmbedding before Embedding, lm_head before Linear, experts
# before MLP).
_RULES = [
    ("logprobs", r"logprob|logsoftmax", r"logprob"),
    ("logits", r"logitsprocessor|lmhead", r"^(lm_head|output_layer|logits_processor|logits)$"),
    ("rope", r"rotary|rope", r"rotary|rope"),
    ("embedding", r"embedding", r"embed|wte|wpe"),
    ("norm", r"norm", r"norm$|^ln_"),
    ("moe_topk", r"topk$", r"^topk$"),
    ("moe_router", r"router|gate$", r"^(router|gate)$"),
    ("moe_dispatch", r"dispatch", r"dispatch"),
    ("mlp", r"sharedexpert", r"^shared_experts?$"),
    ("moe_experts", r"expert|fusedmoe", r"^(local_)?experts$"),
    ("attention", r"attention|attn", r"^(self_|cross_|core_)?(attn|attention)$"),
    ("activation", r"activation|silu|gelu|relu|swiglu|andmul|^act", r"^(act|act_fn|activation_func)$"),
    ("mlp", r"mlp|feedforward|moelayer|moeblock|sparsemoe", r"^(mlp|ffn|feed_forward)$"),
    ("linear", r"linear|conv1d", r"proj$|^fc\d?$|^linear"),
]
_COMPILED = [(kind, re.compile(cls, re.IGNORECASE), re.compile(name, re.IGNORECASE)) for kind, cls, name in _RULES]


def module_kind(path: str, module_class: str | None) -> str:
    """The kind of a module, from its class name and the last part of its path."""
    cls = (module_class or "").lower()
    parts = path.split(".")
    last = parts[-1]
    if last.isdigit() and len(parts) > 1 and parts[-2] in ("experts", "local_experts"):
        return "moe_experts"  # one expert of a sequential expert list
    for kind, cls_pattern, name_pattern in _COMPILED:
        if (cls and cls_pattern.search(cls)) or name_pattern.search(last):
            return kind
    return "other"


def explicit_kind(name: str) -> str | None:
    """The kind an explicit dump's name says (``logprobs``, ``logits``), or None."""
    lowered = name.lower()
    if "logprob" in lowered or "log_prob" in lowered:
        return "logprobs"
    if "logit" in lowered:
        return "logits"
    return None


def record_kind(record, adapter_kind: str | None = None) -> str:
    """The kind of a recorded tensor's boundary: an adapter's canonical kind when it gave one,
    else the explicit dump's name or the module's class and path. Bisect, compare and the report
    all name kinds with it."""
    if adapter_kind:
        return adapter_kind
    if record.role == "explicit":
        return explicit_kind(record.name) or "other"
    return module_kind(record.module, record.module_class)


# (kind, pattern searched in the Python function that ran the op, pattern searched in the op's
# name); the first rule that matches wins. The function says more than the op: a `mul` in
# `apply_rotary_pos_emb` is RoPE, a `_softmax` in `eager_attention_forward` is attention.
_OP_RULES = [
    ("logprobs", r"log_?softmax|logprob", r"log_softmax"),
    ("rope", r"rotary|rope|rotate_half", r"rotary|rope"),
    ("attention", r"attention|attn", r"softmax|scaled_dot_product|flash_attention|efficient_attention"),
    ("norm", r"norm", r"rms_norm|layer_norm|group_norm|batch_norm"),
    ("residual", r"bias_dropout_add|residual", None),
    ("activation", r"^act|activation|silu|gelu|swiglu|geglu", r"silu|gelu|relu|sigmoid|tanh"),
]
_OP_COMPILED = [(kind, re.compile(function, re.IGNORECASE), re.compile(op, re.IGNORECASE) if op else None)
                for kind, function, op in _OP_RULES]
_MOE_KINDS = ("mlp", "moe_experts", "moe_combine", "moe_dispatch")
_COMBINE_OP = re.compile(r"index_add|scatter_add|scatter_reduce|index_put")


def op_kind(op: str, function: str, module_kind: str) -> str | None:
    """The kind of one ATen op (``aten::mul.Tensor``) run by ``function`` in a module of kind
    ``module_kind``; None when neither says (the module's kind then stands).

    >>> op_kind("aten::mul.Tensor", "apply_rotary_pos_emb", "attention")
    'rope'
    >>> op_kind("aten::index_add_", "forward", "moe_experts")
    'moe_combine'
    """
    if module_kind in _MOE_KINDS and _COMBINE_OP.search(op):
        return "moe_combine"  # expert outputs summed into the tokens' rows
    for kind, function_pattern, op_pattern in _OP_COMPILED:
        if function_pattern.search(function) or (op_pattern is not None and op_pattern.search(op)):
            return kind
    return None


def between_kind(*, parent: str | None, parent_kind: str | None, before: str | None,
                 after: str | None) -> str:
    """The kind of the code between two recorded events in ``parent``'s forward.

    ``before``/``after`` are the kinds of the modules on either side (None for the forward's own
    input or output). In a MoE block the code after the experts combines their outputs and the
    code after the router dispatches tokens; in a decoder layer the only own code is the residual
    adds; inside a module of a known kind (attention: RoPE application and the attention core)
    the code takes the module's kind.
    """
    if before == "moe_experts":
        return "moe_combine"
    if before in ("moe_router", "moe_topk") and after in (None, "moe_experts", "moe_dispatch"):
        return "moe_dispatch"
    if parent is not None and DECODER_LAYER.search(parent):
        return "residual"
    if parent_kind not in (None, "other", "mlp"):
        return parent_kind
    if before in ("embedding", "logits", "logprobs"):
        return before  # embedding scaling, logit soft-capping or casts right after the op
    if after in ("logits", "logprobs"):
        return after
    if parent_kind == "mlp":
        return "mlp"
    return "other"
