"""Bitwise fingerprints and summary statistics of a tensor, computed where the tensor lives.

Fingerprint algorithms, named in the fingerprint string so they are never confused:

- ``xxh3:<hex>``: XXH3-128 of the raw bytes, for tensors on the host (about 10 GB/s).
- ``mix64:<hex>``: computed where the tensor lives (a GPU tensor is fingerprinted without copying
  it to the host, by torch ops or the fused kernel of tdiff.store.device_summary): each 8-byte
  word is xor-ed with a key drawn from its index (the index-th splitmix64 output), passed through
  the splitmix64 finaliser (a non-linear bijection of 64-bit words), and the results are summed
  modulo 2**64. Any change, however many words it touches, moves the sum by a sum of
  pseudo-random 64-bit differences: it goes unseen with probability about 2**-64.
- ``wsum64:<hex>``: the older GPU digest, kept so that dumps written with it still compare: a
  position-weighted (odd weights) wrapping int64 sum of the words. Changes in several words can
  cancel (two bf16 sign flips at element 3 of two words each add 2**63), so capture no longer
  writes it.

All also cover dtype and shape. Fingerprints of different algorithms are not comparable;
:func:`fingerprint_as` recomputes one algorithm from stored data when the two sides differ.

Examples:
    >>> xxh3_fingerprint(torch.zeros(4))
    'xxh3:...'
    >>> stats_dict(tensor_stats(torch.tensor([1.0, -3.0, float("nan")])))
    {'min': -3.0, 'max': 1.0, 'mean': -1.0, 'abs_mean': 2.0, 'nan': 1, 'inf': 0}
"""

from __future__ import annotations

import functools
import math
import threading

import torch
import xxhash

from tdiff.store.dtypes import dtype_name, to_bytes_view
from tdiff.store.xxh3 import xxh3_128_hex

WEIGHT_MULTIPLIER = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
WEIGHT_OFFSET = 0x632BE59BD9B4E019
# splitmix64 (Steele, Lea, Flood 2014): its increment and the multipliers of its finaliser, as
# signed int64 (torch and Triton compute in int64, which wraps like uint64)
MIX_INCREMENT = WEIGHT_MULTIPLIER
MIX_MULTIPLIER_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
MIX_MULTIPLIER_2 = 0x94D049BB133111EB - (1 << 64)
_MIX_CHUNK = 1 << 22  # words per round of torch ops: bounds their temporaries


@functools.lru_cache(maxsize=4096)
def _shape_tag(dtype: str, shape: tuple[int, ...]) -> bytes:
    """A forward records the same few shapes again and again: each tag is built once."""
    return f"{dtype}{list(shape)}".encode()


def xxh3_fingerprint(tensor: torch.Tensor, sink=None) -> str:
    """XXH3-128 over dtype, shape and raw bytes of a host tensor; ``sink``, if given, is handed
    the bytes once they are hashed."""
    tag = _shape_tag(dtype_name(tensor.dtype), tuple(tensor.shape))
    if (sink is None and type(tensor) is torch.Tensor and tensor.is_contiguous() and not tensor.is_quantized
            and not tensor.is_conj() and not tensor.is_neg()):
        # its memory is its bytes: no views to build (capture checks a small tensor's bytes at
        # every record that may alias an earlier one)
        return "xxh3:" + xxh3_128_hex(tag, tensor.data_ptr(), tensor.numel() * tensor.element_size())
    raw = to_bytes_view(tensor).contiguous()
    digest = xxh3_128_hex(tag, raw.data_ptr(), raw.numel())
    if sink is not None and raw.numel():
        sink(raw.numpy().data)
    return "xxh3:" + digest


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int64 words, the last one zero-padded."""
    raw = to_bytes_view(tensor)
    padding = (-raw.numel()) % 8
    if padding:
        raw = torch.cat([raw, raw.new_zeros(padding)])
    elif raw.storage_offset() % 8:
        raw = raw.clone()  # a slice that does not start on a word boundary of its storage
    return raw.view(torch.int64)


def _xorshift_right(z: torch.Tensor, shift: int) -> torch.Tensor:
    """``z ^= z >>> shift`` in place (logical shift: int64's ``>>`` is arithmetic, masked here)."""
    return z.bitwise_xor_((z >> shift).bitwise_and_((1 << (64 - shift)) - 1))


def _splitmix64_finalize(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on int64 words."""
    _xorshift_right(z, 30).mul_(MIX_MULTIPLIER_1)
    _xorshift_right(z, 27).mul_(MIX_MULTIPLIER_2)
    return _xorshift_right(z, 31)


def mix64_fingerprint_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The mix64 digest as a 0-d int64 tensor on the tensor's device (no host sync): the sum
    over words ``w[i]`` of ``finalize(w[i] ^ finalize((i + 1) * MIX_INCREMENT))``, modulo 2**64."""
    words = _words(tensor)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _MIX_CHUNK):
        chunk = words[start:start + _MIX_CHUNK]
        keys = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=words.device)
        mixed = _splitmix64_finalize(_splitmix64_finalize(keys.mul_(MIX_INCREMENT)).bitwise_xor_(chunk))
        total += mixed.sum()
    return total


