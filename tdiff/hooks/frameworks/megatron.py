"""megatron-core's capture knowledge: its records' parallel coordinates and shard specs (the
annotator), and the tokens of a GPTModel forward (the token source).

Nothing here imports megatron-core until a distributed run asks for its parallel state.
"""

from __future__ import annotations

import torch

FRAMEWORK = "megatron"


# ---- the annotator ----
_COLUMN = {"ColumnParallelLinear", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear",
           "TEColumnParallelGroupedLinear"}
_ROW = {"RowParallelLinear", "TERowParallelLinear", "TERowParallelGroupedLinear"}
_ATTENTION = {"DotProductAttention", "TEDotProductAttention"}
_EXPERTS = {"SequentialMLP", "GroupedMLP", "TEGroupedMLP"}
# modules whose hidden-state inputs and outputs are split over the sequence under sequence parallelism
_SEQUENCE_SHARDED = {"TransformerLayer", "TransformerBlock", "MoELayer", "TopKRouter", "IdentityOp",
                     "LanguageModelEmbedding"}
_HIDDEN_SUBS = {"", "0", "hidden_states"}

_parallel: dict | None = None
_sequence_parallel = False


def annotate(module, path: str, role: str, sub: str, tensor) -> dict | None:
    """attrs for a Megatron module's record: the rank's parallel coordinates (when the run is
    distributed) and the tensor's shard spec over them."""
    global _sequence_parallel
    config = getattr(module, "config", None)
    if getattr(config, "sequence_parallel", False):
        _sequence_parallel = True
    parallel = _parallel_info()
    if parallel is None:
        return None
    attrs: dict[str, object] = {"parallel": parallel}
    spec = _shard_spec(module, path, role, sub)
    if spec:
        attrs["shard"] = spec
    return attrs


def _parallel_info() -> dict | None:
    global _parallel
    if _parallel is not None:
        return dict(_parallel, sp=_sequence_parallel) if _sequence_parallel else _parallel
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if torch.distributed.get_world_size() == 1:
        return None
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None  # not cached: Megatron initialises its parallel state after torch.distributed
    _parallel = {
        "tp": [ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()],
        "pp": [ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()],
        "dp": [ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()],
        "ep": [ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()],
        "etp": [ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()],
        "edp": [ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size()],
    }
    return _parallel_info()


def _shard_spec(module, path: str, role: str, sub: str) -> list[dict] | None:
    cls = type(module).__name__
    expert = bool(getattr(module, "is_expert", False))
    tp = "etp" if expert else "tp"
    sequence = [{"axis": "tp", "dim": 0}] if _sequence_parallel and not expert else None
    if cls in _COLUMN:
        if role == "output":
            return None if getattr(module, "gather_output", False) else [{"axis": tp, "dim": -1}]
        return sequence
    if cls in _ROW:
        if role == "input":
            return [{"axis": tp, "dim": -1}]
        if sub != "0":
            return None                               # the bias: replicated
        return [{"axis": "etp", "reduce": "sum"}] if expert else sequence
    if cls in _ATTENTION:
        if role == "output":
            return [{"axis": "tp", "dim": -1}]
        return [{"axis": "tp", "dim": -2}] if sub in ("0", "1", "2", "query", "key", "value") else None
    if path.endswith(("q_layernorm", "k_layernorm")):
        return [{"axis": "tp", "dim": -2}]
    if cls in _EXPERTS:
        # routed tokens are split over expert-parallel ranks; expert-TP ranks hold partial outputs
        partial = [{"axis": "etp", "reduce": "sum"}] if role == "output" else []
        return [{"axis": "ep", "dim": 0}] + partial
    if sequence and cls == "TopKRouter" and role == "output":
        return sequence   # probabilities and routing map: one row per token of the rank's part
    if sequence and sub in _HIDDEN_SUBS and (cls in _SEQUENCE_SHARDED or "Norm" in cls):
        return sequence
    return None


# ---- megatron-core: GPTModel.forward(input_ids, position_ids, attention_mask, ..., packed_seq_params) ----
_GPT_ARGUMENTS = ("input_ids", "position_ids", "attention_mask")


def tokens(module, args: tuple, kwargs: dict) -> dict | None:
    """Packed THD (``packed_seq_params.qkv_format == "thd"``): ``[tokens]``, one sequence per
    ``cu_seqlens_q`` segment (with ``cu_seqlens_q_padded``, each segment's tail past its real
    length is padding). Else ``[batch, seq]`` rows, one sequence each; a token is padding where
    the attention mask hides it from itself (a pad key column is masked for every query).

    Positions are counted along each sequence, not read from ``position_ids``: GPTModel's RoPE
    ignores them (it rotates by index along the sequence dimension)."""
    # by GPTModel's parameter order, not the called module's signature: Megatron's wrappers
    # (Float16Module, DistributedDataParallel) take *inputs
    given = dict(zip(_GPT_ARGUMENTS, args))
    given.update((k, v) for k, v in kwargs.items() if k in (*_GPT_ARGUMENTS, "packed_seq_params"))
    ids = given.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return None
    packed = given.get("packed_seq_params")
    if packed is not None and getattr(packed, "qkv_format", None) == "thd":
        return _packed_tokens(ids.reshape(-1), packed)
    mask = given.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 \
            and mask.shape[-1] == mask.shape[-2] == ids.shape[1] and mask.shape[0] in (1, ids.shape[0]):
        hidden_from_itself = mask[:, 0].diagonal(dim1=-2, dim2=-1).detach().cpu()   # [b or 1, s]
        return {"input_ids": ids, "mask": ~hidden_from_itself.expand(ids.shape)}
    return {"input_ids": ids}


def _packed_tokens(ids: torch.Tensor, packed) -> dict:
    real = packed.cu_seqlens_q.detach().cpu().long()
    padded = getattr(packed, "cu_seqlens_q_padded", None)
    if padded is None:
        return {"input_ids": ids, "seq_lens": real.diff()}
    padded = padded.detach().cpu().long()
    cells = torch.arange(len(ids))
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for start, length in zip(padded[:-1].tolist(), real.diff().tolist()):
        mask |= (cells >= start) & (cells < start + length)
    return {"input_ids": ids, "seq_lens": padded.diff(), "mask": mask}
