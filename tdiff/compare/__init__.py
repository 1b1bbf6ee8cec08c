"""Comparison: pair tensors of two dumps (pluggable), then measure each pair."""

from tdiff.compare.engine import CompareOptions, CompareReport, Comparison, compare_dumps
from tdiff.compare.metrics import EXACT, TensorMetrics, Tolerance, compare_tensors
from tdiff.compare.pairing import NamePairing, Pair, Pairing, Side

__all__ = [
    "CompareOptions", "CompareReport", "Comparison", "compare_dumps", "EXACT", "TensorMetrics",
    "Tolerance", "compare_tensors", "NamePairing", "Pair", "Pairing", "Side",
]
