"""The zoo's tiny model: a DeepSeek-shaped decoder (per-head Q/K norms, RoPE, a mixture of experts
with a shared expert, fp32) in plain torch, with SGLang's module names.

Every op whose divergence class the zoo plants is a module of its own, of a class bisect's exact
reference knows (``RMSNorm``, ``RotaryEmbedding``, ``ApplyRotaryEmb``, ``DotProductAttention``
with Megatron's contract, ``Linear``, ``LogSoftmax``); the MoE combine is the MoE module's own
code, as in SGLang and Megatron. Each op computes the trainer's way unless a planted engine
variant is set on the module (a private attribute, so capture does not record it as a setting):
both sides run the same classes and weights, and the plant is the only difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256
HIDDEN = 64
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
EXPERTS = 4
TOP_K = 3   # three slots: the order their outputs are added in matters
EXPERT_HIDDEN = 64
LAYERS = 2
ROPE_THETA = 10000.0
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _serial_sum(x: torch.Tensor) -> torch.Tensor:
    """The last dim summed left to right, one element at a time (a fixed serial tree)."""
    return x.cumsum(-1)[..., -1:]


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, the mean reduced by torch's own kernel.

    Planted variants (``_reduction``): ``serial`` sums the squares left to right (another
    reduction tree); ``bf16`` computes the variance in bf16; ``rows`` is a kernel that switches to
    the serial tree from 32 rows on (its result depends on the batch it is given)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.variance_epsilon = eps
        self._reduction = "mean"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduction = self._reduction
        if reduction == "rows":
            reduction = "serial" if x.numel() // x.shape[-1] >= 32 else "mean"
        if reduction == "serial":
            variance = _serial_sum(x.pow(2)) / x.shape[-1]
        elif reduction == "bf16":
            variance = x.bfloat16().pow(2).mean(-1, keepdim=True).float()
        else:
            variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class RotaryEmbedding(nn.Module):
    """transformers' contract: ``(x, position_ids) -> (cos, sin)``, the frequencies repeated over
    both halves, computed in float64 and rounded once to x's dtype. Planted (``_cache_dtype``):
    the table rounded through bf16 first (a cos/sin cache in the model's bf16)."""

    def __init__(self, dim: int, theta: float = ROPE_THETA):
        super().__init__()
        self.rope_theta = theta
        self.attention_scaling = 1.0
        self.dim = dim
        self._cache_dtype = torch.float64

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.rope_theta ** -(torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        angles = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(self._cache_dtype).to(x.dtype), sin.to(self._cache_dtype).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class ApplyRotaryEmb(nn.Module):
    """SGLang's contract: ``(positions, query, key) -> (query, key)``, NeoX halves over each head
    (``head_size``, ``rotary_dim``, ``base``, ``is_neox_style``), here with the cos/sin table the
    model's ``rotary_emb`` made. Planted (``_compute_dtype``): the rotation done in bf16."""

    def __init__(self, head_size: int, theta: float = ROPE_THETA):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = head_size
        self.base = theta
        self.is_neox_style = True
        self._compute_dtype = torch.float32

    def forward(self, positions, query, key, cos, sin):
        def rotate(x: torch.Tensor) -> torch.Tensor:
            heads = x.unflatten(-1, (-1, self.head_size)).to(self._compute_dtype)
            c, s = (t[..., None, :].to(self._compute_dtype) for t in (cos, sin))
            return (heads * c + _rotate_half(heads) * s).flatten(-2).to(x.dtype)

        return rotate(query), rotate(key)


class DotProductAttention(nn.Module):
    """Megatron's core-attention contract: query, key, value in [s, b, heads, d], a boolean mask
    (true: masked; causal, ``attn_mask_type``), ``softmax_scale``; out [s, b, heads * d]. Planted (``_kv_cache_dtype``):
    keys and values written to SGLang's KV pool (``MHATokenToKVPool`` of that dtype, its own
    ``set_kv_buffer``) and read back from it before attending, as an engine's attention does."""

    def __init__(self, head_dim: int, layer_number: int):
        super().__init__()
        self.softmax_scale = head_dim ** -0.5
        self.attn_mask_type = "causal"
        self.layer_number = layer_number
        self._kv_cache_dtype: torch.dtype | None = None

    def forward(self, query, key, value, attention_mask):
        if self._kv_cache_dtype is not None:
            key, value = _through_sglang_kv_pool(key, value, self._kv_cache_dtype, self.layer_number)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))     # [b, heads, s, d]
        scores = q @ k.transpose(-1, -2) * self.softmax_scale
        context = scores.masked_fill(attention_mask, float("-inf")).softmax(-1) @ v
        return context.permute(2, 0, 1, 3).flatten(-2)


