"""Bisect: name the first op boundary that introduces a divergence between two runs.

    result = bisect_dumps("dumps/a", "dumps/b")
    result.first_divergence.module, result.first_divergence.kind    # where, and what sort of op
    result.to_json()                                                # the `tdiff bisect --json` shape
"""

from tdiff.bisect.result import BisectResult, Divergence, TrailEntry
from tdiff.bisect.walk import bisect_dumps

__all__ = ["BisectResult", "Divergence", "TrailEntry", "bisect_dumps"]
