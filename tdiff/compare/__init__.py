"""Comparison: pair tensors of two dumps (pluggable), then measure each pair."""

from tdiff.compare.engine import CompareOptions, CompareReport, Comparison, compare_dumps
from tdiff.compare.metrics import EXACT, TensorMetrics, Tolerance, compare_tensors
from tdiff.compare.pairing import NamePairing, Pair, Pairing, Side
from tdiff.compare.result import CompareResult, TensorVerdict

__all__ = [
    "CompareOptions", "CompareReport", "CompareResult", "Comparison", "TensorVerdict", "compare_dumps", "EXACT",
    "TensorMetrics", "Tolerance", "compare_tensors", "NamePairing", "Pair", "Pairing", "Side",
]
