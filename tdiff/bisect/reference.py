"""The canonical ops of the boundary vocabulary, computed exactly enough: in float64 on a call's own
recorded inputs, with the module's own parameters and settings (never its own code, whose casts
are what the replay looks for).

A :class:`Replay` says which op a module call is and computes it; :func:`replay_for` picks it from
the module's class and its description (tdiff.store.modules). Where no canonical op fits, or what
it needs was not recorded, :class:`NoReplay` says what is missing.

    >>> replay = replay_for(description, inputs={"0": x}, outputs={"": y})
    >>> exact = replay.compute()        # {"": float64 tensor}, for each output replayed
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tdiff.store.modules import ModuleDescription

# ---- the canonical ops (float64 in, float64 out) ----


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def residual_add(residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return residual + x


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def gated(activation: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """SGLang's ``SiluAndMul`` & co.: act(first half) * second half."""
    half = x.shape[-1] // 2
    return activation(x[..., :half]) * x[..., half:]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, masked: torch.Tensor | None) -> torch.Tensor:
    """softmax(q kᵀ * scale) v over [..., heads, s, d], keys and values repeated over their query
    groups; ``masked`` (broadcastable to [..., heads, sq, sk]) true where a query must not attend."""
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = q @ k.transpose(-1, -2) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def rope_cos_sin(positions: torch.Tensor, theta: float, dim: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary table of non-interleaved RoPE: cos and sin of position * theta^(-2i/dim), the
    frequencies repeated over both halves (transformers' ``*RotaryEmbedding``)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x rotated by (cos, sin) over its last dim: halves (NeoX style) or interleaved pairs."""
    if neox:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


# ---- replays of module calls ----


@dataclass
class NoReplay:
    """No exact replay of this call: ``missing`` says what would be needed."""

    missing: str


@dataclass
class Replay:
    """One module call's canonical op: its name, the inputs it reads (by sub-name), the settings
    it used (``eps``: 1e-06), and how it computes the exact outputs (by sub-name) from them."""

    op: str
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]      # the recorded outputs it replays
    settings: dict[str, Any]
    params: dict[str, str]                # parameter name -> fingerprint
    compute_exact: Callable[[], dict[str, torch.Tensor]] = field(repr=False)

    def compute(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return self.compute_exact()


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def _f64_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _f64(t)


_EPS_NAMES = ("variance_epsilon", "eps", "epsilon", "config.layernorm_epsilon", "config.rms_norm_eps",
              "config.layer_norm_eps")
_THETA_NAMES = ("config.rope_parameters.rope_theta", "config.rope_theta", "rope_theta", "base", "rotary_base",
                "config.rotary_base")


def _setting(settings: dict, names: tuple[str, ...]) -> tuple[str, Any] | None:
    for name in names:
        if settings.get(name) is not None:
            return name, settings[name]
    return None


def _first(tensors: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    return next(iter(tensors.items()), None)


def replay_for(description: ModuleDescription | None, inputs: dict[str, torch.Tensor],
               outputs: dict[str, torch.Tensor], load: Callable[[str], torch.Tensor]) -> Replay | NoReplay:
    """The canonical op of one recorded module call: ``inputs``/``outputs`` are its recorded
    tensors by sub-name, in call order; ``load(name)`` gives the module's parameter ``name``."""
    if description is None:
        return NoReplay("the module's description (class, settings) is not in the dump: it was captured by a "
                        "tdiff that did not record one")
    cls = description.module_class
    for pattern, builder in _BUILDERS:
        if pattern.search(cls):
            return builder(description, inputs, outputs, load)
    return NoReplay(f"no canonical op is known for a `{cls}`")


def _params(description: ModuleDescription, names: tuple[str, ...], required: tuple[str, ...],
            load: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor] | NoReplay:
    if description.params is None:
        return NoReplay("its parameters were not captured (capture both sides with --params)")
    absent = [name for name in required if name not in description.params]
    if absent:
        return NoReplay(f"the `{description.module_class}` has no parameter {absent[0]!r}")
    return {name: load(name) for name in names if name in description.params}


def _norm(description, inputs, outputs, load) -> Replay | NoReplay:
    rms = "rms" in description.module_class.lower() or str(description.settings.get(
        "config.normalization", "")).lower() == "rmsnorm"
    eps = _setting(description.settings, _EPS_NAMES)
    if eps is None and "eps" not in description.settings:
        return NoReplay(f"no epsilon recorded for the `{description.module_class}`")
    params = _params(description, ("weight", "bias"), (), load)
    if isinstance(params, NoReplay):
        return params
    tensors = [(sub, t) for sub, t in inputs.items() if t.is_floating_point()]
    outs = [(sub, t) for sub, t in outputs.items() if t.is_floating_point()]
    if not tensors or not outs:
        return NoReplay("the call's input or output tensor was not recorded")
    (_, x), *rest = tensors
    # torch's RMSNorm with eps=None: the epsilon of the input's dtype
    eps_value = float(eps[1]) if eps is not None else torch.finfo(x.dtype).eps
    weight, bias = _f64_or_none(params.get("weight")), _f64_or_none(params.get("bias"))
    fused = len(rest) >= 1 and len(outs) >= 2 and rest[0][1].shape == x.shape  # SGLang: norm(x + residual)
    used_inputs = dict(tensors[:2] if fused else tensors[:1])
    used_outputs = dict(outs[:2] if fused else outs[:1])

    def exact() -> dict[str, torch.Tensor]:
        hidden = _f64(x) + _f64(rest[0][1]) if fused else _f64(x)
        normed = rms_norm(hidden, weight, eps_value) if rms else layer_norm(hidden, weight, bias, eps_value)
        results = {outs[0][0]: normed}
        if fused:
            results[outs[1][0]] = hidden
        return results

    return Replay("RMSNorm" if rms else "LayerNorm", used_inputs, used_outputs, {"eps": eps_value},
                  _fingerprints(description, ("weight", "bias")), exact)


def _linear(description, inputs, outputs, load) -> Replay | NoReplay:
    params = _params(description, ("weight", "bias"), ("weight",), load)
    if isinstance(params, NoReplay):
        return params
    x, out = _first(inputs), _first(outputs)
    if x is None or out is None:
        return NoReplay("the call's input or output tensor was not recorded")
    weight = params["weight"]
    if weight.shape[-1] != x[1].shape[-1] or weight.shape[0] != out[1].shape[-1]:
        return NoReplay(f"its weight {list(weight.shape)} does not map its input {list(x[1].shape)} to its "
                        f"output {list(out[1].shape)} (a tensor-parallel shard or a packed layout)")
    skip_bias = bool(description.settings.get("skip_bias_add", False))
    bias = None if skip_bias else _f64_or_none(params.get("bias"))
    return Replay("linear", dict([x]), dict([out]), {}, _fingerprints(description, ("weight", "bias")),
                  lambda: {out[0]: linear(_f64(x[1]), _f64(weight), bias)})


def _activation(description, inputs, outputs, load) -> Replay | NoReplay:
    cls = description.module_class.lower()
    name = next((n for n in ("silu", "relu", "sigmoid", "tanh", "gelu") if n in cls), None)
    if name is None:
        return NoReplay(f"no canonical activation is known for a `{description.module_class}`")
    if name == "gelu" and (description.settings.get("approximate") == "tanh" or "tanh" in cls):
        name = "gelu_tanh"
    x, out = _first(inputs), _first(outputs)
    if x is None or out is None:
        return NoReplay("the call's input or output tensor was not recorded")
    act = ACTIVATIONS[name]
    is_gated = "andmul" in cls
    op = f"{name} and mul" if is_gated else name
    return Replay(op, dict([x]), dict([out]), {}, {},
                  lambda: {out[0]: gated(act, _f64(x[1])) if is_gated else act(_f64(x[1]))})


def _softmax(description, inputs, outputs, load) -> Replay | NoReplay:
    log = "log" in description.module_class.lower()
    dim = description.settings.get("dim")
    x, out = _first(inputs), _first(outputs)
    if x is None or out is None:
        return NoReplay("the call's input or output tensor was not recorded")
    dim = -1 if dim is None else int(dim)
    fn = torch.log_softmax if log else torch.softmax
    return Replay("log-softmax" if log else "softmax", dict([x]), dict([out]), {"dim": dim}, {},
                  lambda: {out[0]: fn(_f64(x[1]), dim=dim)})


def _rotary(description, inputs, outputs, load) -> Replay | NoReplay:
    settings = description.settings
    theta = _setting(settings, _THETA_NAMES)
    if theta is None:
        return NoReplay(f"no RoPE theta recorded for the `{description.module_class}`")
    rope_type = settings.get("rope_type", settings.get("config.rope_parameters.rope_type", "default"))
    if rope_type not in ("default", None):
        return NoReplay(f"no canonical replay of RoPE type {rope_type!r} (only the default one)")
    ints = [(sub, t) for sub, t in inputs.items() if not t.is_floating_point()]
    floats = [(sub, t) for sub, t in inputs.items() if t.is_floating_point()]
    outs = list(outputs.items())
    if "head_size" in settings or "rotary_dim" in settings:
        return _rotary_apply(description, float(theta[1]), ints, floats, outs)
    if not ints or len(outs) != 2:
        return NoReplay(f"the `{description.module_class}` call does not take positions and give (cos, sin)")
    positions = ints[-1][1]
    dim = outs[0][1].shape[-1]
    scaling = float(settings.get("attention_scaling", 1.0))
    used = {"theta": float(theta[1]), "scaling": scaling}

    def exact() -> dict[str, torch.Tensor]:
        cos, sin = rope_cos_sin(positions, float(theta[1]), dim, scaling)
        return {outs[0][0]: cos, outs[1][0]: sin}

    return Replay("RoPE", dict(ints[-1:]), dict(outs), used, {}, exact)


def _rotary_apply(description, theta, ints, floats, outs) -> Replay | NoReplay:
    """SGLang's ``RotaryEmbedding.forward(positions, query, key)``: q and k rotated in place of
    their heads' first ``rotary_dim`` dims."""
    settings = description.settings
    if not ints or len(floats) < 2 or len(outs) < 2:
        return NoReplay(f"the `{description.module_class}` call does not take (positions, query, key)")
    head = int(settings.get("head_size", 0))
    rotary = int(settings.get("rotary_dim", head))
    neox = bool(settings.get("is_neox_style", True))
    if not head or not rotary:
        return NoReplay(f"no head size recorded for the `{description.module_class}`")
    positions = ints[0][1]
    used = {"theta": theta, "rotary_dim": rotary, "neox": neox}

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = _f64(x).reshape(*x.shape[:-1], -1, head)
        cos, sin = rope_cos_sin(positions, theta, rotary, 1.0)
        half = rotary // 2
        cos, sin = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
        rotated = apply_rope(heads[..., :rotary], cos, sin, neox)
        return torch.cat((rotated, heads[..., rotary:]), dim=-1).reshape(x.shape)

    def exact() -> dict[str, torch.Tensor]:
        return {outs[0][0]: rotate(floats[0][1]), outs[1][0]: rotate(floats[1][1])}

    return Replay("RoPE", dict([ints[0], *floats[:2]]), dict(outs[:2]), used, {}, exact)


def _core_attention(description, inputs, outputs, load) -> Replay | NoReplay:
    """Megatron's ``DotProductAttention(query, key, value, attention_mask)``: [s, b, heads, d]
    in, [sq, b, heads * d] out; the mask true where a query must not attend, or causal by
    ``attn_mask_type`` where none is given."""
    settings = description.settings
    scale = settings.get("softmax_scale")
    floats = [(sub, t) for sub, t in inputs.items() if t.is_floating_point()]
    masks = [t for t in inputs.values() if t.dtype == torch.bool]
    out = _first(outputs)
    if scale is None or len(floats) < 3 or out is None or floats[0][1].dim() != 4:
        return NoReplay(f"the `{description.module_class}` call is not (query, key, value) in [s, b, heads, d] "
                        "with a recorded softmax_scale")
    causal = not masks and settings.get("attn_mask_type") == "causal"
    if not masks and not causal:
        return NoReplay(f"the `{description.module_class}`'s mask was not recorded (attn_mask_type "
                        f"{settings.get('attn_mask_type')!r}, no mask tensor)")
    (_, q), (_, k), (_, v) = floats[:3]

    def exact() -> dict[str, torch.Tensor]:
        qh, kh, vh = (_f64(t).permute(1, 2, 0, 3) for t in (q, k, v))   # [b, heads, s, d]
        sq, sk = q.shape[0], k.shape[0]
        masked = masks[0] if masks else torch.ones(sq, sk, dtype=torch.bool).triu(1)
        context = attention(qh, kh, vh, float(scale), masked)            # [b, heads, sq, d]
        return {out[0]: context.permute(2, 0, 1, 3).reshape(out[1].shape)}

    used = {"softmax_scale": float(scale), "mask": "causal" if causal else "given"}
    return Replay("attention core", dict(floats[:3]), dict([out]), used, {}, exact)


def _fingerprints(description: ModuleDescription, names: tuple[str, ...]) -> dict[str, str]:
    params = description.params or {}
    return {name: params[name].fingerprint for name in names if name in params}


# (class-name pattern, replay builder): the first that matches wins
_BUILDERS: list[tuple[re.Pattern, Callable[..., Replay | NoReplay]]] = [
    (re.compile(r"rotary|rope", re.IGNORECASE), _rotary),
    (re.compile(r"^dotproductattention$", re.IGNORECASE), _core_attention),
    (re.compile(r"norm", re.IGNORECASE), _norm),
    (re.compile(r"logsoftmax|^softmax$", re.IGNORECASE), _softmax),
    (re.compile(r"silu|gelu|relu|^sigmoid$|^tanh$|andmul", re.IGNORECASE), _activation),
    (re.compile(r"^linear$|parallellinear|^replicatedlinear$", re.IGNORECASE), _linear),
]


def correctly_rounded(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exact`` (float64) rounded once to ``dtype``, to nearest, ties to even. torch's float64 to
    bfloat16/float16 goes through float32 and can round twice; rounding to odd in float32 first
    (its 24 bits are more than 2 past the target's) makes the second rounding the correct one."""
    if dtype in (torch.float64, torch.float32):
        return exact.to(dtype)
    single = exact.to(torch.float32)
    inexact = single.to(torch.float64) != exact
    bits = single.view(torch.int32)
    # round to odd: truncate toward zero where rounding went away from it, then set the last bit
    away = inexact & (single.to(torch.float64).abs() > exact.abs())
    bits = torch.where(away, bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(torch.float32).to(dtype)

