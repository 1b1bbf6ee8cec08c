"""Bisect: name the first op boundary that introduces a divergence between two runs.

    result = tdiff.bisect.run("dumps/a", "dumps/b")                  # or run_a=CMD, run_b=CMD; graft, try
    result.first_divergence.module, result.first_divergence.kind    # where, and what sort of op
    result.to_json()                                                # the `tdiff bisect --json` shape
"""

from tdiff.bisect.orchestration import run
from tdiff.bisect.result import BisectResult, Divergence, TrailEntry
from tdiff.bisect.walk import bisect_dumps

__all__ = ["BisectResult", "Divergence", "TrailEntry", "bisect_dumps", "run"]
