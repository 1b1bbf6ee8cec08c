"""Element-wise comparison of two tensors: bitwise, ULP, absolute/relative error, cosine.

Pure functions on tensors; no I/O. Work is chunked so memory stays a small multiple of the inputs,
and each chunk is read once for every metric (and, with :func:`measure`'s ``by_rows``, the rows'
verdicts; ``--ulp``'s scale, which the element rule needs first, is one pass more over the bit
patterns): counts are summed as integers, maxima taken, sums accumulated in float64, so the result
does not depend on where the chunks fall except in the last bits of sums (mean_abs, cosine) and in
a chunk that float32 cannot difference (see below), computed in float64.

Rules:
- Bitwise equality compares raw bytes: NaN with the same bits is equal, +0 and -0 are not.
- ULP distance counts representable values between two floats in the tensor's own dtype, over the
  ordering -inf < ... < -0 < +0 < ... < +inf. It is symmetric and zero exactly when the bits are
  equal: +0 and -0 are 1 ULP apart. The float8 "fnuz" types have no -0 (their 0x80 is their
  NaN): there the smallest negative is 1 ULP below +0. float8_e8m0fnu (no sign bit) has no ULP
  distance. A NaN against anything with other bits has no ULP distance; such elements are
  counted in ``nan_mismatch`` and left out of max_ulp, max_abs, mean_abs and max_rel (two NaNs
  with different payloads count as a mismatch with zero difference).
- Absolute error |a-b|; relative error |a-b| / max(|a|, |b|), symmetric in a and b (a denominator
  below the smallest normal of the float32 or float64 the values are computed in is raised to it).
  worst_a and worst_b are the values of the element with the largest |a-b|, as they are (inf, NaN).
- An infinity against the same infinity is equal (its bits are). Against a finite value or the
  other infinity it is a mismatch whose absolute and relative errors are infinite: max_abs,
  mean_abs and max_rel are inf ("inf" in JSON, see json_number), max_ulp_at_scale too, and no
  tolerance admits it. Its ULP distance is finite (the ordering above). An infinity against NaN
  follows the NaN rule.
- The cosine covers the elements finite on both sides: NaN and infinities are left out of it.
  Values whose squares pass the float32 (or float64) they are computed in, or vanish in it (float32
  values under ~1e-19, float64 under ~1e-154), still count in full: the sums of squares of such a
  chunk are computed again in float64, scaled by a power of two.
- Finite float32 values whose difference passes float32's max (3e38 against -3e38) have their
  chunk computed in float64, which holds it: max_abs 6e38 and max_rel 2, not inf.
- Under a tolerance an element matches when |a-b| <= atol + rtol*max(|a|,|b|) + ulp*ulp(scale), the
  same whichever side is A, scale being the tensor pair's largest magnitude (``--ulp N``: within N
  ULPs at the tensor's scale, the "ULP at scale" metric below); +inf matches only +inf, -inf only
  -inf, NaN only NaN (any payload). The rule is evaluated in float64 (integers differenced
  exactly), for the count of a tensor as for its per-token verdicts: float32's rounding of |a-b|
  or of the bound would move elements across it (float32's 0.1 is above 0.1).
- Integers and bool: the ULP distance is the integer difference.
- ULP at scale: max |a-b| in units of the ULP at the tensor's largest magnitude (max |x| over the
  finite elements of both sides), ``max_abs / ulp(max|x|)``. Raw ULP counts every representable
  value between a and b, so a sign flip near zero (1e-9 against -1e-9 in fp32) is ~2e9 ULP while
  it is far below one rounding step of the tensor's values; at scale it is ~0. 1 means one
  rounding step of the tensor's largest values. Integers: the max difference (their ULP is 1).
- Complex tensors are compared as their real view (real and imaginary parts side by side).

Examples:
    >>> m = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0000002]))
    >>> m.mismatched, m.max_ulp, m.bitwise_equal
    (1, 1, False)
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import numpy as np
import torch

from tdiff.compare import compiled
from tdiff.compare.parallel import spread
from tdiff.store.dtypes import FLOAT_BITS, to_bytes_view

CHUNK_ELEMENTS = 1 << 18  # small enough for the temporaries to stay in cache-sized buffers
PIECE_ELEMENTS = 1 << 23  # a large tensor's pieces, measured on threads of their own (issue 32)
# the most a workspace's scratch arrays (_Workspace) take, once it has measured pairs of every dtype under
# every rule (a bfloat16 dump compared bitwise takes 6 MB): there are as many as threads measuring at
# once, and compare counts it in its memory per thread
WORKSPACE_BYTES = 28 << 20
# signed, so that a float's sign bit is the integer's (negative where the signs differ, in _max_ulp)
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# their 0x80 is NaN, not -0: no -0 step between their negatives and +0
_WITHOUT_NEGATIVE_ZERO = frozenset({torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
# a chunk's sum of squares above this is summed again, scaled: the cosine multiplies two norms,
# whose product must stay within float64 (2^1024) over any number of chunks
_SQUARES_LIMIT = 2.0 ** 400
_SCALED_EXPONENT = 190   # scaled values stay below 2^190: their squares below 2^380, a chunk's sum below 2^400
# a chunk's sum of squares (in its dtype) below this is summed again, scaled: float32 squares of
# values under 2^-63 are subnormal or 0
_SQUARES_FLOOR = 2.0 ** -100
# the tolerance rule judged in float32 (_Accumulator._beyond_finite): |a-b| and the bound are each
# within 4 float32 roundings (2^-22) of the float64 ones, and underflow moves them by under 2^-148
_MARGIN = 2.0 ** -20
_TINY_MARGIN = 2.0 ** -140
_FLOAT32_SAFE = 2.0 ** 100   # an atol or rtol above this is judged in float64 (float32 overflows)


@dataclass(frozen=True)
class Tolerance:
    """The default is the bitwise verdict. With atol/rtol/ulp an element matches when
    |a-b| <= atol + rtol*max(|a|,|b|) + ulp*ulp(scale), scale being the largest finite magnitude of
    the two tensors compared (symmetric: swapping A and B never changes a verdict); an infinity
    matches only the same infinity, and a NaN only a NaN (whatever its payload)."""

    atol: float | None = None
    rtol: float | None = None
    ulp: float | None = None

    @property
    def exact(self) -> bool:
        return self.atol is None and self.rtol is None and self.ulp is None

    def describe(self) -> str:
        if self.exact:
            return "bitwise"
        if self.atol is None and self.rtol is None:
            return f"ulp={self.ulp:g}"
        return f"atol={self.atol or 0:g} rtol={self.rtol or 0:g}" + (f" ulp={self.ulp:g}" if self.ulp is not None else "")

    def at_scale(self, a: torch.Tensor, b: torch.Tensor) -> Tolerance:
        """The element rule for these two tensors: ``ulp`` becomes an absolute bound of that many
        ULPs at their scale (:func:`scale_ulp`), added to atol."""
        if self.ulp is None:
            return self
        return Tolerance(atol=(self.atol or 0.0) + self.ulp * scale_ulp(a, b), rtol=self.rtol or 0.0)

    def at_magnitude(self, magnitude: float, dtype: torch.dtype) -> Tolerance:
        """:meth:`at_scale` for tensors of ``dtype`` whose largest finite magnitude is known."""
        if self.ulp is None:
            return self
        unit = ulp_at(magnitude, dtype) if dtype.is_floating_point else 1.0
        return Tolerance(atol=(self.atol or 0.0) + self.ulp * unit, rtol=self.rtol or 0.0)


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
    max_ulp_at_scale: float | None = 0.0   # max_abs / ulp(max |x|); None where max_ulp is
    cosine: float = 1.0
    worst_index: tuple[int, ...] | None = None
    worst_a: float | None = None
    worst_b: float | None = None

    @property
    def mismatch_fraction(self) -> float:
        return self.mismatched / self.numel if self.numel else 0.0

    @property
    def outside_fraction(self) -> float:
        return self.outside_tolerance / self.numel if self.numel else 0.0

    def within(self, tolerance: Tolerance) -> bool:
        """Whether the verdict is "match"; ``outside_tolerance`` was counted under ``tolerance``."""
        return self.bitwise_equal if tolerance.exact else self.outside_tolerance == 0


JsonNumber = float | str | None   # a float as JSON carries it (json_number): NaN as None, "inf" / "-inf"


@dataclass(frozen=True)
class ReportedMetrics:
    """A tensor's metrics as ``tdiff compare --json`` reports them (the fields of TensorMetrics, then
    the fractions), read back as written: ``ReportedMetrics.from_json(m.to_json()) == m``."""

    numel: int
    bitwise_equal: bool
    mismatched: int
    outside_tolerance: int
    nan_mismatch: int
    max_abs: JsonNumber
    mean_abs: JsonNumber
    max_rel: JsonNumber
    max_ulp: int | None
    max_ulp_at_scale: JsonNumber
    cosine: JsonNumber
    worst_index: list[int] | None
    worst_a: JsonNumber
    worst_b: JsonNumber
    mismatch_fraction: JsonNumber
    outside_fraction: JsonNumber

    @classmethod
    def of(cls, metrics: TensorMetrics) -> ReportedMetrics:
        values = asdict(metrics)
        values["worst_index"] = list(metrics.worst_index) if metrics.worst_index is not None else None
        values["mismatch_fraction"] = metrics.mismatch_fraction
        values["outside_fraction"] = metrics.outside_fraction
        return cls(**{k: json_number(v) for k, v in values.items()})

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ReportedMetrics:
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def json_number(value):
    """JSON has no NaN or infinity: NaN becomes null, infinities the strings "inf" / "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def ulp_at(magnitude: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s representable values at ``magnitude`` (>= 0): eps * 2^exponent
    for normal numbers, the subnormal spacing below the smallest normal."""
    tiny, eps = torch.finfo(dtype).tiny, _epsilon(dtype)
    if magnitude < tiny:
        return tiny * eps
    return math.ldexp(eps, math.frexp(magnitude)[1] - 1)


def scale_ulp(a: torch.Tensor, b: torch.Tensor) -> float:
    """One ULP at the scale of two tensors: the spacing at their largest finite magnitude, in the
    coarser of their float dtypes (1 for integers, whose ULP is 1)."""
    floats = [t.dtype for t in (a, b) if t.is_floating_point()]
    if not floats:
        return 1.0
    magnitude = max(_tensor_magnitude(a), _tensor_magnitude(b))
    return max(ulp_at(magnitude, dtype) for dtype in floats)


def _tensor_magnitude(t: torch.Tensor) -> float:
    """max |x| over the finite elements, chunk by chunk."""
    if t.is_complex():
        t = torch.view_as_real(t.to(torch.complex64) if t.dtype == torch.complex32 else t)
    if t.dtype in FLOAT_BITS and t.numel():
        largest_bits = _largest_magnitude_bits(t)
        if largest_bits is not None:
            return largest_bits
    flat, largest = t.reshape(-1), 0.0
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        values = _values(flat[start:start + CHUNK_ELEMENTS], not t.is_floating_point(), "scale_of")
        if values is not None:
            largest = max(largest, _max_magnitude(values))
    return largest


def _largest_magnitude_bits(t: torch.Tensor) -> float | None:
    """max |x| of a float tensor read off its bit patterns, whose integer order is the magnitudes'
    (no conversion to float, no pass that writes): the largest signed pattern is the largest
    non-negative value's, the largest unsigned one the largest negative value's (sign bit set).
    None where the largest is an infinity or NaN (they sort above every finite magnitude), left to
    the values."""
    signed = bits_of(t.reshape(-1)).numpy()
    unsigned = signed.view(signed.dtype.str.replace("i", "u"))
    sign_bit = 1 << (t.element_size() * 8 - 1)
    largest = 0
    for start in range(0, signed.size, CHUNK_ELEMENTS):
        positive = int(signed[start:start + CHUNK_ELEMENTS].max())
        negative = int(unsigned[start:start + CHUNK_ELEMENTS].max()) - sign_bit
        largest = max(largest, positive, negative)
    value = float(torch.tensor([largest], dtype=FLOAT_BITS[t.dtype]).view(t.dtype).to(torch.float64))
    return value if math.isfinite(value) else None


@functools.cache
def _epsilon(dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s values at 1.0, read off the bit pattern after 1.0's:
    torch.finfo(torch.float8_e5m2fnuz).eps is 0.125 where its two mantissa bits make 0.25."""
    after_one = (bits_of(torch.ones(1, dtype=dtype)) + 1).view(dtype)
    return float(after_one.to(torch.float64)) - 1.0