def megatron_core_attention(layer_number: int) -> nn.Module:
    """megatron-core's own ``DotProductAttention`` (local spec, fp32, causal) for this model's
    heads, in place of the zoo's (megatron's process groups set up on gloo, tests/stacks)."""
    from tests.stacks.megatron import gpt_config, init_megatron

    init_megatron()
    from megatron.core.transformer.dot_product_attention import DotProductAttention as Megatron
    from megatron.core.transformer.enums import AttnMaskType

    config = gpt_config(layers=LAYERS, hidden=HIDDEN, heads=HEADS, query_groups=HEADS)
    return Megatron(config, layer_number=layer_number + 1, attn_mask_type=AttnMaskType.causal,
                    attention_type="self").eval()


def _through_sglang_kv_pool(key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype, layer: int):
    """``key`` and ``value`` [s, b, heads, d] stored in a fresh SGLang ``MHATokenToKVPool`` of
    ``dtype`` (one slot per token; slot 0 is SGLang's padding slot) and read back in their dtype."""
    from types import SimpleNamespace

    from tests.stacks.sglang import init_sglang

    init_sglang()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    s, b, heads, dim = key.shape
    pool = MHATokenToKVPool(size=s * b + 1, page_size=1, dtype=dtype, head_num=heads, head_dim=dim,
                            layer_num=layer + 1, device="cpu", enable_memory_saver=False)
    slots = torch.arange(1, s * b + 1)
    pool.set_kv_buffer(SimpleNamespace(layer_id=layer), slots, key.reshape(-1, heads, dim),
                       value.reshape(-1, heads, dim))
    return (pool.get_key_buffer(layer)[slots].reshape(key.shape).to(key.dtype),
            pool.get_value_buffer(layer)[slots].reshape(value.shape).to(value.dtype))


class Linear(nn.Linear):
    """torch's linear. Planted variants: ``_k_splits`` N sums N partial products over slices of
    the input features (tensor-parallel ranks' partial sums reduced, a GEMM's split-K tiles);
    ``_row_parallel`` multiplies this rank's slice of the input features only and all-reduces the
    partial products over the process group (gloo: a row-parallel layer at TP = world size, the
    module keeping the whole weight so that bisect replays the whole op); ``_fp8_scale``
    quantizes the input to float8_e4m3 per tensor first, with the scale ``amax / 448`` rounded up
    to a power of two (``pow2``) or not (``exact``)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self._k_splits = 1
        self._row_parallel = False
        self._fp8_scale: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fp8_scale is not None:
            scale = x.abs().amax().clamp(min=1e-12) / FP8_MAX
            if self._fp8_scale == "pow2":
                scale = torch.exp2(torch.ceil(torch.log2(scale)))
            x = (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale
        if self._row_parallel:
            ranks, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
            partial = F.linear(x.chunk(ranks, -1)[rank], self.weight.chunk(ranks, -1)[rank])
            torch.distributed.all_reduce(partial)
            return partial
        if self._k_splits == 1:
            return F.linear(x, self.weight)
        parts = zip(x.chunk(self._k_splits, -1), self.weight.chunk(self._k_splits, -1))
        partials = [F.linear(xs, ws) for xs, ws in parts]
        return torch.stack(partials).sum(0)


class LogSoftmax(nn.LogSoftmax):
    """torch's log-softmax. Planted (``_compute_dtype``): computed on logits cast to bf16."""

    def __init__(self):
        super().__init__(dim=-1)
        self._compute_dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self._compute_dtype)).to(x.dtype)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up


