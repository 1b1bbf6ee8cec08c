"""megatron-core GPTModel on the CPU: gloo, the local (non-TransformerEngine) layer spec."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.stacks import free_port


def init_megatron(tensor_parallel: int = 1, *, rank: int = 0, world_size: int = 1,
                  port: int | None = None) -> None:
    """Initialise torch.distributed (gloo) and Megatron's parallel state, once per process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        # ranks started by torchrun meet at its MASTER_PORT; a lone process takes a free port and
        # leaves the environment alone (a port exported here would follow every subprocess)
        init = "env://" if world_size > 1 else f"tcp://127.0.0.1:{port or free_port()}"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    # Megatron asks torch.cuda for the current device in RoPE, linear layers and attention
    setattr(torch.cuda, "current_device", lambda: "cpu")  # noqa: B010 (mypy: torch declares it returns an int)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel, 1)
    # model_parallel_cuda_manual_seed needs CUDA; the inference tracker makes fork() a no-op
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # referenced without TransformerEngine (0.16)
        moe_utils.te_general_gemm = None


def gpt_config(*, layers: int = 2, hidden: int = 64, heads: int = 4, query_groups: int = 2,
               ffn: int = 128, experts: int | None = None, topk: int = 2,
               shared_expert_ffn: int | None = None, dtype=torch.float32, **overrides):
    """A Qwen2/Qwen3-like TransformerConfig: RMSNorm, SwiGLU, GQA, no biases, RoPE."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
              num_query_groups=query_groups, ffn_hidden_size=ffn, normalization="RMSNorm",
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              layernorm_epsilon=1e-6, use_cpu_initialization=True, bias_activation_fusion=False,
              masked_softmax_fusion=False, persist_layer_norm=False,
              gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
              hidden_dropout=0.0, attention_dropout=0.0)
    if dtype == torch.bfloat16:
        kw.update(bf16=True, params_dtype=torch.bfloat16)
    if experts:
        kw.update(num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="allgather",
                  moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
                  moe_router_load_balancing_type="none", moe_ffn_hidden_size=ffn)
        if shared_expert_ffn:
            kw.update(moe_shared_expert_intermediate_size=shared_expert_ffn)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(config, *, vocab: int = 128, max_sequence: int = 64, qk_layernorm: bool = False,
              rotary_base: int = 10000, seed: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=qk_layernorm, normalization="RMSNorm")
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                     max_sequence_length=max_sequence, position_embedding_type="rope",
                     rotary_base=rotary_base, share_embeddings_and_output_weights=False)
    return model.eval()


def gpt_forward(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal forward of [batch, seq] token ids; returns logits [batch, seq, vocab]."""
    batch, seq = input_ids.shape
    device = input_ids.device
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril().logical_not().view(1, 1, seq, seq)
    with torch.no_grad():
        return model(input_ids=input_ids, position_ids=positions, attention_mask=mask)
