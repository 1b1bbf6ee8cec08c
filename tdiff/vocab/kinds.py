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
