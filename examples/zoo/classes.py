"""The zoo's registry: one entry per divergence class of the DeepSeek-V4 true-on-policy work.

An entry says where the engine's variant is planted (module paths, as regular expressions, and
the private attribute set on them: examples/zoo/model.py documents each), what bisect should
name (the module, and the boundary kind) and which cause it should find. Adding a class is
adding one entry (docs/ZOO.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plant:
    """Set ``attribute`` to ``value`` on every module whose path matches ``module`` (re.fullmatch)."""

    module: str
    attribute: str
    value: str | int | bool


@dataclass(frozen=True)
class ZooClass:
    key: str                     # the name on the command line
    title: str                   # the class, as the table says it
    engine: tuple[Plant, ...]    # the engine side's variant (the trainer side computes the reference way)
    named: str                   # the module bisect should name (re.fullmatch)
    cause: str                   # the cause class bisect should find
    side: str | None = None      # "engine" / "trainer" where the cause names one
    both: tuple[Plant, ...] = ()  # set on both sides (a kernel both run)
    engine_batch: int = 1        # sequences the engine scores in one batch (the first is compared)
    ops: str | None = None       # capture --ops REGEX: record the ATen ops of these modules' forwards
    ranks: int = 1               # processes per side (torchrun, gloo): the engine's tensor parallelism
    megatron_attention: bool = False  # the trainer's core attention is megatron-core's DotProductAttention
    note: str = ""               # what the variant does, for the table's "planted where"


LAYER1 = r"model\.layers\.1"
MOE = LAYER1 + r"\.mlp"

CLASSES: tuple[ZooClass, ...] = (
    ZooClass("norm-tree", "RMSNorm reduction tree",
             (Plant(LAYER1 + r"\.post_attention_layernorm", "_reduction", "serial"),),
             named=LAYER1 + r"\.post_attention_layernorm", cause="rounding",
             note="sum of squares reduced left to right (fp32)"),
    ZooClass("qk-norm", "Q/KV norm",
             (Plant(LAYER1 + r"\.self_attn\.k_norm", "_reduction", "bf16"),),
             named=LAYER1 + r"\.self_attn\.k_norm", cause="precision", side="engine",
             note="K norm's variance in bf16"),
    ZooClass("rope-generation", "RoPE generation precision",
             (Plant(r"model\.rotary_emb", "_cache_dtype", "bfloat16"),),
             named=r"model\.rotary_emb", cause="precision", side="engine",
             note="cos/sin table rounded through bf16"),
    ZooClass("rope-application", "RoPE application",
             (Plant(LAYER1 + r"\.self_attn\.rotary", "_compute_dtype", "bfloat16"),),
             named=LAYER1 + r"\.self_attn\.rotary", cause="precision", side="engine",
             note="q and k rotated in bf16"),
    ZooClass("kv-cache-cast", "KV-cache write cast",
             (Plant(LAYER1 + r"\.self_attn\.attn", "_kv_cache_dtype", "bfloat16"),),
             named=LAYER1 + r"\.self_attn\.attn", cause="precision", side="engine", megatron_attention=True,
             note="keys and values written to SGLang's KV pool (`MHATokenToKVPool`) in bf16 and read back; "
                  "the trainer attends with megatron-core's `DotProductAttention`"),
    ZooClass("tp-reduction", "TP reduction order",
             (Plant(LAYER1 + r"\.self_attn\.o_proj", "_row_parallel", True),),
             named=LAYER1 + r"\.self_attn\.o_proj", cause="rounding", ranks=2,
             note="row-parallel o_proj at TP=2: each rank's partial product all-reduced over gloo (the "
                  "trainer's two ranks run it whole)"),
    ZooClass("fp8-scale", "FP8 quantization scale rounding",
             (Plant(MOE + r"\.shared_experts\.down_proj", "_fp8_scale", "exact"),),
             both=(Plant(MOE + r"\.shared_experts\.down_proj", "_fp8_scale", "pow2"),),
             named=MOE + r"\.shared_experts\.down_proj", cause="precision",
             note="input quantized to float8_e4m3, scale amax/448 (trainer: rounded up to a power of two)"),
    ZooClass("grouped-gemm", "grouped-GEMM accumulation order",
             (Plant(MOE + r"\.experts\.\d+\.down_proj", "_k_splits", 4),),
             named=MOE + r"\.experts\.\d+\.down_proj", cause="rounding",
             note="experts' down projection accumulated in 4 K-tiles"),
    ZooClass("routing-weight-cast", "routing-weight cast timing",
             (Plant(MOE, "_weights_dtype", "bfloat16"),), named=MOE, cause="precision", side="engine",
             ops=MOE, note="routing weights rounded to bf16 before they are applied"),
    ZooClass("expert-accumulation", "expert/token accumulation order",
             (Plant(MOE, "_accumulate", "experts"),), named=MOE, cause="rounding", ops=MOE,
             note="weighted expert outputs added into the tokens expert by expert (index_add_)"),
    ZooClass("shared-expert-reduction", "shared-expert reduction",
             (Plant(MOE + r"\.shared_experts\.down_proj", "_k_splits", 2),),
             named=MOE + r"\.shared_experts\.down_proj", cause="rounding",
             note="shared expert's down projection: two ranks' partial sums reduced"),
    ZooClass("routed-shared-order", "routed + shared addition order",
             (Plant(MOE, "_shared_first", True),), named=MOE, cause="rounding", ops=MOE,
             note="the routed outputs added onto the shared one, not the shared onto their sum"),
    ZooClass("logsoftmax-precision", "log-softmax precision",
             (Plant(r"log_softmax", "_compute_dtype", "bfloat16"),),
             named=r"log_softmax", cause="precision", side="engine",
             note="log-softmax of the logits cast to bf16"),
    ZooClass("batch-invariance", "batch invariance",
             (), both=(Plant(r".*norm", "_reduction", "rows"),), engine_batch=2,
             named=r"model\.layers\.0\.input_layernorm", cause="rounding",
             note="both sides' RMSNorm switch reduction tree at 32 rows; the engine scores 2 sequences "
                  "in one batch, the trainer 1"),
)


def by_key(key: str) -> ZooClass:
    for zoo_class in CLASSES:
        if zoo_class.key == key:
            return zoo_class
    raise KeyError(f"no zoo class {key!r}; known: {', '.join(c.key for c in CLASSES)}")