def mix64_fingerprint(tensor: torch.Tensor) -> str:
    return digest_format("mix64", int(mix64_fingerprint_tensor(tensor)), dtype_name(tensor.dtype), tensor.shape)


def wsum64_fingerprint_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The wsum64 digest as a 0-d int64 tensor on the tensor's device (no host sync)."""
    words = _words(tensor)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
    weights.mul_(WEIGHT_MULTIPLIER).add_(WEIGHT_OFFSET).bitwise_or_(1)
    return (words * weights).sum() + words.numel()


def digest_format(algorithm: str, digest: int, dtype: str, shape) -> str:
    """The fingerprint string of a 64-bit digest (mix64, wsum64) of a tensor of this dtype and shape."""
    return f"{algorithm}:{(digest & 0xFFFFFFFFFFFFFFFF):016x}{_digest_tag(dtype, tuple(shape))}"


@functools.lru_cache(maxsize=4096)
def _digest_tag(dtype: str, shape: tuple[int, ...]) -> str:
    """A forward records the same few shapes again and again: their tag is hashed once."""
    return f"{xxhash.xxh3_64_intdigest(_shape_tag(dtype, shape)):016x}"


def wsum64_fingerprint(tensor: torch.Tensor) -> str:
    return digest_format("wsum64", int(wsum64_fingerprint_tensor(tensor)), dtype_name(tensor.dtype), tensor.shape)


def fingerprint_algorithm(value: str | None) -> str | None:
    return value.split(":", 1)[0] if value else None


def fingerprint_as(tensor: torch.Tensor, algorithm: str) -> str:
    """Recompute a stored tensor's fingerprint with a given algorithm."""
    if algorithm == "xxh3":
        return xxh3_fingerprint(tensor.cpu())
    if algorithm == "mix64":
        return mix64_fingerprint(tensor)
    if algorithm == "wsum64":
        return wsum64_fingerprint(tensor)
    raise ValueError(f"unknown fingerprint algorithm {algorithm!r}")


_CHUNK = 1 << 20  # elements: 4 MiB of float32, which the last-level cache holds
# at::internal::GRAIN_SIZE: torch runs an op over fewer elements on the calling thread alone
ONE_THREAD_CHUNK = 32_768


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
    """:func:`tensor_stats` of a CPU tensor, as Python floats: no small tensors to build.

    A large tensor is summarised in chunks of :data:`_CHUNK` elements, each read from memory once
    while it stays in the cache (its sum, the sum of its absolute values through a reused buffer,
    its minimum and maximum): four passes over the whole tensor's memory took twice as long.
    On torch's threads as the process set them: ``torch.set_num_threads`` around the passes would
    also set the count every thread of the process starts with (docs/PERFORMANCE.md, section 1)."""
    t = _numeric(tensor)
    return list(_NO_VALUES) if t is None else _chunked_stats(t, None)


