"""The verdict on one event: equal fingerprints settle a match without loading a tensor.

Bisect walks events in order until the first divergence, so almost every event it compares
matches. Two records of one fingerprint algorithm with equal fingerprints hold equal bits (the
fingerprint covers dtype, shape and bytes), which matches under any tolerance; only the rest are
loaded and measured by :class:`tdiff.compare.engine.PairComparator`.
"""

from __future__ import annotations

from tdiff.compare.engine import Comparison, PairComparator, quantization_differs
from tdiff.compare.metrics import Tolerance
from tdiff.compare.pairing import Pair
from tdiff.store import Dump
from tdiff.store.reader import RankTally
from tdiff.store.fingerprint import fingerprint_algorithm


class EventComparator:
    def __init__(self, a: Dump, b: Dump, tolerance: Tolerance):
        self.tolerance = tolerance
        self.dumps = (a, b)
        self._pairs = PairComparator(a, b, tolerance)
        self.events = RankTally()   # the events compared, by rank (streams are walked on several threads)

    @property
    def compared(self) -> int:
        return sum(count for count, _ in self.events.snapshot().values())

    def compare(self, pair: Pair) -> Comparison:
        self.events.add(pair.record.rank)
        if _same_fingerprint(pair):
            return Comparison(name=pair.name, status="match", a=pair.a.record, b=pair.b.record,
                              kind=pair.kind)
        return self._pairs.compare(pair)


def _same_fingerprint(pair: Pair) -> bool:
    if pair.a is None or pair.b is None or pair.a.load is not None or pair.b.load is not None:
        return False
    if len(pair.a.records) != 1 or len(pair.b.records) != 1:
        return False
    if quantization_differs(pair.a.record, pair.b.record) is not None:
        return False
    fa, fb = pair.a.record.fingerprint, pair.b.record.fingerprint
    return fa is not None and fa == fb and fingerprint_algorithm(fa) == fingerprint_algorithm(fb)
