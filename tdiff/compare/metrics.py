"""Element-wise comparison of two tensors: bitwise, ULP, absolute/relative error, cosine.

Pure functions on tensors; no I/O. Work is chunked so memory stays a small multiple of the inputs.

Rules:
- Bitwise equality compares raw bytes: NaN with the same bits is equal, +0 and -0 are not.
- ULP distance counts representable values between two floats in the tensor's own dtype, over the
  ordering -inf < ... < -0 < +0 < ... < +inf. It is symmetric and zero exactly when the bits are
  equal: +0 and -0 are 1 ULP apart. A NaN against anything with other bits has no ULP distance;
  such elements are counted in ``nan_mismatch`` and left out of max_ulp, max_abs, mean_abs and
  max_rel (two NaNs with different payloads count as a mismatch with zero difference).
- Integers and bool: the ULP distance is the integer difference.
- Complex tensors are compared as their real view (real and imaginary parts side by side).

Examples:
    >>> m = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0000002]))
    >>> m.mismatched, m.max_ulp, m.bitwise_equal
    (1, 1, False)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from tdiff.store.dtypes import FLOAT_BITS, to_bytes_view

CHUNK_ELEMENTS = 1 << 22
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Tolerance:
    """The default is the bitwise verdict; with atol/rtol, |a-b| <= atol + rtol*|b| element-wise."""

    atol: float | None = None
    rtol: float | None = None

    @property
    def exact(self) -> bool:
        return self.atol is None and self.rtol is None

    def describe(self) -> str:
        return "bitwise" if self.exact else f"atol={self.atol or 0:g} rtol={self.rtol or 0:g}"


EXACT = Tolerance()


@dataclass
class TensorMetrics:
    numel: int
    bitwise_equal: bool
    mismatched: int = 0             # elements whose bits differ
    outside_tolerance: int = 0      # elements beyond atol/rtol (all mismatches when exact)
    nan_mismatch: int = 0           # NaN against a value with other bits
    max_abs: float = 0.0
    mean_abs: float = 0.0
    max_rel: float = 0.0
    max_ulp: int | None = 0         # None where undefined (the dtypes differ)
    cosine: float = 1.0
    worst_index: tuple[int, ...] | None = None
    worst_a: float | None = None
    worst_b: float | None = None

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatched / self.numel if self.numel else 0.0

    def within(self, tolerance: Tolerance) -> bool:
        return self.bitwise_equal if tolerance.exact else self.outside_tolerance == 0

    def to_json(self) -> dict:
        out = asdict(self)
        out["mismatch_fraction"] = self.mismatch_fraction
        out["worst_index"] = list(self.worst_index) if self.worst_index is not None else None
        return {k: json_number(v) for k, v in out.items()}


def json_number(value):
    """JSON has no NaN or infinity: NaN becomes null, infinities the strings "inf" / "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as integers of its own width (flat)."""
    return to_bytes_view(t).view(_SAME_SIZE_INT[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(to_bytes_view(a), to_bytes_view(b))


def ordered_bits(values: torch.Tensor) -> torch.Tensor:
    """Map float bit patterns to int64 so that integer order is float order and the difference of
    two is their ULP distance (-0 maps to -1, +0 to 0)."""
    bits = values.reshape(-1).view(FLOAT_BITS[values.dtype]).to(torch.int64)
    magnitude = bits & ((1 << (values.element_size() * 8 - 1)) - 1)
    return torch.where(bits < 0, -magnitude - 1, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise ULP distance (int64) of two tensors of one float or integer dtype."""
    if a.dtype in FLOAT_BITS:
        return (ordered_bits(a) - ordered_bits(b)).abs()
    return (a.reshape(-1).to(torch.int64) - b.reshape(-1).to(torch.int64)).abs()


def compare_tensors(a: torch.Tensor, b: torch.Tensor, tolerance: Tolerance = EXACT) -> TensorMetrics:
    """Compare two tensors of the same shape. Different dtypes are compared by value (no ULP)."""
    if a.is_complex():
        a = torch.view_as_real(a.to(torch.complex64) if a.dtype == torch.complex32 else a)
    if b.is_complex():
        b = torch.view_as_real(b.to(torch.complex64) if b.dtype == torch.complex32 else b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if bitwise_equal(a, b):
        return TensorMetrics(numel=a.numel(), bitwise_equal=True)
    acc = _Accumulator(a.dtype, b.dtype, tolerance)
    a_flat, b_flat = a.reshape(-1), b.reshape(-1)
    for start in range(0, a_flat.numel(), CHUNK_ELEMENTS):
        acc.add(a_flat[start:start + CHUNK_ELEMENTS], b_flat[start:start + CHUNK_ELEMENTS], start)
    return acc.result(tuple(a.shape))


def _as_float64(t: torch.Tensor) -> torch.Tensor | None:
    try:
        return t.to(torch.float64)
    except (RuntimeError, TypeError):
        return None  # bit-container dtypes (bits8, uint4 ...) have no numeric value


class _Accumulator:
    """Folds chunk after chunk into one :class:`TensorMetrics`."""

    def __init__(self, dtype_a: torch.dtype, dtype_b: torch.dtype, tolerance: Tolerance):
        self.same_dtype = dtype_a == dtype_b
        self.ulp_defined = self.same_dtype and (dtype_a in FLOAT_BITS or not dtype_a.is_floating_point)
        self.tolerance = tolerance
        self.numel = self.mismatched = self.outside = self.nan_mismatch = self.valid = 0
        self.max_abs = self.sum_abs = self.max_rel = 0.0
        self.max_ulp = 0
        self.dot = self.norm_a = self.norm_b = 0.0
        self.worst: tuple[float, int, float, float] | None = None  # (abs diff, index, a, b)

    def add(self, a: torch.Tensor, b: torch.Tensor, offset: int) -> None:
        self.numel += a.numel()
        differs = bits_of(a).ne(bits_of(b)) if self.same_dtype else torch.ones(a.shape, dtype=torch.bool)
        n_differs = int(differs.sum())
        af, bf = _as_float64(a), _as_float64(b)
        if af is None or bf is None:
            self._add_bits_only(differs, n_differs, offset)
            return
        self.dot += float((af * bf).nansum())
        self.norm_a += float((af * af).nansum())
        self.norm_b += float((bf * bf).nansum())
        if n_differs == 0:
            self.valid += a.numel()
            return
        self.mismatched += n_differs
        nan_a, nan_b = torch.isnan(af), torch.isnan(bf)
        one_nan = nan_a ^ nan_b
        self.nan_mismatch += int(one_nan.sum()) + int((nan_a & nan_b & differs).sum())
        valid = ~(nan_a | nan_b)
        self.valid += int(valid.sum())
        diff = (af - bf).abs()
        diff = diff.masked_fill(~valid | (torch.isinf(af) & (af == bf)), 0.0)
        self.sum_abs += float(diff.sum())
        chunk_max, chunk_arg = diff.max(dim=0)
        index = int(chunk_arg) if float(chunk_max) > 0 else int(differs.nonzero()[0, 0])
        if self.worst is None or float(chunk_max) > self.worst[0]:
            self.worst = (float(chunk_max), offset + index, float(af[index]), float(bf[index]))
        self.max_abs = max(self.max_abs, float(chunk_max))
        scale = torch.maximum(af.abs(), bf.abs())
        rel = torch.where(diff > 0, diff / scale, torch.zeros_like(diff))
        self.max_rel = max(self.max_rel, float(rel.max()))
        if self.tolerance.exact:
            self.outside += n_differs
        else:
            bound = (self.tolerance.atol or 0.0) + (self.tolerance.rtol or 0.0) * bf.abs()
            self.outside += int(((diff > bound) | one_nan).sum())
        if self.ulp_defined:
            counted = differs & valid
            if bool(counted.any()):
                self.max_ulp = max(self.max_ulp, int(ulp_distance(a[counted], b[counted]).max()))

    def _add_bits_only(self, differs: torch.Tensor, n_differs: int, offset: int) -> None:
        self.mismatched += n_differs
        self.outside += n_differs
        self.valid += differs.numel()
        self.ulp_defined = False
        if n_differs and self.worst is None:
            self.worst = (0.0, offset + int(differs.nonzero()[0, 0]), math.nan, math.nan)

    def result(self, shape: tuple[int, ...]) -> TensorMetrics:
        if self.norm_a == 0 and self.norm_b == 0:
            cosine = 1.0 if self.mismatched == 0 else 0.0
        elif self.norm_a == 0 or self.norm_b == 0:
            cosine = 0.0
        else:
            cosine = self.dot / math.sqrt(self.norm_a * self.norm_b)
        worst_index = worst_a = worst_b = None
        if self.worst is not None:
            worst_index = _unravel(self.worst[1], shape)
            worst_a, worst_b = self.worst[2], self.worst[3]
        return TensorMetrics(
            numel=self.numel, bitwise_equal=False, mismatched=self.mismatched,
            outside_tolerance=self.outside, nan_mismatch=self.nan_mismatch, max_abs=self.max_abs,
            mean_abs=self.sum_abs / self.valid if self.valid else 0.0, max_rel=self.max_rel,
            max_ulp=self.max_ulp if self.ulp_defined else None, cosine=cosine,
            worst_index=worst_index, worst_a=worst_a, worst_b=worst_b)


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))