def host_summary(tensor: torch.Tensor, *, chunk: int = _CHUNK, sink=None) -> tuple[list[float], str]:
    """:func:`host_stats` and :func:`xxh3_fingerprint` of a CPU tensor, each chunk hashed while
    the statistics have it in the cache (one pass instead of two). A thread beside the model's
    passes ``chunk=ONE_THREAD_CHUNK``: torch then runs each op on the calling thread, where its own
    teams of threads would compete with the model's for the cores (on the GPU machine's 16 cores,
    0.6 ms a sum of a 1 x 128 activation).

    ``sink``, if given, is handed the tensor's bytes (as :func:`tdiff.store.dtypes.to_bytes_view`
    gives them) in order, a buffer at a time, each once it is hashed: from the cache, too."""
    t = _own_values(tensor)
    if t is None:
        return host_stats(tensor), xxh3_fingerprint(tensor, sink=sink)
    hasher = xxhash.xxh3_128(_shape_tag(dtype_name(t.dtype), t.shape))
    stats = _chunked_stats(t, hasher, chunk=chunk, sink=sink)
    return stats, "xxh3:" + hasher.hexdigest()


def _own_values(tensor: torch.Tensor) -> torch.Tensor | None:
    """The values to summarise where they are the tensor's own bytes, contiguous (its chunks are
    then its bytes: hashed, and handed on, with the statistics' pass): :func:`_numeric` converted
    nothing. None where the statistics and the bytes need passes of their own."""
    t = _numeric(tensor)
    return t if t is not None and t.dtype == tensor.dtype and t.is_contiguous() and t.numel() > 1 else None


def _chunked_stats(t: torch.Tensor, hasher, chunk: int = _CHUNK, sink=None) -> list[float]:
    """:func:`host_stats` of ``t``, as :func:`_numeric` gives it; with ``hasher``, also fed its
    bytes chunk by chunk (``t`` is then the tensor itself, contiguous: its chunks are its bytes);
    with ``sink`` (and ``hasher``), each chunk's bytes are handed to it once they are hashed."""
    # float32 accumulation (cascade-summed by torch) is ten times faster than float64 on CPU
    # and plenty for diagnostics; float64 tensors keep float64; the chunks' sums add up in Python
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    flat = t.reshape(-1)
    total = abs_total = 0.0
    lo, hi = math.inf, -math.inf
    finite = True
    for part in (flat,) if flat.numel() <= chunk else flat.split(chunk):
        if hasher is not None:
            raw = part.view(torch.uint8).numpy().data
            hasher.update(raw)
            if sink is not None:
                sink(raw)
        if finite:
            part_total = float(part.sum(dtype=acc))
            finite = math.isfinite(part_total)
        if finite:
            total += part_total
            abs_total += float(torch.abs(part, out=_scratch(part)).sum(dtype=acc))
            part_lo, part_hi = torch.aminmax(part)
            lo, hi = min(lo, float(part_lo)), max(hi, float(part_hi))
        elif hasher is None:
            break
    if not finite:
        return _nonfinite_stats(t).tolist()
    return [lo, hi, total / t.numel(), abs_total / t.numel(), 0, 0]


_NO_VALUES = (math.nan, math.nan, math.nan, math.nan, 0, 0)
_scratch_buffers = threading.local()


def _scratch(t: torch.Tensor) -> torch.Tensor:
    """A per-thread buffer shaped like ``t`` (grown as needed, kept for the next tensor)."""
    buffers: dict = _scratch_buffers.__dict__   # by dtype
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
    """The statistics as a record stores them: NaN (no finite value to summarise) as null, the
    counts as integers (spelt out: the writer calls this for every record)."""
    lo, hi, mean, abs_mean, nan, inf = stats.tolist() if isinstance(stats, torch.Tensor) else stats
    return {"min": None if lo != lo else lo, "max": None if hi != hi else hi,  # noqa: PLR0124
            "mean": None if mean != mean else mean, "abs_mean": None if abs_mean != abs_mean else abs_mean,  # noqa: PLR0124
            "nan": int(nan), "inf": int(inf)}
