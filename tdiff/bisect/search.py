"""The binary-search state machine, apart from what is searched (Polygraphy ``debug reduce`` style).

It finds the first of ``n`` ordered boundaries whose probe says "diverged", assuming a divergence,
once introduced, persists at every later boundary. The answer ``n`` means no boundary diverged.
Each probe halves the candidates, so at most ceil(log2(n + 1)) probes are needed.

Examples:
    >>> search = BinarySearch(18)
    >>> while (index := search.next_probe()) is not None:
    ...     search.record(index, diverged=index >= 11)
    >>> search.result, search.probes
    (11, 5)
"""

from __future__ import annotations

import math


class BinarySearch:
    def __init__(self, n: int):
        self.n = n
        self.low, self.high = 0, n   # the answer lies in [low, high]
        self.probes = 0

    @staticmethod
    def max_probes(n: int) -> int:
        return math.ceil(math.log2(n + 1))

    @property
    def done(self) -> bool:
        return self.low == self.high

    @property
    def result(self) -> int:
        if not self.done:
            raise RuntimeError("the search is not finished")
        return self.low

    def next_probe(self) -> int | None:
        return None if self.done else (self.low + self.high) // 2

    def record(self, index: int, diverged: bool) -> None:
        if not self.low <= index < self.high:
            raise ValueError(f"probe {index} lies outside the candidates [{self.low}, {self.high})")
        self.probes += 1
        if diverged:
            self.high = index
        else:
            self.low = index + 1
