"""The compiled pass of tdiff/compare/measure_kernel.c, where scripts/setup.sh built it.

It measures a piece of a bfloat16 or float32 pair under the bitwise rule in one pass that lets go
of the GIL (numpy's passes take it back between calls, so threads measuring at once waited on it
for half their time on the GPU machine's 16 cores: docs/PERFORMANCE.md, issue 32). Where the
library is missing, or a piece holds a NaN or an infinity, numpy measures it: the figures are
the same, but for the last bits of the sums (and, where values are so small that their squares
vanish in float32, a cosine numpy gets from |a-b| in float64, this pass from float32's: ~1e-7).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

LIBRARY = Path(__file__).with_name("measure_kernel.so")   # for any processor
LIBRARY_X86_64_V3 = Path(__file__).with_name("measure_kernel.x86-64-v3.so")   # AVX2, FMA, BMI2 ...: 2x faster
# the flags /proc/cpuinfo lists on a processor of the x86-64-v3 level (lzcnt is "abm")
X86_64_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
KINDS = {torch.bfloat16: 0, torch.float32: 1}   # the dtypes the pass knows, by its codes


class Piece(ctypes.Structure):
    """What the pass found in a piece (its C struct, tdiff_piece)."""

    _fields_ = [("mismatched", ctypes.c_int64), ("worst_index", ctypes.c_int64), ("max_ulp", ctypes.c_int64),
                ("sum_abs", ctypes.c_double), ("square_a", ctypes.c_double), ("square_b", ctypes.c_double),
                ("square_diff", ctypes.c_double), ("max_abs", ctypes.c_float), ("max_rel", ctypes.c_float),
                ("magnitude", ctypes.c_float), ("worst_a", ctypes.c_float), ("worst_b", ctypes.c_float)]


def _processor_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def library() -> Path:
    """The build for this processor."""
    return LIBRARY_X86_64_V3 if LIBRARY_X86_64_V3.exists() and X86_64_V3_FLAGS <= _processor_flags() else LIBRARY


def _load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        function = ctypes.CDLL(str(library())).tdiff_measure_bitwise
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                         ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(Piece)]
    return function


kernel = _load()


def measure_bitwise(a: torch.Tensor, b: torch.Tensor, rows: np.ndarray | None, width: int, offset: int) -> Piece | None:
    """The pass over two 1-d tensors of one dtype of :data:`KINDS`, which start at flat element
    ``offset`` of their tensors; it marks in ``rows`` (bool, one per row of ``width`` elements) the
    rows where bits differ. None where it cannot measure them (no library; a strided view, whose
    elements are not the bytes from its first on; a NaN or an infinity; a difference past
    float32's max): measure them with numpy."""
    if kernel is None or not (a.is_contiguous() and b.is_contiguous()):
        return None
    piece = Piece()
    failed = kernel(a.data_ptr(), b.data_ptr(), a.numel(), KINDS[a.dtype],
                    rows.ctypes.data if rows is not None else None, width, offset, ctypes.byref(piece))
    return None if failed else piece