class Expert(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inner)
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class MoE(nn.Module):
    """Shared expert, router (softmax top-k, renormalised), routed experts, combine.

    The combine is this module's own code: each token's expert outputs weighted by its routing
    weights, summed over its top-k slots in slot order, then the shared expert's output added.
    Planted variants: ``_weights_dtype`` bf16 rounds the routing weights before they are applied;
    ``_accumulate`` ``experts`` adds the weighted outputs into the tokens expert by expert
    (``index_add_``, expert order); ``_shared_first`` starts the sum from the shared output."""

    def __init__(self, hidden: int):
        super().__init__()
        self.shared_experts = Expert(hidden, EXPERT_HIDDEN)
        self.gate = Linear(hidden, EXPERTS)
        self.experts = nn.ModuleList(Expert(hidden, EXPERT_HIDDEN) for _ in range(EXPERTS))
        self._weights_dtype = torch.float32
        self._accumulate = "slots"
        self._shared_first = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        shared = self.shared_experts(tokens)
        weights, chosen = self.gate(tokens).softmax(-1).topk(TOP_K, -1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(self._weights_dtype).float()
        slots = torch.zeros(*chosen.shape, x.shape[-1])             # [tokens, top-k, hidden]
        for index, expert in enumerate(self.experts):
            token, slot = (chosen == index).nonzero(as_tuple=True)
            if len(token):
                slots[token, slot] = expert(tokens[token]) * weights[token, slot, None]
        if self._accumulate == "experts":
            routed = torch.zeros_like(tokens)
            for index in range(EXPERTS):
                token, slot = (chosen == index).nonzero(as_tuple=True)
                routed.index_add_(0, token, slots[token, slot])
        elif self._shared_first:
            routed = shared.clone()
            for slot in range(TOP_K):
                routed = routed + slots[:, slot]
            return routed.reshape(x.shape)
        else:
            routed = slots[:, 0]
            for slot in range(1, TOP_K):
                routed = routed + slots[:, slot]
        return (routed + shared).reshape(x.shape)


class Attention(nn.Module):
    def __init__(self, layer_number: int):
        super().__init__()
        self.qkv_proj = Linear(HIDDEN, 3 * HIDDEN)
        self.q_norm = RMSNorm(HEAD_DIM)
        self.k_norm = RMSNorm(HEAD_DIM)
        self.rotary = ApplyRotaryEmb(HEAD_DIM)
        self.attn = DotProductAttention(HEAD_DIM, layer_number)
        self.o_proj = Linear(HIDDEN, HIDDEN)

    def forward(self, x, positions, cos, sin):
        q, k, v = self.qkv_proj(x).chunk(3, -1)
        q = self.q_norm(q.unflatten(-1, (HEADS, HEAD_DIM))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (HEADS, HEAD_DIM))).flatten(-2)
        q, k = self.rotary(positions, q, k, cos, sin)
        q, k, v = (t.unflatten(-1, (HEADS, HEAD_DIM)).transpose(0, 1) for t in (q, k, v))   # [s, b, h, d]
        tokens = q.shape[0]
        masked = torch.ones(tokens, tokens, dtype=torch.bool).triu(1).view(1, 1, tokens, tokens)   # True: masked
        return self.o_proj(self.attn(q, k, v, masked).transpose(0, 1))


class DecoderLayer(nn.Module):
    def __init__(self, layer_number: int):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention(layer_number)
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = MoE(HIDDEN)

    def forward(self, x, positions, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.rotary_emb = RotaryEmbedding(HEAD_DIM)
        self.layers = nn.ModuleList(DecoderLayer(number) for number in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, positions, cos, sin)
        return self.norm(x)


class ZooForCausalLM(nn.Module):
    """``(input_ids [b, s]) -> log-probs [b, s, vocab]`` of the next token at every position."""

    def __init__(self):
        super().__init__()
        self.model = Model()
        self.lm_head = Linear(HIDDEN, VOCAB)
        self.log_softmax = LogSoftmax()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return self.log_softmax(self.lm_head(self.model(input_ids, positions)))


def build(seed: int = 0) -> ZooForCausalLM:
    torch.manual_seed(seed)
    model = ZooForCausalLM().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear):
                module.weight.normal_(0, module.in_features ** -0.5)
    return model
