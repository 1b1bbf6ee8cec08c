"""SGLang's capture knowledge: its records' parallel coordinates and shard specs (the annotator),
the tokens of the ForwardBatch every model forward is given (the token source), and the tokens
and real rows of each decode step its CUDA graph runner replays.

Nothing here imports SGLang: a class is looked up only in a module the program has imported.
"""

from __future__ import annotations

import sys

import torch

from tdiff.hooks.active import active_capture

FRAMEWORK = "sglang"


# ---- the annotator ----
_COLUMN = {"QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear"}
_SPLIT_FEATURES = {"RadixAttention", "RotaryEmbedding", "SiluAndMul", "GeluAndMul"}

_parallel: dict | None = None


def annotate(module, path: str, role: str, sub: str, tensor) -> dict | None:
    """attrs for an SGLang module's record: parallel coordinates and shard spec (distributed runs)."""
    parallel = _parallel_info()
    if parallel is None:
        return None
    attrs: dict[str, object] = {"parallel": parallel}
    spec = _shard_spec(module, role, sub)
    if spec:
        attrs["shard"] = spec
    return attrs


def _parallel_info() -> dict | None:
    global _parallel
    if _parallel is None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None
        if torch.distributed.get_world_size() == 1:
            return None
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        _parallel = {"tp": [p.tp_rank, p.tp_size], "pp": [p.pp_rank, p.pp_size],
                     "ep": [p.moe_ep_rank, p.moe_ep_size], "etp": [p.moe_tp_rank, p.moe_tp_size],
                     "dp": [p.attn_dp_rank, p.attn_dp_size]}
    return _parallel


def _shard_spec(module, role: str, sub: str) -> list[dict] | None:
    cls = type(module).__name__
    if cls in _COLUMN:
        return [{"axis": "tp", "dim": -1}] if role == "output" and sub == "0" else None
    if cls == "RowParallelLinear":
        if role == "input":
            return [{"axis": "tp", "dim": -1}]
        if sub == "0" and not getattr(module, "reduce_results", True):
            return [{"axis": "tp", "reduce": "sum"}]
        return None
    if cls in _SPLIT_FEATURES:
        tensors = {"RotaryEmbedding": ("1", "2") if role == "input" else ("0", "1")}.get(cls)
        return [{"axis": "tp", "dim": -1}] if tensors is None or sub in tensors else None
    if cls == "FusedMoE" and role == "output" and not getattr(module, "reduce_results", True):
        return [{"axis": "etp", "reduce": "sum"}, {"axis": "ep", "reduce": "sum"}]
    return None


# ---- the token source: the ForwardBatch every model forward is given ----
def tokens(module, args: tuple, kwargs: dict) -> dict | None:
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
        lens = batch.extend_seq_lens   # (tensors stay tensors: copied to the host without a wait)
    else:
        return None   # a mode whose per-request token counts the batch does not give
    seq_ids = batch.rids
    if seq_ids is None:
        seq_ids = batch.req_pool_indices
    return {"input_ids": ids, "positions": pos if isinstance(pos, torch.Tensor) and pos.shape == ids.shape else None,
            "seq_lens": lens, "seq_ids": seq_ids}   # (copied where the tokens are described)


def _forward_batch(args: tuple, kwargs: dict):
    info = sys.modules.get("sglang.srt.model_executor.forward_batch_info")
    if info is None:
        return None
    for value in (*args, *kwargs.values()):
        if isinstance(value, info.ForwardBatch):
            return value
    return None


# ---- CUDA graph replays ----
def _describe_replays(module) -> None:
    """SGLang's decode graph runner replays a graph per decode step (``execute(forward_batch)``):
    before the replay, tell capture that step's tokens and real rows, from the ForwardBatch (the
    graph runs a batch padded up to the size it was captured for)."""
    runner = module.DecodeCudaGraphRunner
    execute = runner.execute

    def described_execute(self, forward_batch, *args, **kwargs):
        capture = active_capture()
        if capture is not None:
            given = forward_batch_tokens(forward_batch)
            if given is not None:
                capture.tokens(**given)
            if forward_batch.forward_mode.is_decode():
                capture.graphs.next_rows = forward_batch.batch_size
        return execute(self, forward_batch, *args, **kwargs)

    runner.execute = described_execute


# (module, hook run when the program imports it): the runner that replays decode steps as graphs
GRAPH_RUNNERS = (("sglang.srt.model_executor.runner.decode_cuda_graph_runner", _describe_replays),)
