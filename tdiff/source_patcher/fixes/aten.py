"""Overrides of aten ops through ``torch.library`` (in the spirit of thinking-machines'
batch_invariant_ops): log-softmax in fp32, and batch-invariant matmul, mean and log-softmax.

Batch-invariant here means a row's result does not depend on the other rows of its batch: every
row is computed by the same library kernel, called on that row alone, with the same shape and a
freshly allocated (so equally aligned) copy of its data. Library kernels pick blocking, vector
paths and reduction splits by shape; with one shape per row they pick the same ones whatever the
batch. (It is not device-invariant, and attention kernels are not covered.)

The overrides call the ops' ``.out`` variants, which are not overridden, to reach the original
kernels. One registry owns every override so that modes combine: with log-softmax in fp32 and
batch-invariant log-softmax both on, a bf16 input is upcast and then computed row by row.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable

import torch

LOG_SOFTMAX_FP32 = "log_softmax_fp32"
BATCH_INVARIANT_MATMUL = "batch_invariant_matmul"
BATCH_INVARIANT_MEAN = "batch_invariant_mean"
BATCH_INVARIANT_LOG_SOFTMAX = "batch_invariant_log_softmax"
DISPATCH_KEYS = ("CPU", "CUDA")
_HALF = (torch.bfloat16, torch.float16)

_active: Counter = Counter()
_library: torch.library.Library | None = None


def enable(mode: str) -> Callable[[], None]:
    """Turn ``mode`` on; returns the function that turns it off again."""
    if mode not in _OPS_OF_MODE:
        raise ValueError(f"unknown override mode {mode!r}")
    _active[mode] += 1
    _register()
    done: list[bool] = []

    def disable() -> None:
        if not done:
            done.append(True)
            _active[mode] -= 1
            _register()
    return disable


def active_modes() -> set[str]:
    return {mode for mode, count in _active.items() if count > 0}


def enable_log_softmax_fp32() -> Callable[[], None]:
    return enable(LOG_SOFTMAX_FP32)


def enable_batch_invariant_matmul() -> Callable[[], None]:
    return enable(BATCH_INVARIANT_MATMUL)


def enable_batch_invariant_mean() -> Callable[[], None]:
    return enable(BATCH_INVARIANT_MEAN)


def enable_batch_invariant_log_softmax() -> Callable[[], None]:
    return enable(BATCH_INVARIANT_LOG_SOFTMAX)


def _register() -> None:
    """(Re)build the one library of overrides for the ops the active modes need."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
    ops = sorted({op for mode in active_modes() for op in _OPS_OF_MODE[mode]})
    if not ops:
        return
    _library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
        for op in ops:
            for key in DISPATCH_KEYS:
                _library.impl(f"aten::{op}", _KERNELS[op], key)


def _row(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a.new_empty((a.shape[0], b.shape[1]))
    for i in range(a.shape[0]):
        out[i:i + 1] = torch.ops.aten.mm.out(_row(a[i:i + 1]), b, out=a.new_empty((1, b.shape[1])))
    return out


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    bias = bias.expand(a.shape[0], b.shape[1])
    out = a.new_empty((a.shape[0], b.shape[1]))
    for i in range(a.shape[0]):
        out[i:i + 1] = torch.ops.aten.addmm.out(_row(bias[i:i + 1]), _row(a[i:i + 1]), b, beta=beta, alpha=alpha,
                                                out=a.new_empty((1, b.shape[1])))
    return out


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    for j in range(a.shape[0]):
        out[j] = _mm(a[j], _row(b[j]))
    return out


def _mean(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    kept = [d for d in range(x.dim()) if d not in dims]
    rows = x.permute(*kept, *dims).reshape(-1, max(1, _numel(x, dims)))
    result_dtype = dtype or x.dtype
    out = torch.empty(rows.shape[0], dtype=result_dtype, device=x.device)
    for i in range(rows.shape[0]):
        out[i:i + 1] = torch.ops.aten.mean.out(_row(rows[i:i + 1]), [1], False, dtype=dtype,
                                               out=torch.empty(1, dtype=result_dtype, device=x.device))
    out = out.reshape([x.shape[d] for d in kept])
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def _numel(x: torch.Tensor, dims: list[int]) -> int:
    size = 1
    for d in dims:
        size *= x.shape[d]
    return size


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    if LOG_SOFTMAX_FP32 in active_modes() and x.dtype in _HALF:
        x, half_to_float = x.float(), False
    out_dtype = torch.float32 if half_to_float else x.dtype
    if BATCH_INVARIANT_LOG_SOFTMAX not in active_modes():
        return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=torch.empty(x.shape, dtype=out_dtype,
                                                                                       device=x.device))
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1]) if moved.dim() else moved.reshape(1, 1)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    for i in range(rows.shape[0]):
        out[i:i + 1] = torch.ops.aten._log_softmax.out(_row(rows[i:i + 1]), 1, half_to_float,
                                                       out=torch.empty((1, rows.shape[1]), dtype=out_dtype,
                                                                       device=x.device))
    return out.reshape(moved.shape).movedim(-1, dim)


_KERNELS = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "mean.dim": _mean, "_log_softmax": _log_softmax}
_OPS_OF_MODE = {
    LOG_SOFTMAX_FP32: ("_log_softmax",),
    BATCH_INVARIANT_MATMUL: ("mm", "addmm", "bmm"),
    BATCH_INVARIANT_MEAN: ("mean.dim",),
    BATCH_INVARIANT_LOG_SOFTMAX: ("_log_softmax",),
}
