"""Hugging Face transformers: Qwen2, Llama, Qwen3 / Qwen3-MoE, DeepSeek-V3 families.

Activations are [batch, seq, hidden]; q, k and v have projections of their own; RoPE is applied
in a function (no module output); MoE blocks (5.x) hold a router that returns (logits, top-k
weights, top-k ids) and one fused experts module that returns the combined routed output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from tdiff.align.adapters.base import Adapter, Rule, View, piece
from tdiff.align.ops import ExpandBatch, SortedTopk, TokensFirst
from tdiff.store import Dump

_LAYER = r"(?:.*\.)?layers\.(?P<layer>\d+)\."
_TOP = r"(?!.*layers\.\d)(?:.*\.)?"          # a model-level module (outside the decoder layers)


class HuggingFaceAdapter(Adapter):
    framework = "transformers"
    label = "Hugging Face transformers"
    rules = (
        Rule(_TOP + "embed_tokens", "input", ("0", "input"), "input_ids", "bs"),
        Rule(_TOP + "embed_tokens", "output", ("",), "embedding", "bs"),
        Rule(_LAYER + "input_layernorm", "output", ("",), "input_norm", "bs"),
        Rule(_LAYER + r"self_attn\.(?:q_proj|q_b_proj)", "output", ("",), "attn.q", "bs"),
        Rule(_LAYER + r"self_attn\.k_proj", "output", ("",), "attn.k", "bs"),
        Rule(_LAYER + r"self_attn\.v_proj", "output", ("",), "attn.v", "bs"),
        Rule(_LAYER + r"self_attn\.q_norm", "output", ("",), "attn.q_norm", "bs"),
        Rule(_LAYER + r"self_attn\.k_norm", "output", ("",), "attn.k_norm", "bs"),
        Rule(_LAYER + r"self_attn\.o_proj", "input", ("0",), "attn.core", "bs"),
        Rule(_LAYER + r"self_attn\.o_proj", "output", ("",), "attn.out", "bs"),
        Rule(_LAYER + "post_attention_layernorm", "input", ("0",), "attn.residual", "bs"),
        Rule(_LAYER + "post_attention_layernorm", "output", ("",), "pre_mlp_norm", "bs"),
        Rule(_LAYER + r"mlp\.gate_proj", "output", ("",), "mlp.gate", "bs"),
        Rule(_LAYER + r"mlp\.up_proj", "output", ("",), "mlp.up", "bs"),
        Rule(_LAYER + r"mlp\.down_proj", "input", ("0",), "mlp.act", "bs"),
        Rule(_LAYER + r"mlp\.down_proj", "output", ("",), "mlp.down", "bs"),
        Rule(_LAYER + r"mlp\.gate", "output", ("0",), "moe.router", "t"),
        Rule(_LAYER + r"mlp\.experts", "output", ("",), "moe.combine", "t"),
        Rule(_LAYER + r"mlp\.shared_experts?", "output", ("",), "moe.shared", "bs"),
        Rule(r"(?:.*\.)?layers\.(?P<layer>\d+)", "output", ("", "0"), "output", "bs"),
        Rule(_TOP + "norm", "output", ("",), "final_norm", "bs"),
        Rule(_TOP + "lm_head", "output", ("",), "logits", "bs"),
    )
    not_exposed: Mapping[str, str] = {
        "attn.q_rope": "transformers applies rotary embeddings in a function (apply_rotary_pos_emb), "
                       "not a module",
        "attn.k_rope": "transformers applies rotary embeddings in a function (apply_rotary_pos_emb), "
                       "not a module",
        "moe.dispatch": "transformers runs all experts inside one fused module: routed tokens are not "
                        "a module output",
        "moe.experts": "transformers runs all experts inside one fused module: per-expert outputs are "
                       "not a module output",
    }

    _MOE_GATE = re.compile(_LAYER + r"mlp\.gate")
    _MOE_BLOCK = re.compile(r"(?P<block>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp)")
    _MLA = re.compile(_LAYER + r"self_attn\.kv_a_proj_with_mqa")
    _ROTARY = re.compile(_TOP + "rotary_emb")
    _EMBED = re.compile(_TOP + "embed_tokens")

    def pieces(self, view: View):
        out = super().pieces(view)
        for match, module in view.find(self._MOE_GATE):
            for call, ids in enumerate(view.calls(module, "output", "2")):
                weights = view.get(module, "output", "1", call)
                out.append(piece("moe.topk_ids", match, view, [ids], combine=SortedTopk("ids"), call=call))
                if weights is not None:
                    out.append(piece("moe.topk_weights", match, view, [weights, ids],
                                     combine=SortedTopk("weights"), call=call))
        for match, module in view.find(self._ROTARY):
            out += self._positions(view, match, module)
        for match, module in view.find(self._MOE_BLOCK):
            if match.group("block") + ".experts" in view.modules:
                out += [piece("moe.out", match, view, [r], layout=(TokensFirst("bs"),))
                        for r in view.calls(module, "output")]
        return out

    def _positions(self, view: View, match, module: str):
        """Position ids as the rotary module receives them: [1, seq] when all sequences of the
        batch share them, expanded to the batch the embedding saw."""
        out = []
        for call in range(len(view.calls(module, "input", "0"))):
            record = view.get(module, "input", "1", call) or view.get(module, "input", "position_ids", call)
            embedded = next((r for m, e in view.find(self._EMBED) if (r := view.get(e, "output", "", call))), None)
            if record is None:
                continue
            expand = (ExpandBatch(embedded.shape[0]),) if embedded is not None and len(embedded.shape) == 3 else ()
            out.append(piece("positions", match, view, [record], transforms=expand, layout=(TokensFirst("bs"),)))
        return out

    def not_exposed_in(self, dump: Dump) -> dict[str, str]:
        out = dict(self.not_exposed)
        if any(self._MLA.fullmatch(r.module) for r in dump.records):
            reason = ("multi-head latent attention has no k or v projection: kv_b_proj yields the "
                      "keys' non-rotary part and the values per head")
            out.update({"attn.k": reason, "attn.v": reason})
        return out
