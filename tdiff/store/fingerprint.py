"""Bitwise fingerprints and summary statistics of a tensor, computed where the tensor lives.

Two fingerprint algorithms, named in the fingerprint string so they are never confused:

- ``xxh3:<hex>``: XXH3-128 of the raw bytes, for tensors on the host (about 10 GB/s).
- ``wsum64:<hex>``: a position-weighted wrapping int64 sum over 8-byte words, computed with torch
  on any device (a GPU tensor is fingerprinted without copying it to the host). Every weight is
  odd, so any change confined to one word always changes the sum.

Both also cover dtype and shape. Fingerprints of different algorithms are not comparable;
:func:`fingerprint_as` recomputes one algorithm from stored data when the two sides differ.

Examples:
    >>> xxh3_fingerprint(torch.zeros(4))
    'xxh3:...'
    >>> stats_dict(tensor_stats(torch.tensor([1.0, -3.0, float("nan")])))
    {'min': -3.0, 'max': 1.0, 'mean': -1.0, 'abs_mean': 2.0, 'nan': 1, 'inf': 0}
"""

from __future__ import annotations

import math
import threading

import torch
import xxhash

from tdiff.store.dtypes import dtype_name, to_bytes_view

STAT_NAMES = ("min", "max", "mean", "abs_mean", "nan", "inf")
WEIGHT_MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
WEIGHT_OFFSET = 0x632BE59BD9B4E019


def _shape_tag(dtype: str, shape) -> bytes:
    return f"{dtype}{list(shape)}".encode()


def xxh3_fingerprint(tensor: torch.Tensor) -> str:
    """XXH3-128 over dtype, shape and raw bytes of a host tensor."""
    hasher = xxhash.xxh3_128(_shape_tag(dtype_name(tensor.dtype), tensor.shape))
    raw = to_bytes_view(tensor)
    if raw.numel():
        hasher.update(raw.numpy())
    return "xxh3:" + hasher.hexdigest()


def wsum64_fingerprint_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The wsum64 digest as a 0-d int64 tensor on the tensor's device (no host sync)."""
    raw = to_bytes_view(tensor)
    padding = (-raw.numel()) % 8
    if padding:
        raw = torch.cat([raw, raw.new_zeros(padding)])
    words = raw.view(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
    weights.mul_(WEIGHT_MULTIPLIER).add_(WEIGHT_OFFSET).bitwise_or_(1)
    return (words * weights).sum() + words.numel()


def wsum64_format(digest: int, dtype: str, shape) -> str:
    """The wsum64 fingerprint string of a digest computed by :func:`wsum64_fingerprint_tensor`."""
    tag = xxhash.xxh3_64_intdigest(_shape_tag(dtype, shape))
    return f"wsum64:{(digest & 0xFFFFFFFFFFFFFFFF):016x}{tag:016x}"


def wsum64_fingerprint(tensor: torch.Tensor) -> str:
    return wsum64_format(int(wsum64_fingerprint_tensor(tensor)), dtype_name(tensor.dtype), tensor.shape)


def fingerprint_algorithm(value: str | None) -> str | None:
    return value.split(":", 1)[0] if value else None


def fingerprint_as(tensor: torch.Tensor, algorithm: str) -> str:
    """Recompute a stored tensor's fingerprint with a given algorithm."""
    if algorithm == "xxh3":
        return xxh3_fingerprint(tensor.cpu())
    if algorithm == "wsum64":
        return wsum64_fingerprint(tensor)
    raise ValueError(f"unknown fingerprint algorithm {algorithm!r}")


def tensor_stats(tensor: torch.Tensor) -> torch.Tensor:
    """[min, max, mean, abs_mean, nan, inf] as float64 on the tensor's device, without a host sync.

    NaN is left out of min, max and the means; +-inf counts in min and max only.
    """
    if tensor.device.type == "cpu":
        return torch.tensor(host_stats(tensor), dtype=torch.float64)
    t = _numeric(tensor)
    if t is None:
        return torch.tensor(_NO_VALUES, dtype=torch.float64, device=tensor.device)
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    total = t.sum(dtype=acc).double()
    abs_total = t.abs().sum(dtype=acc).double()
    lo, hi = torch.aminmax(t)
    stats = torch.stack([lo.double(), hi.double(), total / t.numel(), abs_total / t.numel(),
                         total.new_zeros(()), total.new_zeros(())])
    return torch.where(torch.isfinite(total), stats, _nonfinite_stats(t))


def host_stats(tensor: torch.Tensor) -> list[float]:
    """:func:`tensor_stats` of a CPU tensor, as Python floats: no small tensors to build, and the
    absolute values go to a reused buffer instead of freshly faulted-in memory."""
    t = _numeric(tensor)
    if t is None:
        return list(_NO_VALUES)
    # float32 accumulation (cascade-summed by torch) is ten times faster than float64 on CPU
    # and plenty for diagnostics; float64 tensors keep float64
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    total = float(t.sum(dtype=acc))
    if not math.isfinite(total):
        return _nonfinite_stats(t).tolist()
    magnitudes = torch.abs(t, out=_scratch(t)) if t.is_contiguous() else t.abs()
    abs_total = float(magnitudes.sum(dtype=acc))
    lo, hi = torch.aminmax(t)
    return [float(lo), float(hi), total / t.numel(), abs_total / t.numel(), 0, 0]


_NO_VALUES = (math.nan, math.nan, math.nan, math.nan, 0, 0)
_scratch_buffers = threading.local()


def _scratch(t: torch.Tensor) -> torch.Tensor:
    """A per-thread buffer shaped like ``t`` (grown as needed, kept for the next tensor)."""
    buffers = _scratch_buffers.__dict__
    buffer = buffers.get(t.dtype)
    if buffer is None or buffer.numel() < t.numel():
        buffer = buffers[t.dtype] = torch.empty(t.numel(), dtype=t.dtype)
    return buffer[:t.numel()].view(t.shape)


def _numeric(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor as floats to summarise, or None when it has no values (empty, bit containers)."""
    t = tensor.detach()
    if t.is_quantized:
        t = t.int_repr()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.numel() == 0:
        return None
    if not t.is_floating_point() or t.dtype.itemsize == 1:  # integers, bool and float8
        try:
            t = t.to(torch.float32 if t.dtype.itemsize < 4 else torch.float64)
        except (RuntimeError, TypeError):  # bit containers (bits8, int1, uint4 ...) have no values
            return None
    return t


def _nonfinite_stats(t: torch.Tensor) -> torch.Tensor:
    acc = torch.float64
    nan = torch.isnan(t)
    inf = torch.isinf(t)
    numbers = t.masked_fill(nan, 0)
    finite = ~(nan | inf)
    n_finite = finite.sum().clamp(min=1)
    non_nan = ~nan
    lo = torch.where(non_nan, t, torch.full_like(t, math.inf)).amin().to(acc)
    hi = torch.where(non_nan, t, torch.full_like(t, -math.inf)).amax().to(acc)
    mean = numbers.masked_fill(inf, 0).sum(dtype=acc) / n_finite
    abs_mean = numbers.masked_fill(inf, 0).abs().sum(dtype=acc) / n_finite
    return torch.stack([lo, hi, mean, abs_mean, nan.sum().to(acc), inf.sum().to(acc)])


def stats_dict(stats: torch.Tensor | list[float]) -> dict:
    values = stats.tolist() if isinstance(stats, torch.Tensor) else list(stats)
    out = dict(zip(STAT_NAMES, values))
    out["nan"], out["inf"] = int(out["nan"]), int(out["inf"])
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}