def beyond_tolerance(a: np.ndarray, b: np.ndarray, tolerance: Tolerance) -> np.ndarray:
    """Where |a-b| > atol + rtol*max(|a|,|b|) (boolean, element-wise): the tolerance rule, symmetric
    in a and b. An infinity is within only of the same infinity, a NaN only of a NaN. Floats are
    judged in float64 (float32's rounding of |a-b| or of the bound would move elements across
    it); integer arrays (both) are differenced exactly (see :func:`integer_abs_difference`)."""
    out = np.empty(a.shape, dtype=bool)
    with _workspace.held():
        _beyond_into(a.reshape(-1), b.reshape(-1), tolerance, out.reshape(-1))
    return out


def _beyond_into(a: np.ndarray, b: np.ndarray, tolerance: Tolerance, out: np.ndarray) -> None:
    """:func:`beyond_tolerance` of flat arrays into ``out``, in the thread's workspace."""
    n = a.size
    difference = _workspace.array("tolerance_difference", np.float64, n)
    bound = _workspace.array("tolerance_bound", np.float64, n)
    if a.dtype.kind in "iub" and b.dtype.kind in "iub":
        difference[:] = integer_abs_difference(a, b)
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            np.subtract(a, b, out=difference, dtype=np.float64)
        np.abs(difference, out=difference)
    other = _workspace.array("tolerance_other", np.float64, n)
    with np.errstate(invalid="ignore", over="ignore"):   # NaN; inf - inf
        np.abs(a, out=bound, dtype=np.float64)
        np.abs(b, out=other, dtype=np.float64)
        np.maximum(bound, other, out=bound)
        finite = n == 0 or math.isfinite(float(bound.max()))   # NaN propagates through maximum and max
        # rtol*max(|a|,|b|) is NaN or inf where an operand is infinite: those elements are settled below
        np.multiply(bound, tolerance.rtol or 0.0, out=bound)
        np.add(bound, tolerance.atol or 0.0, out=bound)
        np.greater(difference, bound, out=out)
    if finite:
        return
    with np.errstate(invalid="ignore"):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        out |= (np.isinf(a64) | np.isinf(b64)) & (a64 != b64)   # there the bound is infinite too
    nan_a, nan_b = np.isnan(a64), np.isnan(b64)
    out &= ~(nan_a | nan_b)
    out |= nan_a ^ nan_b


