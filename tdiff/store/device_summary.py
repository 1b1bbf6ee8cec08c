"""Statistics and the mix64 fingerprint of a GPU tensor in one pass over its memory (Triton).

Stats mode must cost little next to the forward pass. Computed with torch ops, a tensor's
summary takes a dozen kernels and as many passes over its memory; this one kernel reads it once:
each block writes its partials, and the last block to finish folds them in block order
(deterministic) into ``[min, max, mean, abs_mean, nan, inf, digest]`` — the same values and the
same mix64 digest as :func:`tdiff.store.fingerprint.tensor_stats` and
:func:`tdiff.store.fingerprint.mix64_fingerprint_tensor` (integer sums modulo 2**64 do not depend
on their order).

Floating tensors whose bytes fill whole 8-byte words take this path; others fall back to torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tdiff.store.fingerprint import MIX_INCREMENT, MIX_MULTIPLIER_1, MIX_MULTIPLIER_2

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 4096
_FOLD = 1024


@triton.jit
def _xorshift_right(z, shift: tl.constexpr):
    """``z ^ (z >>> shift)`` on int64 (``>>`` is arithmetic there: the mask makes it logical)."""
    return z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))


@triton.jit
def _splitmix64_finalize(z, multiplier_1, multiplier_2):
    z = _xorshift_right(z, 30) * multiplier_1
    z = _xorshift_right(z, 27) * multiplier_2
    return _xorshift_right(z, 31)


@triton.jit
def _summary_kernel(values, words, partial_f, partial_i, finished, out_f, out_i, numel, nwords,
                    increment, multiplier_1, multiplier_2,
                    BLOCK: tl.constexpr, WORDS: tl.constexpr, FOLD: tl.constexpr):
    """Each program summarises one block into the partials; the last program to finish folds
    them, in block order, into out_f[0:6] and the digest into out_i[6]."""
    pid = tl.program_id(0)
    index = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: logits exceed 2**31 elements
    inside = index < numel
    x = tl.load(values + index, mask=inside, other=0).to(tl.float32)
    is_nan = x != x  # noqa: PLR0124 - NaN is the one value unequal to itself (Triton's test for it)
    is_inf = (x == float("inf")) | (x == float("-inf"))
    numeric = inside & ~is_nan
    finite = numeric & ~is_inf
    kept = tl.where(finite, x, 0.0)
    word_index = pid.to(tl.int64) * WORDS + tl.arange(0, WORDS)
    word_inside = word_index < nwords
    word = tl.load(words + word_index, mask=word_inside, other=0)
    key = _splitmix64_finalize((word_index + 1) * increment, multiplier_1, multiplier_2)
    mixed = _splitmix64_finalize(word ^ key, multiplier_1, multiplier_2)
    tl.store(partial_f + pid * 4 + 0, tl.min(tl.where(numeric, x, float("inf")), axis=0))
    tl.store(partial_f + pid * 4 + 1, tl.max(tl.where(numeric, x, float("-inf")), axis=0))
    tl.store(partial_f + pid * 4 + 2, tl.sum(kept, axis=0))
    tl.store(partial_f + pid * 4 + 3, tl.sum(tl.abs(kept), axis=0))
    tl.store(partial_i + pid * 3 + 0, tl.sum((inside & is_nan).to(tl.int64), axis=0))
    tl.store(partial_i + pid * 3 + 1, tl.sum((inside & is_inf).to(tl.int64), axis=0))
    tl.store(partial_i + pid * 3 + 2, tl.sum(tl.where(word_inside, mixed, 0), axis=0))
    blocks = tl.num_programs(0)
    # release: this program's partials are visible to whoever sees the count; acquire: the last
    # program sees everyone's
    if tl.atomic_add(finished, 1, sem="acq_rel") == blocks - 1:
        lo = tl.full((FOLD,), float("inf"), tl.float32)
        hi = tl.full((FOLD,), float("-inf"), tl.float32)
        total = tl.zeros((FOLD,), tl.float64)
        abs_total = tl.zeros((FOLD,), tl.float64)
        nans = tl.zeros((FOLD,), tl.int64)
        infs = tl.zeros((FOLD,), tl.int64)
        digest = tl.zeros((FOLD,), tl.int64)
        for start in range(0, blocks, FOLD):
            block = start + tl.arange(0, FOLD)
            ok = block < blocks
            lo = tl.minimum(lo, tl.load(partial_f + block * 4 + 0, mask=ok, other=float("inf")))
            hi = tl.maximum(hi, tl.load(partial_f + block * 4 + 1, mask=ok, other=float("-inf")))
            total += tl.load(partial_f + block * 4 + 2, mask=ok, other=0).to(tl.float64)
            abs_total += tl.load(partial_f + block * 4 + 3, mask=ok, other=0).to(tl.float64)
            nans += tl.load(partial_i + block * 3 + 0, mask=ok, other=0)
            infs += tl.load(partial_i + block * 3 + 1, mask=ok, other=0)
            digest += tl.load(partial_i + block * 3 + 2, mask=ok, other=0)
        n_nan = tl.sum(nans, axis=0)
        n_inf = tl.sum(infs, axis=0)
        n_finite = tl.maximum(numel - n_nan - n_inf, 1).to(tl.float64)
        tl.store(out_f + 0, tl.min(lo, axis=0).to(tl.float64))
        tl.store(out_f + 1, tl.max(hi, axis=0).to(tl.float64))
        tl.store(out_f + 2, tl.sum(total, axis=0) / n_finite)
        tl.store(out_f + 3, tl.sum(abs_total, axis=0) / n_finite)
        tl.store(out_f + 4, n_nan.to(tl.float64))
        tl.store(out_f + 5, n_inf.to(tl.float64))
        tl.store(out_i + 6, tl.sum(digest, axis=0))
        tl.store(finished, 0)  # ready for the next tensor


def fused_summary_supported(tensor: torch.Tensor) -> bool:
    return (tensor.dtype in FUSED_DTYPES and tensor.is_contiguous() and tensor.numel() > 0
            and (tensor.numel() * tensor.element_size()) % 8 == 0
            and tensor.storage_offset() * tensor.element_size() % 8 == 0)


def fused_summary_into(tensor: torch.Tensor, out: torch.Tensor, finished: torch.Tensor) -> None:
    """Write ``[min, max, mean, abs_mean, nan, inf, digest bits]`` into ``out`` (7 float64 on the
    tensor's device; the last is the int64 mix64 digest, reinterpreted): one kernel launch, no
    host synchronisation. ``finished`` is a zeroed int32 counter the kernel leaves zeroed again."""
    values = tensor.reshape(-1)
    words = values.view(torch.int64)
    blocks = triton.cdiv(values.numel(), _BLOCK)
    partial_f = torch.empty(blocks * 4, dtype=torch.float32, device=tensor.device)
    partial_i = torch.empty(blocks * 3, dtype=torch.int64, device=tensor.device)
    _summary_kernel[(blocks,)](values, words, partial_f, partial_i, finished, out, out.view(torch.int64),
                               values.numel(), words.numel(), MIX_INCREMENT, MIX_MULTIPLIER_1, MIX_MULTIPLIER_2,
                               BLOCK=_BLOCK, WORDS=_BLOCK * values.element_size() // 8, FOLD=_FOLD)


def fused_summary(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty(7, dtype=torch.float64, device=tensor.device)
    fused_summary_into(tensor, out, torch.zeros(1, dtype=torch.int32, device=tensor.device))
    return out
