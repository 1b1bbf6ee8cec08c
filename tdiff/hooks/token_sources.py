"""Token sources of SGLang and megatron-core: what an outermost model call says about its tokens.

Each returns the keyword arguments of :func:`tdiff.hooks.tokens.describe_tokens` for one call (or
None when the call carries no token ids); tdiff/hooks/tokens.py registers them per framework.
Neither imports its framework: a class is looked up only in a module the program has imported.
"""

from __future__ import annotations

import sys

import torch


# ---- SGLang: the ForwardBatch every model forward is given ----
def sglang_tokens(module, args: tuple, kwargs: dict) -> dict | None:
    """A ragged batch, ``[tokens]``: the ids and positions fed, and per request the tokens it has
    in this forward (EXTEND: ``extend_seq_lens``, the cached prefix left out; DECODE: one), its
    request id (``rids``, else its row in the request-to-token pool, which a request keeps across
    steps)."""
    batch = _forward_batch(args, kwargs)
    if batch is None:
        return None
    return forward_batch_tokens(batch, input_ids=kwargs.get("input_ids", args[0] if args else None),
                                positions=kwargs.get("positions", args[1] if len(args) > 1 else None))


def forward_batch_tokens(batch, *, input_ids=None, positions=None) -> dict | None:
    """The tokens a ForwardBatch describes (``input_ids``/``positions``: those the model was given,
    when they are not the batch's own)."""
    ids = input_ids if isinstance(input_ids, torch.Tensor) else batch.input_ids
    pos = positions if isinstance(positions, torch.Tensor) else batch.positions
    mode = batch.forward_mode
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or mode is None or mode.is_idle():
        return None
    if mode.is_decode():
        lens = [1] * batch.batch_size
    elif batch.extend_seq_lens_cpu is not None:
        lens = list(batch.extend_seq_lens_cpu)
    elif batch.extend_seq_lens is not None:
        lens = batch.extend_seq_lens.tolist()
    else:
        return None   # a mode whose per-request token counts the batch does not give
    seq_ids = batch.rids
    if seq_ids is None and batch.req_pool_indices is not None:
        seq_ids = batch.req_pool_indices.tolist()
    return {"input_ids": ids, "positions": pos if isinstance(pos, torch.Tensor) and pos.shape == ids.shape else None,
            "seq_lens": lens, "seq_ids": list(seq_ids) if seq_ids is not None else None}


def _forward_batch(args: tuple, kwargs: dict):
    info = sys.modules.get("sglang.srt.model_executor.forward_batch_info")
    if info is None:
        return None
    for value in (*args, *kwargs.values()):
        if isinstance(value, info.ForwardBatch):
            return value
    return None


# ---- megatron-core: GPTModel.forward(input_ids, position_ids, attention_mask, ..., packed_seq_params) ----
_GPT_ARGUMENTS = ("input_ids", "position_ids", "attention_mask")


def megatron_tokens(module, args: tuple, kwargs: dict) -> dict | None:
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