def integer_abs_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| of integer (or bool) arrays as float64, rounded once at the end: their float64
    values lose differences past 2**53 (2**60 and 2**60 + 1 are one float64)."""
    if a.dtype.kind in "ub" and b.dtype.kind in "ub":
        a, b = a.astype(np.uint64), b.astype(np.uint64)
        return np.where(a >= b, a - b, b - a).astype(np.float64)  # the larger minus the smaller never wraps
    a, b = a.astype(np.int64), b.astype(np.int64)
    difference = np.abs((a - b).astype(np.float64))  # exact where the signs agree: no wrap there
    opposite = (a < 0) != (b < 0)
    if opposite.any():  # |a| + |b|, which may pass int64
        difference[opposite] = np.abs(a[opposite].astype(np.float64)) + np.abs(b[opposite].astype(np.float64))
    return difference


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as integers of its own width (flat)."""
    return to_bytes_view(t).view(_SAME_SIZE_INT[t.element_size()])




def ordered_bits(values: torch.Tensor) -> torch.Tensor:
    """Map float bit patterns to int64 so that integer order is float order and the difference of
    two is their ULP distance (-0 maps to -1, +0 to 0)."""
    bits = values.reshape(-1).view(FLOAT_BITS[values.dtype]).to(torch.int64)
    magnitude = bits & ((1 << (values.element_size() * 8 - 1)) - 1)
    return torch.where(bits < 0, -magnitude - _negative_zero_steps(values.dtype), magnitude)


