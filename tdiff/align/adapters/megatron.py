"""megatron-core GPTModel: local and TransformerEngine layer specs.

Activations are [seq, batch, hidden] ([tokens, 1, hidden] for THD packed sequences); linear
layers return (output, bias); the fused QKV projection is ordered per query group; the gated MLP
fuses gate|up in ``linear_fc1``; the router returns (probabilities, routing map) over tokens in
[seq, batch] order; experts see only their routed tokens.

At capture time, tdiff/hooks/frameworks/megatron.py records each rank's parallel coordinates and
how each tensor is sharded over them (see tdiff.align.unshard).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar


from tdiff.align.adapters.base import Adapter, Rule, View, piece
from tdiff.align.ops import Add, Combine, GroupedQKV, Halve, SeqMajorRows, Take, TokensFirst, TopkFromRoutingMap
from tdiff.store import Dump

_LAYER = r"(?:.*\.)?decoder\.layers\.(?P<layer>\d+)\."
_TOP = r"(?:.*\.)?"
_PLACEHOLDER = ("IdentityOp",)     # a spec's stand-in where the op is absent or fused elsewhere


class MegatronAdapter(Adapter):
    framework = "megatron"
    label = "Megatron-core"
    rules = (
        Rule("", "input", ("input_ids",), "input_ids", "bs"),         # GPTModel's own inputs
        Rule("", "input", ("position_ids",), "positions", "bs"),
        Rule(_TOP + r"embedding\.word_embeddings", "input", ("0",), "input_ids", "bs"),
        Rule(_TOP + "embedding", "input", ("position_ids",), "positions", "bs"),
        Rule(_TOP + "embedding", "output", ("",), "embedding", "sb"),
        Rule(_LAYER + "input_layernorm", "output", ("",), "input_norm", "sb", _PLACEHOLDER),
        Rule(_LAYER + r"self_attention\.q_layernorm", "output", ("",), "attn.q_norm", "sb", _PLACEHOLDER),
        Rule(_LAYER + r"self_attention\.k_layernorm", "output", ("",), "attn.k_norm", "sb", _PLACEHOLDER),
        Rule(_LAYER + r"self_attention\.core_attention", "output", ("",), "attn.core", "sb"),
        Rule(_LAYER + "pre_mlp_layernorm", "input", ("0",), "attn.residual", "sb"),
        Rule(_LAYER + "pre_mlp_layernorm", "output", ("",), "pre_mlp_norm", "sb", _PLACEHOLDER),
        Rule(_LAYER + r"mlp\.linear_fc2", "input", ("0",), "mlp.act", "sb"),
        Rule(_LAYER + r"mlp\.experts", "input", ("0",), "moe.dispatch", "t"),
        Rule(_LAYER + r"mlp\.experts", "output", ("0",), "moe.experts", "t"),
        Rule(r"(?:.*\.)?decoder\.layers\.(?P<layer>\d+)", "output", ("0",), "output", "sb"),
        Rule(_TOP + r"decoder\.final_layernorm", "output", ("",), "final_norm", "sb"),
    )
    not_exposed: Mapping[str, str] = {
        "moe.router": "Megatron's TopKRouter computes its logits inside forward; it outputs "
                      "probabilities and a routing map",
    }

    # linear layers whose output may come with a separately returned bias ("1")
    _LINEARS: ClassVar[dict[str, str]] = {
        r"self_attention\.linear_proj": "attn.out",
        r"mlp\.linear_fc2": "mlp.down",
        r"mlp\.shared_experts": "moe.shared",
    }
    _LINEAR_PATTERNS: ClassVar[list[tuple[re.Pattern, str]]] = [(re.compile(_LAYER + p), b)
                                                                 for p, b in _LINEARS.items()]
    _OUTPUT_LAYER = re.compile(_TOP + "output_layer")
    _QKV = re.compile(_LAYER + r"self_attention\.linear_qkv")
    _CORE = re.compile(_LAYER + r"self_attention\.core_attention")
    _FC1 = re.compile(_LAYER + r"mlp\.linear_fc1")
    _ROUTER = re.compile(_LAYER + r"mlp\.router")
    _MOE = re.compile(_LAYER[:-2] + r"\.mlp")

    def pieces(self, view: View):
        out = super().pieces(view)
        for pattern, boundary in self._LINEAR_PATTERNS:
            for match, module in view.find(pattern):
                out += self._linear(view, match, module, boundary)
        for match, module in view.find(self._OUTPUT_LAYER):
            out += self._linear(view, match, module, "logits")
        for match, module in view.find(self._CORE):
            for call, record in enumerate(view.calls(module, "input", "0")):
                order = "sb" if len(record.shape) == 4 else "t"    # THD: [tokens, heads, dim]
                out.append(piece("attn.q_rope", match, view, [record], layout=(TokensFirst(order),)))
                key = view.get(module, "input", "1", call)
                if key is not None:
                    out.append(piece("attn.k_rope", match, view, [key], layout=(TokensFirst(order),)))
        for match, module in view.find(self._QKV):
            out += self._qkv(view, match, module)
        for match, module in view.find(self._FC1):
            out += self._fc1(view, match, module)
        for match, module in view.find(self._ROUTER):
            out += self._topk(view, match, module)
        for match, module in view.find(self._MOE):
            if module + ".router" in view.modules or module + ".experts" in view.modules:   # a MoE layer
                shared = module + ".shared_experts" in view.modules
                for record in view.calls(module, "output", "0"):
                    boundaries = ("moe.out",) if shared else ("moe.out", "moe.combine")
                    out += [piece(b, match, view, [record], layout=(TokensFirst("sb"),)) for b in boundaries]
        return out

    def _linear(self, view: View, match, module: str, boundary: str):
        out = []
        for record in view.calls(module, "output", "0"):
            bias = view.get(module, "output", "1", record.call)
            if bias is not None:
                out.append(piece(boundary, match, view, [record, bias], combine=Add("bias returned separately"),
                                 layout=(TokensFirst("sb"),)))
            else:
                out.append(piece(boundary, match, view, [record], layout=(TokensFirst("sb"),)))
        return out

    def _qkv(self, view: View, match, module: str):
        attention = module[: -len("linear_qkv")]
        out = []
        for record in view.calls(module, "output", "0"):
            q = view.get(attention + "core_attention", "input", "0", record.call) or \
                view.get(attention + "q_layernorm", "input", "0", record.call)
            k = view.get(attention + "core_attention", "input", "1", record.call) or \
                view.get(attention + "k_layernorm", "input", "0", record.call)
            if q is None or k is None:
                for part in "qkv":
                    view.unresolved(piece(f"attn.{part}", match, view, [record]),
                                    "cannot split linear_qkv: the head counts come from core_attention's "
                                    "(or q_layernorm's) inputs, which were not captured")
                continue
            heads, groups, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
            records = [record]
            bias = view.get(module, "output", "1", record.call)
            combine: Combine = Add("bias returned separately") if bias is not None else Take()
            if bias is not None:
                records.append(bias)
            for part in "qkv":
                split = GroupedQKV(groups, heads // groups, head_dim, part)
                out.append(piece(f"attn.{part}", match, view, records, combine=combine, transforms=(split,),
                                 layout=(TokensFirst("sb"),)))
        return out

    def _fc1(self, view: View, match, module: str):
        fc2 = module[: -len("linear_fc1")] + "linear_fc2"
        out = []
        for record in view.calls(module, "output", "0"):
            down_input = view.get(fc2, "input", "0", record.call)
            if down_input is None:
                for part in ("gate", "up"):
                    view.unresolved(piece(f"mlp.{part}", match, view, [record]),
                                    "cannot tell whether linear_fc1 fuses gate|up: linear_fc2's input "
                                    "was not captured")
                continue
            if record.shape[-1] == 2 * down_input.shape[-1]:
                out += [piece(f"mlp.{p}", match, view, [record], transforms=(Halve(i, p),),
                              layout=(TokensFirst("sb"),)) for i, p in enumerate(("gate", "up"))]
            else:
                out.append(piece("mlp.up", match, view, [record], layout=(TokensFirst("sb"),)))
        return out

    def _topk(self, view: View, match, module: str):
        out = []
        for probs in view.calls(module, "output", "0"):
            routing_map = view.get(module, "output", "1", probs.call)
            hidden = view.get(module, "input", "0", probs.call)
            if routing_map is None:
                continue
            layout = (SeqMajorRows(hidden.shape[1]),) if hidden is not None and len(hidden.shape) == 3 else ()
            out.append(piece("moe.topk_ids", match, view, [routing_map], combine=TopkFromRoutingMap("ids"),
                             layout=layout))
            out.append(piece("moe.topk_weights", match, view, [probs, routing_map],
                             combine=TopkFromRoutingMap("weights"), layout=layout))
        return out

    def not_exposed_in(self, dump: Dump) -> dict[str, str]:
        out = dict(self.not_exposed)
        classes = {r.module: r.module_class for r in dump.records}
        for norm, boundary, linear in (("input_layernorm", "input_norm", "self_attention.linear_qkv"),
                                       ("pre_mlp_layernorm", "pre_mlp_norm", "mlp.linear_fc1")):
            linears = (classes.get(m[: -len(norm)] + linear) for m, c in classes.items()
                       if m.endswith("." + norm) and c == "IdentityOp")
            fused = {c for c in linears if c is not None}
            if fused:
                out[boundary] = (f"the norm is fused into {'/'.join(sorted(fused))}: its output is not a "
                                 "module output (the linear's input is the pre-norm residual stream)")
        if any(m.endswith(".mlp.shared_experts") for m in classes):
            out["moe.combine"] = "MoELayer adds the shared experts' output to the routed output internally"
        if any(m.endswith(".mlp.experts") for m in classes) and _gathers_tensor_parallel_copies(dump):
            reason = ("with tensor parallelism and no sequence parallelism, Megatron's experts see every "
                      "TP rank's copy of the tokens (and the expert-TP ranks hold partial sums)")
            out.update({"moe.dispatch": reason, "moe.experts": reason})
        return out


def _gathers_tensor_parallel_copies(dump: Dump) -> bool:
    for record in dump.records:
        parallel = record.attrs.get("parallel")
        if isinstance(parallel, dict):
            tp = parallel.get("tp") or [0, 1]
            return tp[1] > 1 and not parallel.get("sp")
    return False
