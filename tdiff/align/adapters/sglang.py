"""SGLang model classes (Qwen2, Llama, Qwen3 / Qwen3-MoE and relatives).

Activations are flattened [tokens, hidden]; q|k|v and gate|up are fused (``qkv_proj``,
``gate_up_proj``); RMSNorm fuses the residual add and returns (normed, residual), so the residual
stream lives in the norms' second output; one RotaryEmbedding module is shared by all layers (each
call belongs to the layer that made it: tdiff.vocab.paths.record_layer); ``FusedMoE`` runs all
routed experts at once after ``topk``.

At capture time, tdiff/hooks/frameworks/sglang.py records each rank's parallel coordinates and shard specs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping


from tdiff.align.adapters.base import Adapter, Rule, View, piece
from tdiff.align.ops import Add, Halve, Narrow, SortedTopk, TokensFirst
from tdiff.vocab.paths import record_layer

_LAYER = r"(?:.*\.)?layers\.(?P<layer>\d+)\."
_MODEL = r"(?:.*\.)?model|"        # the *Model module (the root itself when it is the capture root)
_TOKENS = (TokensFirst("t"),)


class SGLangAdapter(Adapter):
    framework = "sglang"
    label = "SGLang"
    rules = (
        Rule(_MODEL, "input", ("0", "input_ids"), "input_ids", "t"),
        Rule(_MODEL, "input", ("1", "positions"), "positions", "t"),
        Rule(r"(?:.*\.)?embed_tokens", "output", ("",), "embedding", "t"),
        Rule(_LAYER + "input_layernorm", "output", ("", "0"), "input_norm", "t"),
        Rule(_LAYER + r"self_attn\.attn", "output", ("",), "attn.core", "t"),
        Rule(_LAYER + r"self_attn\.o_proj", "output", ("0",), "attn.out", "t"),
        Rule(_LAYER + "post_attention_layernorm", "output", ("1",), "attn.residual", "t"),
        Rule(_LAYER + "post_attention_layernorm", "output", ("0",), "pre_mlp_norm", "t"),
        Rule(_LAYER + r"mlp\.down_proj", "input", ("0",), "mlp.act", "t"),
        Rule(_LAYER + r"mlp\.down_proj", "output", ("0",), "mlp.down", "t"),
        Rule(_LAYER + r"mlp\.gate", "output", ("0",), "moe.router", "t"),
        Rule(_LAYER + r"mlp\.experts", "output", ("",), "moe.combine", "t"),
        Rule(_LAYER + r"mlp\.shared_experts?", "output", ("", "0"), "moe.shared", "t"),
        Rule(r"(?!.*layers\.\d)(?:.*\.)?norm", "output", ("", "0"), "final_norm", "t"),
    )
    not_exposed: Mapping[str, str] = {
        "logits": "SGLang computes logits inside LogitsProcessor from lm_head's weight (no module call), "
                  "for the last token of each sequence only",
        "moe.dispatch": "FusedMoE runs all routed experts as one op: routed tokens are not a module output",
        "moe.experts": "FusedMoE runs all routed experts as one op: per-expert outputs are not a module output",
    }

    _QKV = re.compile(_LAYER + r"self_attn\.qkv_proj")
    _GATE_UP = re.compile(_LAYER + r"mlp\.gate_up_proj")
    _TOPK = re.compile(_LAYER + r"mlp\.topk")
    _MLP = re.compile(r"(?P<layers>(?:.*\.)?layers\.)(?P<layer>\d+)\.mlp")
    _ROTARY = re.compile(r".*\.rotary_emb")

    def pieces(self, view: View):
        out = super().pieces(view)
        for match, module in view.find(self._QKV):
            out += self._qkv(view, match, module)
        for match, module in view.find(self._GATE_UP):
            out += [piece(f"mlp.{p}", match, view, [r], transforms=(Halve(i, p),), layout=_TOKENS)
                    for r in view.calls(module, "output", "0") for i, p in enumerate(("gate", "up"))]
        for match, module in view.find(self._TOPK):
            # TopKOutput is a NamedTuple (topk_weights, topk_ids, router_logits): tdiff names its
            # fields, SGLang's dumper numbers them
            named = bool(view.calls(module, "output", "topk_ids"))
            ids_sub, weights_sub = ("topk_ids", "topk_weights") if named else ("1", "0")
            for ids in view.calls(module, "output", ids_sub):
                weights = view.get(module, "output", weights_sub, ids.call)
                out.append(piece("moe.topk_ids", match, view, [ids], combine=SortedTopk("ids")))
                if weights is not None:
                    out.append(piece("moe.topk_weights", match, view, [weights, ids], combine=SortedTopk("weights")))
        for match, module in view.find(self._ROTARY):
            out += self._rope(view, module)
        for match, module in view.find(self._MLP):
            if module + ".experts" in view.modules:
                out += [piece("moe.out", match, view, [r], layout=_TOKENS) for r in view.calls(module, "output")]
            out += self._layer_output(view, match, module)
        return out

    def _qkv(self, view: View, match, module: str):
        attention = module[: -len("qkv_proj")] + "attn"
        out = []
        for record in view.calls(module, "output", "0"):
            q = view.get(attention, "input", "0", record.call)
            k = view.get(attention, "input", "1", record.call)
            if q is None or k is None:
                for part in "qkv":
                    view.unresolved(piece(f"attn.{part}", match, view, [record]),
                                    "cannot split qkv_proj: the q and kv sizes come from the attention "
                                    "module's inputs, which were not captured")
                continue
            q_size, kv_size = q.shape[-1], k.shape[-1]
            for part, start, length in (("q", 0, q_size), ("k", q_size, kv_size), ("v", q_size + kv_size, kv_size)):
                out.append(piece(f"attn.{part}", match, view, [record], transforms=(Narrow(start, length, part),),
                                 layout=_TOKENS))
        return out

    def _rope(self, view: View, module: str):
        """The shared rotary module: each call belongs to the layer that made it (the calling
        attention module in a tdiff capture, the dumper's layer id in SGLang's dumper output).
        Its inputs are q and k after the per-head norms (when the model has them), its outputs
        q and k after RoPE."""
        out = []
        for role, names in (("input", {"1": "attn.q_norm", "2": "attn.k_norm"}),
                            ("output", {"0": "attn.q_rope", "1": "attn.k_rope"})):
            for sub, boundary in names.items():
                if role == "input" and not any(m.endswith(".self_attn." + boundary[5:]) for m in view.modules):
                    continue   # no per-head norm in this model: the input is plain q / k
                calls: dict[int, int] = {}
                for record in view.calls(module, role, sub):
                    layer = record_layer(record)
                    if layer is None:
                        continue
                    out.append(piece(boundary, None, view, [record], layout=_TOKENS, layer=layer,
                                     call=calls.setdefault(layer, 0)))
                    calls[layer] += 1
        return out

    def _layer_output(self, view: View, match, mlp: str):
        """The residual stream after layer N: the next layer's input norm returns it as its
        second output; for the last layer (or a gap in the capture) it is rebuilt as
        post-attention residual + MLP output."""
        layer = int(match.group("layer"))
        after = f"{match.group('layers')}{layer + 1}.input_layernorm"
        residual = mlp[: -len("mlp")] + "post_attention_layernorm"
        out = []
        for record in view.calls(mlp, "output"):
            stored = view.get(after, "output", "1", record.call)
            attention_residual = view.get(residual, "output", "1", record.call)
            if stored is not None:
                out.append(piece("output", match, view, [stored], layout=_TOKENS, layer=layer, call=record.call))
            elif attention_residual is not None:
                out.append(piece("output", match, view, [attention_residual, record], layout=_TOKENS,
                                 combine=Add("residual stream rebuilt: post-attention residual + MLP output"),
                                 layer=layer, call=record.call))
        return out