def _negative_zero_steps(dtype: torch.dtype) -> int:
    """1 where -0 lies between ``dtype``'s negatives and +0, else 0."""
    return 0 if dtype in _WITHOUT_NEGATIVE_ZERO else 1


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise ULP distance (int64) of two tensors of one float or integer dtype."""
    if a.dtype in FLOAT_BITS:
        return (ordered_bits(a) - ordered_bits(b)).abs()
    return (a.reshape(-1).to(torch.int64) - b.reshape(-1).to(torch.int64)).abs()


def compare_tensors(a: torch.Tensor, b: torch.Tensor, tolerance: Tolerance = EXACT) -> TensorMetrics:
    """Compare two tensors of the same shape. Different dtypes are compared by value (no ULP)."""
    return measure(a, b, tolerance).metrics


@dataclass(frozen=True)
class Measured:
    """A tensor pair's metrics and, when asked for, whether each row (along dim 0) has an element
    that fails the verdict's rule (bits that differ, or beyond the tolerance): per-token verdicts."""

    metrics: TensorMetrics
    rows_differ: np.ndarray | None = None


def measure(a: torch.Tensor, b: torch.Tensor, tolerance: Tolerance = EXACT, *, by_rows: bool = False) -> Measured:
    """:func:`compare_tensors`, and with ``by_rows`` the rows that differ, in the same pass: each
    chunk is read once for every metric and the rows' verdicts. A tensor of more than
    :data:`PIECE_ELEMENTS` is measured in pieces of that many elements, folded in order, which
    :func:`tdiff.compare.parallel.spread` shares with idle threads: where the pieces fall does not
    depend on the threads, so neither does the result."""
    if a.is_complex():
        a = torch.view_as_real(a.to(torch.complex64) if a.dtype == torch.complex32 else a)
    if b.is_complex():
        b = torch.view_as_real(b.to(torch.complex64) if b.dtype == torch.complex32 else b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    with _workspace.held():
        element_rule = tolerance.at_scale(a, b)
    rows = (a.shape[0], math.prod(a.shape[1:])) if by_rows and a.dim() else None
    a_flat, b_flat = a.reshape(-1), b.reshape(-1)
    # one dtype: the bit patterns compare (views of the whole tensors, sliced chunk by chunk)
    bits = (_bits(a_flat), _bits(b_flat)) if a.dtype == b.dtype else None

    # whole chunks: they fall where one pass over the tensor puts them
    piece_elements = max(1, PIECE_ELEMENTS // CHUNK_ELEMENTS) * CHUNK_ELEMENTS

    def piece(begin: int) -> _Accumulator:
        acc = _Accumulator(a.dtype, b.dtype, element_rule, _Rows(*rows) if rows is not None else None)
        if acc.add_compiled(a_flat[begin:begin + piece_elements], b_flat[begin:begin + piece_elements], begin):
            return acc
        with _workspace.held():
            for start in range(begin, min(begin + piece_elements, a_flat.numel()), CHUNK_ELEMENTS):
                end = start + CHUNK_ELEMENTS
                acc.add(a_flat[start:end], b_flat[start:end], start,
                        (bits[0][start:end], bits[1][start:end]) if bits is not None else None)
        return acc

    acc, *rest = spread([functools.partial(piece, begin) for begin in range(0, max(a_flat.numel(), 1), piece_elements)])
    for other in rest:
        acc.fold(other)
    rows_differ = acc.rows.differ if acc.rows is not None else None
    if acc.same_dtype and acc.mismatched == 0:
        return Measured(TensorMetrics(numel=a.numel(), bitwise_equal=True), rows_differ)
    return Measured(acc.result(tuple(a.shape)), rows_differ)


class _Rows:
    """Whether each row of ``width`` elements holds an element that fails, folded in from chunks of
    the flat tensor (which start and end anywhere in a row)."""

    def __init__(self, count: int, width: int):
        self.width = width
        self.differ = np.zeros(count, dtype=bool)

    def add(self, fails: np.ndarray, offset: int) -> None:
        """Fold in a chunk starting at flat element ``offset``; nonzero in ``fails`` fails."""
        if not fails.size or not self.width:
            return
        first = offset // self.width
        starts = np.arange((-offset) % self.width, fails.size, self.width)
        if not starts.size or starts[0]:
            starts = np.concatenate(([0], starts))   # the chunk starts inside a row
        reduce = np.logical_or if fails.dtype == np.bool_ else np.bitwise_or
        self.differ[first:first + starts.size] |= reduce.reduceat(fails, starts) != 0

    def fold(self, other: _Rows) -> None:
        """Fold in the rows another piece of the tensor found differing."""
        self.differ |= other.differ

    def add_all(self, offset: int, size: int) -> None:
        """Every row the chunk touches fails (tensors of two dtypes are never bitwise equal)."""
        if size and self.width:
            self.differ[offset // self.width:(offset + size - 1) // self.width + 1] = True


class _Workspace:
    """Scratch arrays of one chunk. Fresh arrays would be page-faulted in anew for every chunk,
    which costs more than the arithmetic on them."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, np.ndarray] = {}

    def array(self, name: str, dtype, n: int) -> np.ndarray:
        key = (name, np.dtype(dtype))
        if key not in self.buffers or self.buffers[key].size < n:
            self.buffers[key] = np.empty(max(n, CHUNK_ELEMENTS), dtype=dtype)
        return self.buffers[key][:n]

    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers.values())

    def float32_of(self, name: str, t: torch.Tensor) -> np.ndarray:
        out = self.array(name, np.float32, t.numel())
        torch.from_numpy(out).copy_(t)
        return out


class _Workspaces(threading.local):
    """The workspace of the measuring a thread does now, taken from those no thread is using (so
    there are never more than threads measuring at once, however many threads have measured):
    :meth:`held` binds one to the thread for the length of a measuring. Idle ones are kept up to
    one more than are in use, so that a run of many threads leaves one behind, not all of theirs."""

    _idle: ClassVar[list[_Workspace]] = []   # shared by every thread
    _in_use: ClassVar[list[int]] = [0]
    _idle_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self.bound: _Workspace | None = None

    @contextmanager
    def held(self) -> Iterator[_Workspace]:
        if self.bound is not None:   # a measuring inside one (a piece run by its caller)
            yield self.bound
            return
        with self._idle_lock:
            self.bound = self._idle.pop() if self._idle else _Workspace()
            self._in_use[0] += 1
        try:
            yield self.bound
        finally:
            with self._idle_lock:
                self._in_use[0] -= 1
                self._idle.append(self.bound)
                del self._idle[self._in_use[0] + 1:]   # those the threads still measuring may want, and one
            self.bound = None

    def array(self, name: str, dtype, n: int) -> np.ndarray:
        return self._current().array(name, dtype, n)

    def float32_of(self, name: str, t: torch.Tensor) -> np.ndarray:
        return self._current().float32_of(name, t)

    def nbytes(self) -> int:
        """What the workspaces of every thread take."""
        with self._idle_lock:
            return sum(w.nbytes() for w in self._idle) + (self.bound.nbytes() if self.bound else 0)

    def _current(self) -> _Workspace:
        if self.bound is None:
            raise RuntimeError("metrics scratch used outside _workspace.held()")
        return self.bound


_workspace = _Workspaces()


def _bits(t: torch.Tensor) -> np.ndarray:
    return bits_of(t).numpy()


def _values(t: torch.Tensor, wide: bool, name: str) -> np.ndarray | None:
    """Numeric values as numpy: float32 for floats of 32 bits or fewer (exact), else float64."""
    if t.dtype in (torch.float32, torch.float64) and not wide:
        return t.numpy()
    if t.is_floating_point() and t.element_size() < 4 and not wide:
        return _workspace.float32_of(name, t)
    try:
        return t.to(torch.float64).numpy()
    except (RuntimeError, TypeError):
        return None  # bit-container dtypes (bits8, uint4 ...) have no numeric value


def _differs(flipped: np.ndarray | None, n: int) -> np.ndarray:
    """Where two chunks differ: where their bits do, or everywhere when their dtypes differ."""
    return flipped != 0 if flipped is not None else np.ones(n, dtype=bool)


def _max_magnitude(values: np.ndarray) -> float:
    """max |x| over the finite elements."""
    if values.size == 0:
        return 0.0
    largest = max(abs(float(values.max())), abs(float(values.min())))
    if math.isfinite(largest):
        return largest
    finite = values[np.isfinite(values)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def _max_ulp(bits_a: np.ndarray, bits_b: np.ndarray, flipped: np.ndarray, negative_zero_steps: int) -> int:
    """Largest ULP distance between float bit patterns of one width (no NaN among them), given
    their XOR ``flipped`` and the steps -0 adds across zero (:func:`_negative_zero_steps`)."""
    if bits_a.size == 0:
        return 0
    scratch = _workspace.array("ulp", bits_a.dtype, bits_a.size)
    if flipped.min() >= 0:  # same signs everywhere: the magnitudes' difference fits
        np.subtract(bits_a, bits_b, out=scratch)
        return int(np.abs(scratch, out=scratch).max())
    opposite = flipped < 0
    np.subtract(bits_a, bits_b, out=scratch)
    np.abs(scratch, out=scratch)
    scratch[opposite] = 0  # those wrapped; they are measured below
    magnitude = (1 << (bits_a.dtype.itemsize * 8 - 1)) - 1
    wide = np.int64 if bits_a.dtype.itemsize < 8 else np.float64  # fp64 across zero overflows int64
    ma = (bits_a[opposite] & magnitude).astype(wide)
    mb = (bits_b[opposite] & magnitude).astype(wide)
    # across zero: both magnitudes, plus the step from -0 to +0
    return max(int(scratch.max()), int((ma + mb + negative_zero_steps).max()))


def _difference_overflows(av: np.ndarray, bv: np.ndarray, diff: np.ndarray) -> bool:
    """Whether a difference of finite values passed the dtype's max (3e38 - -3e38 in float32)."""
    return bool((np.isinf(diff) & np.isfinite(av) & np.isfinite(bv)).any())


class _SquareSums:
    """|a|^2, |b|^2 and |a-b|^2 over the chunks folded in, for the cosine, which is the same whatever
    power of two scales all three: they are held divided by 4^shift. A chunk's sums are computed in
    its values' dtype; where they pass it (float32 values past ~1.8e19) or _SQUARES_LIMIT (float64
    values past ~1e60), or where its squares vanish in it (float32 values under ~1e-19 square to
    subnormals or 0, whose norms gave a cosine of 0), they are computed again in float64 over the
    values times 2^-shift, shift set so that the largest comes near 2^_SCALED_EXPONENT: raised
    where it must be (values that vanish beside the largest are lost), lowered (negative) only
    while nothing but zeros is held."""

    def __init__(self) -> None:
        self.a = self.b = self.diff = 0.0
        self.shift = 0

    def add(self, a: np.ndarray, b: np.ndarray, diff: np.ndarray) -> None:
        """Fold in a chunk's finite values on both sides and their absolute differences."""
        sums = _sums_of_squares(a, b, diff)
        vanished = min(sums[0], sums[1]) < _SQUARES_FLOOR
        if self.shift:
            sums = [_times_power_of_two(s, -2 * self.shift) for s in sums]
        if vanished or not _fit(sums):
            scaled = self._rescaled(a, b)
            if scaled is not None:
                a, b = scaled
                sums = _sums_of_squares(a, b, np.abs(a - b))
        self._fold(*sums)

    def add_equal(self, values: np.ndarray) -> None:
        """Fold in a chunk equal on both sides (it adds nothing to |a-b|^2), infinities and NaN included."""
        (square,) = _sums_of_squares(values)
        if not math.isfinite(square):  # an infinity or NaN (the cosine covers the finite elements), or overflow
            values = values[np.isfinite(values)]
            (square,) = _sums_of_squares(values)
        vanished = square < _SQUARES_FLOOR
        if self.shift:
            square = _times_power_of_two(square, -2 * self.shift)
        if vanished or not _fit([square]):
            scaled = self._rescaled(values)
            if scaled is not None:
                (square,) = _sums_of_squares(*scaled)
        self._fold(square, square, 0.0)

    def _rescaled(self, *arrays: np.ndarray) -> list[np.ndarray] | None:
        """The arrays (finite) in float64 times 2^-shift, the shift first set for their largest;
        None where they are all zeros (their sums, as computed, are exact)."""
        largest = max(_max_magnitude(x) for x in arrays)
        if not largest:
            return None
        wanted = math.frexp(largest)[1] - _SCALED_EXPONENT
        if wanted > self.shift or not (self.a or self.b):
            self.a, self.b, self.diff = (math.ldexp(s, 2 * (self.shift - wanted)) for s in (self.a, self.b, self.diff))
            self.shift = wanted
        return [np.ldexp(x.astype(np.float64), -self.shift) for x in arrays]

    def add_sums(self, square_a: float, square_b: float, square_diff: float) -> None:
        """Fold in sums computed in float64 from values of 32 bits or fewer (the compiled pass),
        which neither pass float64 nor vanish in it."""
        self._fold(*(_times_power_of_two(s, -2 * self.shift) for s in (square_a, square_b, square_diff)))

    def fold(self, other: _SquareSums) -> None:
        """Fold in the sums of a later piece: both brought to the larger shift (one that holds only
        zeros takes the other's)."""
        if not (other.a or other.b):
            return
        if not (self.a or self.b):
            self.a, self.b, self.diff, self.shift = other.a, other.b, other.diff, other.shift
            return
        shift = max(self.shift, other.shift)
        self.a, self.b, self.diff = (math.ldexp(s, 2 * (self.shift - shift)) for s in (self.a, self.b, self.diff))
        self.shift = shift
        self._fold(*(math.ldexp(s, 2 * (other.shift - shift)) for s in (other.a, other.b, other.diff)))

    def _fold(self, square_a: float, square_b: float, square_diff: float) -> None:
        self.a += square_a
        self.b += square_b
        self.diff += square_diff


def _times_power_of_two(value: float, exponent: int) -> float:
    """value * 2^exponent, inf past float64's max (math.ldexp raises there)."""
    try:
        return math.ldexp(value, exponent)
    except OverflowError:
        return math.inf


def _sums_of_squares(*arrays: np.ndarray) -> list[float]:
    """Each array's sum of squares, computed in its dtype (inf past its max, NaN over a NaN)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return [float(np.dot(x, x)) for x in arrays]


def _fit(sums: list[float]) -> bool:
    """Whether sums of squares as computed are finite and within _SQUARES_LIMIT."""
    return all(s <= _SQUARES_LIMIT for s in sums)   # False for inf and NaN


class _Accumulator:
    """Folds chunk after chunk into one :class:`TensorMetrics`, with numpy (vectorised)."""

    def __init__(self, dtype_a: torch.dtype, dtype_b: torch.dtype, tolerance: Tolerance, rows: _Rows | None = None):
        self.dtype = dtype_a
        self.same_dtype = dtype_a == dtype_b
        self.float_ulp = self.same_dtype and dtype_a in FLOAT_BITS
        self.negative_zero_steps = _negative_zero_steps(dtype_a)
        self.int_ulp = self.same_dtype and not dtype_a.is_floating_point
        self.ulp_defined = self.float_ulp or self.int_ulp
        self.wide = not self.same_dtype or not dtype_a.is_floating_point  # compare by value in float64
        self.tolerance = tolerance
        self.rows = rows
        self.numel = self.mismatched = self.outside = self.nan_mismatch = self.valid = 0
        self.max_abs = self.sum_abs = self.max_rel = 0.0
        self.max_ulp = 0
        self.magnitude = 0.0   # max |x| over the finite elements of both sides, for ULP at scale
        self.squares = _SquareSums()   # for the cosine
        self.worst: tuple[float, int, float, float] | None = None  # (abs diff, index, a, b)

    def add(self, a: torch.Tensor, b: torch.Tensor, offset: int, bits: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Fold in the chunks ``a`` and ``b`` starting at element ``offset``, with their bit
        patterns when they have one dtype."""
        self.numel += a.numel()
        flipped = None   # the XOR of the bit patterns: nonzero where they differ, negative where the signs do
        if bits is not None:
            flipped = np.bitwise_xor(*bits, out=_workspace.array("flipped", bits[0].dtype, a.numel()))
            n_differs = int(np.count_nonzero(flipped))
        else:
            n_differs = a.numel()
        av, bv = _values(a, self.wide, "a"), _values(b, self.wide, "b")
        if av is None or bv is None:
            self._add_bits_only(_differs(flipped, a.numel()), n_differs, offset)
            return
        # the tolerance rule sees the values as they are; integers keep their own (see beyond_tolerance)
        a_values, b_values = (a.numpy(), b.numpy()) if self.int_ulp else (av, bv)
        if n_differs == 0:
            largest = max(abs(float(av.max())), abs(float(av.min()))) if av.size else 0.0
            self.valid += a.numel()
            if not math.isfinite(largest):   # NaN or an infinity
                largest = _max_magnitude(av)
                # NaN on both sides is left out of mean_abs, as in a chunk that differs
                self.valid -= int(np.count_nonzero(np.isnan(av)))
            self.magnitude = max(self.magnitude, largest)
            self.squares.add_equal(av)
            return
        self.mismatched += n_differs
        n = a.numel()
        tiny = np.finfo(av.dtype).tiny   # of the dtype the values are computed in, whichever a chunk is
        diff = self._abs_difference(av, bv, a_values, b_values)
        total = float(diff.sum(dtype=np.float64))
        if not math.isfinite(total) and av.dtype == np.float32 and _difference_overflows(av, bv, diff):
            av, bv = av.astype(np.float64), bv.astype(np.float64)
            a_values, b_values = av, bv
            diff = self._abs_difference(av, bv, a_values, b_values)
            total = float(diff.sum(dtype=np.float64))
        valid = None
        finite_a, finite_b, finite_diff = av, bv, diff   # the elements finite on both sides
        if not math.isfinite(total):  # NaN or inf somewhere: mask them (the rare, slower path)
            self.magnitude = max(self.magnitude, _max_magnitude(av), _max_magnitude(bv))
            nan_a, nan_b = np.isnan(av), np.isnan(bv)
            valid = ~(nan_a | nan_b)
            self.nan_mismatch += int(np.count_nonzero(nan_a ^ nan_b))
            self.nan_mismatch += int(np.count_nonzero(nan_a & nan_b & _differs(flipped, n)))
            # NaN and equal infinities differ by 0; an infinity against anything else by inf
            diff[~valid | (np.isinf(av) & (av == bv))] = 0.0
            finite = np.isfinite(av) & np.isfinite(bv)
            finite_a, finite_b, finite_diff = np.where(finite, av, 0), np.where(finite, bv, 0), np.where(finite, diff, 0)
            total = float(diff.sum(dtype=np.float64))
        self.valid += n if valid is None else int(np.count_nonzero(valid))
        self.sum_abs += total
        self.squares.add(finite_a, finite_b, finite_diff)
        index = int(diff.argmax())
        largest = float(diff[index])
        if largest == 0.0:  # only signed zeros or NaN payloads differ here
            index = int(np.flatnonzero(_differs(flipped, n))[0])
        self._keep_worst((largest, offset + index, float(av[index]), float(bv[index])))
        self.max_abs = max(self.max_abs, largest)
        # max(|a|, |b|) over the finite values (symmetric in a and b): an infinite |a-b| over it
        # stays infinite, where over the infinity itself it would be inf/inf = NaN
        scale = _workspace.array("scale", av.dtype, n)
        np.maximum(np.abs(finite_a, out=scale), np.abs(finite_b, out=_workspace.array("magnitude", av.dtype, n)),
                   out=scale)
        if valid is None:  # every element finite: the largest of max(|a|, |b|) is the largest magnitude
            self.magnitude = max(self.magnitude, float(scale.max()))
        if self.tolerance.exact:
            self.outside += n_differs
            if self.rows is not None:
                self._fold_rows_exact(flipped, offset, n)
        else:
            beyond = _workspace.array("beyond", np.bool_, n)
            if valid is None and not self.int_ulp:
                self._beyond_finite(av, bv, diff, scale, beyond)
            else:
                _beyond_into(a_values, b_values, self.tolerance, beyond)
            self.outside += int(np.count_nonzero(beyond))
            if self.rows is not None:
                self.rows.add(beyond, offset)
        if scale.min() < tiny:  # a check, as numpy's maximum against a scalar is three times slower than a min
            np.maximum(scale, tiny, out=scale)
        np.divide(diff, scale, out=scale)
        self.max_rel = max(self.max_rel, float(scale.max()))
        if self.float_ulp and bits is not None and flipped is not None:   # float_ulp implies one dtype
            bits_a, bits_b = bits
            if valid is None:
                self.max_ulp = max(self.max_ulp, _max_ulp(bits_a, bits_b, flipped, self.negative_zero_steps))
            else:
                counted = (flipped != 0) & valid
                self.max_ulp = max(self.max_ulp, _max_ulp(bits_a[counted], bits_b[counted], flipped[counted],
                                                          self.negative_zero_steps))
        elif self.int_ulp:
            self.max_ulp = max(self.max_ulp, int(largest))

    def add_compiled(self, a: torch.Tensor, b: torch.Tensor, offset: int) -> bool:
        """Fold in a piece measured by the compiled pass (tdiff.compare.compiled), where it applies:
        one float dtype it knows, the bitwise rule, and only finite values; else False."""
        if not (self.same_dtype and self.dtype in compiled.KINDS and self.tolerance.exact):
            return False
        rows = self.rows
        piece = compiled.measure_bitwise(a, b, rows.differ if rows is not None else None,
                                         rows.width if rows is not None else 0, offset)
        if piece is None:
            return False
        self.numel += a.numel()
        self.valid += a.numel()
        self.magnitude = max(self.magnitude, float(piece.magnitude))
        self.squares.add_sums(piece.square_a, piece.square_b, piece.square_diff)
        if piece.mismatched:
            self.mismatched += piece.mismatched
            self.outside += piece.mismatched
            self.sum_abs += piece.sum_abs
            largest = float(piece.max_abs)
            self._keep_worst((largest, offset + piece.worst_index, float(piece.worst_a), float(piece.worst_b)))
            self.max_abs = max(self.max_abs, largest)
            self.max_rel = max(self.max_rel, float(piece.max_rel))
            self.max_ulp = max(self.max_ulp, piece.max_ulp)
        return True

    def _keep_worst(self, worst: tuple[float, int, float, float]) -> None:
        """The element of largest |a-b| so far: a later one only where larger (ties keep the earliest)."""
        if self.worst is None or worst[0] > self.worst[0]:
            self.worst = worst

    def fold(self, other: _Accumulator) -> None:
        """Fold in the accumulator of the piece that follows this one's (as :meth:`add` folds a
        chunk in: the earliest worst element stays on ties)."""
        for name in ("numel", "mismatched", "outside", "nan_mismatch", "valid", "sum_abs"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("max_abs", "max_rel", "max_ulp", "magnitude"):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))
        self.ulp_defined = self.ulp_defined and other.ulp_defined
        self.squares.fold(other.squares)
        if other.worst is not None:
            self._keep_worst(other.worst)
        if self.rows is not None and other.rows is not None:
            self.rows.fold(other.rows)

    def _beyond_finite(self, av: np.ndarray, bv: np.ndarray, diff: np.ndarray, scale: np.ndarray,
                       out: np.ndarray) -> None:
        """:func:`beyond_tolerance` of finite values, from their |a-b| and max(|a|, |b|) as already
        computed. Float64 values are judged as there. Float32 ones are judged in float32 against
        two bounds, one above and one below the float64 bound by more than float32's rounding of
        |a-b| and of the bound can move them: beyond the upper is beyond, within the lower is
        within, and only the elements between (next to none) are judged again in float64."""
        atol, rtol = self.tolerance.atol or 0.0, self.tolerance.rtol or 0.0
        if diff.dtype == np.float64 or max(atol, rtol) > _FLOAT32_SAFE:
            _beyond_into(av, bv, self.tolerance, out)
            return
        bound = _workspace.array("tolerance_bound32", np.float32, av.size)
        maybe = _workspace.array("tolerance_maybe", np.bool_, av.size)
        with np.errstate(over="ignore"):   # a bound past float32's max is past every |a-b| too
            for sign, beyond in ((1, out), (-1, maybe)):   # beyond the upper bound, then the lower
                np.multiply(scale, np.float32(rtol * (1 + sign * _MARGIN)), out=bound)
                np.add(bound, np.float32(atol * (1 + sign * _MARGIN) + sign * _TINY_MARGIN), out=bound)
                np.greater(diff, bound, out=beyond)
        if np.count_nonzero(maybe) != np.count_nonzero(out):   # out implies maybe
            unsure = np.flatnonzero(maybe & ~out)
            out[unsure] = beyond_tolerance(av[unsure], bv[unsure], self.tolerance)

    def _abs_difference(self, av: np.ndarray, bv: np.ndarray, a_values: np.ndarray, b_values: np.ndarray) -> np.ndarray:
        """|a-b| in a scratch array of the values' dtype; integers are differenced exactly."""
        diff = _workspace.array("diff", av.dtype, av.size)
        if self.int_ulp:
            diff[:] = integer_abs_difference(a_values, b_values)
        else:
            with np.errstate(invalid="ignore", over="ignore"):  # inf - inf; float32 values near its max
                np.subtract(av, bv, out=diff)
            np.abs(diff, out=diff)
        return diff

    def _fold_rows_exact(self, flipped: np.ndarray | None, offset: int, n: int) -> None:
        assert self.rows is not None
        if flipped is None:
            self.rows.add_all(offset, n)
        else:
            self.rows.add(flipped, offset)

    def _add_bits_only(self, differs: np.ndarray, n_differs: int, offset: int) -> None:
        if self.rows is not None:
            self.rows.add(differs, offset)
        self.mismatched += n_differs
        self.outside += n_differs
        self.valid += differs.size
        self.ulp_defined = False
        if n_differs and self.worst is None:
            self.worst = (0.0, offset + int(np.flatnonzero(differs)[0]), math.nan, math.nan)

    def cosine(self) -> float:
        norm_a, norm_b, diff_sq = self.squares.a, self.squares.b, self.squares.diff
        if norm_a == 0 and norm_b == 0:
            return 1.0 if self.mismatched == 0 else 0.0
        if norm_a == 0 or norm_b == 0:
            return 0.0
        product = norm_a * norm_b
        # below float64's smallest normal the product has lost digits, or is 0 (float64 values under ~1e-77)
        root = math.sqrt(product) if product >= sys.float_info.min else math.sqrt(norm_a) * math.sqrt(norm_b)
        # a.b = (|a|^2 + |b|^2 - |a-b|^2) / 2: exact to first order in the norms' rounding, so
        # float32 partial sums still give the cosine of nearly equal tensors to ~1e-12
        cosine = (norm_a + norm_b - diff_sq) / (2 * root)
        return min(1.0, max(-1.0, cosine))   # in this order a NaN comes out -1, the worst score, never 1

    def ulp_at_scale(self) -> float | None:
        if not self.ulp_defined:
            return None
        if self.int_ulp:
            return float(self.max_ulp)
        return self.max_abs / ulp_at(self.magnitude, self.dtype)

    def result(self, shape: tuple[int, ...]) -> TensorMetrics:
        worst_index = worst_a = worst_b = None
        if self.worst is not None:
            worst_index = _unravel(self.worst[1], shape)
            worst_a, worst_b = self.worst[2], self.worst[3]
        return TensorMetrics(
            numel=self.numel, bitwise_equal=False, mismatched=self.mismatched,
            outside_tolerance=self.outside, nan_mismatch=self.nan_mismatch, max_abs=self.max_abs,
            mean_abs=self.sum_abs / self.valid if self.valid else 0.0, max_rel=self.max_rel,
            max_ulp=self.max_ulp if self.ulp_defined else None, max_ulp_at_scale=self.ulp_at_scale(),
            cosine=self.cosine(),
            worst_index=worst_index, worst_a=worst_a, worst_b=worst_b)


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))
