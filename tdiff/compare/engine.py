"""Compare two dumps: pair tensors, load each pair, compute metrics, stream the results.

Memory stays a small multiple of the largest tensor: one pair is loaded at a time and dropped
once measured. A tensor stored once for several records (aliases) is measured once.
"""

from __future__ import annotations

import functools
import math
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tdiff.compare.distributed import Counting, map_over_processes, torchrun_world
from tdiff.compare.metrics import (EXACT, WORKSPACE_BYTES, ReportedMetrics, TensorMetrics, Tolerance, json_number,
                                  measure)
from tdiff.compare.pairing import NameFilter, NamePairing, Pair, Pairing, Side, keep_uncompared, pair_layer
from tdiff.compare.parallel import map_in_order, map_until_error, spread
from tdiff.compare.result import CompareResult, DumpSide, TensorVerdict, status_counts
from tdiff.compare.tokens import TokenVerdict, token_verdict
from tdiff.errors import TdiffError
from tdiff.store import Dump, Record
from tdiff.store.reader import RankTally
from tdiff.store.dtypes import stored_nbytes, torch_dtype
from tdiff.store.fingerprint import fingerprint_algorithm, fingerprint_as
from tdiff.vocab.kinds import record_kind


MEMORY_HEADROOM = 512 << 20   # issue 32: a compare peaks at its largest pair + 512 MB, whatever --jobs


@dataclass
class Comparison:
    """The verdict on one pair."""

    name: str
    status: str                         # "match" or one of DIVERGED_STATUSES
    a: Record | None
    b: Record | None
    metrics: TensorMetrics | None = None
    reason: str | None = None
    kind: str | None = None
    plan_a: list[str] = field(default_factory=list)
    plan_b: list[str] = field(default_factory=list)
    tokens: TokenVerdict | None = None   # per token, when the pair's rows are aligned tokens

    @property
    def diverged(self) -> bool:
        return self.status != "match"

    @property
    def record(self) -> Record:
        return self.a or self.b

    @property
    def layer(self) -> int | None:
        return pair_layer(self.name, self.kind, self.record)

    @property
    def boundary_kind(self) -> str:
        """The kind `tdiff bisect` gives this boundary: the adapter's canonical kind, else one read
        from the module's class and path (tdiff.vocab.kinds)."""
        return record_kind(self.record, self.kind)

    def verdict(self) -> TensorVerdict:
        """This verdict as `tdiff compare --json` lists it."""
        r = self.record
        return TensorVerdict(
            name=self.name, status=self.status, role=r.role, step=r.step, call=r.call, rank=r.rank, thread=r.thread,
            module=self.a.module if self.a else None, module_b=self.b.module if self.b else None,
            layer=self.layer, kind=self.boundary_kind, dtype_a=self.a.dtype if self.a else None,
            dtype_b=self.b.dtype if self.b else None, shape_a=list(self.a.shape) if self.a else None,
            shape_b=list(self.b.shape) if self.b else None, reason=self.reason or None,
            metrics=ReportedMetrics.of(self.metrics) if self.metrics is not None else None,
            plan_a=list(self.plan_a), plan_b=list(self.plan_b), tokens=self.tokens)

    def to_json(self) -> dict:
        return self.verdict().to_json()


@dataclass
class CompareOptions:
    tolerance: Tolerance = EXACT
    layers: str | None = None         # decoder layers, "0-3,7" (None: all)
    select: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)


class AlignmentPlan(Protocol):
    def to_json(self) -> dict: ...


@dataclass
class CompareReport:
    a: Dump
    b: Dump
    options: CompareOptions
    comparisons: list[Comparison]
    pairing: Pairing                  # how the tensors were paired: the report reloads the culprit through it
    alignment: AlignmentPlan | None = None   # how a cross-framework pairing aligned the dumps
    left_out: int = 0                 # pairs that --layers/--select/--exclude left out

    @property
    def status(self) -> str:
        return "diverged" if any(c.diverged for c in self.comparisons) or self.partings else "match"

    @property
    def partings(self) -> list:
        """Where sequences aligned by token were fed different tokens (the runs sampled
        differently): divergences by themselves, the lowest position first."""
        return list(getattr(self.alignment, "partings", []))

    @property
    def first_divergence(self) -> Comparison | None:
        return next((c for c in self.comparisons if c.diverged), None)

    @property
    def same_dump(self) -> bool:
        return self.a.is_same_dump(self.b)

    def counts(self) -> dict:
        return status_counts(c.status for c in self.comparisons)

    def result(self) -> CompareResult:
        """What was found, without the dumps and the pairing: the `tdiff compare --json` object."""
        return CompareResult(
            a=_dump_side(self.a), b=_dump_side(self.b), tolerance=self.options.tolerance.describe(),
            left_out=self.left_out, same_dump=self.same_dump, tensors=[c.verdict() for c in self.comparisons],
            alignment=self.alignment.to_json() if self.alignment is not None else None)

    def to_json(self) -> dict:
        return self.result().to_json()


def unaligned_notes(alignment: object, *, diverged: bool, allow_unaligned: bool) -> list[str]:
    """What a token alignment left uncompared, as the verdict takes it (docs/ALIGNMENT.md): a
    match that compared less than both runs fed is no match, raised as TdiffError (exit 2) unless
    ``allow_unaligned``; a divergence stands (exit 1). Otherwise a note to list."""
    uncompared = getattr(alignment, "uncompared", None)
    if uncompared is None or not uncompared.count:
        return []
    if not diverged and not allow_unaligned:
        raise TdiffError(uncompared.message())
    return [uncompared.note()]


def _dump_side(dump: Dump) -> DumpSide:
    return DumpSide(path=str(dump.path), side=dump.side, problems=dump.problems, notes=dump.notes)


def compare_dumps(a: Dump, b: Dump, options: CompareOptions | None = None, *,
                  pairing: Pairing | None = None,
                  progress: Callable[[int, int], None] | None = None, jobs: int = 1,
                  echo: Callable[[str], None] | None = None) -> CompareReport:
    """Every pair of A and B measured; ``jobs`` pairs at a time (tdiff.compare.parallel), and under
    torchrun split over its processes (tdiff.compare.distributed): the report is the same, and the
    first process ``echo``es what each process compared and read."""
    options = options or CompareOptions()
    pairing = pairing or NamePairing()
    names = NameFilter.of(options.select, options.exclude, options.layers)
    paired = pairing.pair(a, b)
    pairs = [p for p in paired if names.wants_pair(p)]
    keep_uncompared(getattr(pairing, "alignment", None), names.wants_tensor)
    if not pairs:
        raise TdiffError(names.nothing_left())
    alignment = getattr(pairing, "alignment", None)
    comparisons = _compare_all(PairComparator(a, b, options.tolerance), pairs, jobs, progress, alignment, echo)
    return CompareReport(a, b, options, comparisons, pairing, alignment,
                         left_out=len(paired) - len(pairs))


def _compare_all(comparator: PairComparator, pairs: list[Pair], jobs: int,
                 progress: Callable[[int, int], None] | None, alignment,
                 echo: Callable[[str], None] | None) -> list[Comparison]:
    world = torchrun_world()
    memory = _memory_for_pairs(max(map(_pair_bytes, pairs)), jobs)
    if world is None:
        return map_in_order(comparator.compare, pairs, jobs=jobs, group_of=comparator.cache_key,
                            weight_of=_pair_bytes, memory=memory, progress=progress)
    return map_over_processes(
        lambda share: map_until_error(comparator.compare, [pairs[i] for i in share], jobs=jobs,
                                      group_of=comparator.cache_key, weight_of=_pair_bytes, memory=memory),
        pairs, owner_key=lambda pair: pair.record.rank, world=world,
        counting=Counting("pairs", comparator.compared, [dump.reads for dump in comparator.dumps]),
        echo=echo,
        # the replica checks of every process's loads, as one process would have warned
        notes=lambda: list(getattr(alignment, "warnings", [])), take_note=getattr(alignment, "warn", lambda note: None))


def _memory_for_pairs(largest: int, jobs: int) -> int:
    """The bytes of pairs that threads may measure at once (issue 32: compare's peak memory is at
    most its largest pair + 512 MB): the largest pair, and what the 512 MB leave beside what the
    process holds already (the interpreter, torch, the dumps' records) and its threads' scratch.
    Where those take it all, pairs run together only within the largest pair's bytes."""
    return largest + max(0, MEMORY_HEADROOM - resident_bytes() - jobs * WORKSPACE_BYTES)


def resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _pair_bytes(pair: Pair) -> int:
    """The bytes of a pair's stored tensors (what measuring it holds in memory)."""
    sides = [side for side in (pair.a, pair.b) if side is not None]
    return sum(stored_nbytes(r.dtype, r.shape) for side in sides for r in side.records if r.has_data)



def shape_mismatch(shape_a, shape_b) -> str:
    """Why two tensors cannot be compared; a leading dimension alone that differs is most often a
    batch against one of its sequences, which --batch-row lines up."""
    reason = f"shape {list(shape_a)} vs {list(shape_b)}"
    if len(shape_a) == len(shape_b) > 1 and shape_a[1:] == shape_b[1:]:
        reason += ("; only the leading dimension differs: for a batch against one of its sequences, capture "
                   "the batched run with --batch-row N (the sequence's row)")
    return reason


class PairComparator:
    """Compares pairs of one dump pair; remembers results for tensors stored once (aliases)."""

    def __init__(self, a: Dump, b: Dump, tolerance: Tolerance):
        self.dumps = (a, b)
        self.tolerance = tolerance
        self._measured: dict[tuple, tuple[str, TensorMetrics | None, str | None]] = {}
        self.compared = RankTally()   # the pairs compared, by rank

    def compare(self, pair: Pair) -> Comparison:
        self.compared.add(pair.record.rank)
        if pair.a is None or pair.b is None:
            status = "only_b" if pair.a is None else "only_a"
            side = "B" if pair.a is None else "A"
            return self._result(pair, status, reason=pair.note or f"captured on side {side} only")
        ra, rb = pair.a.record, pair.b.record
        quantization = quantization_differs(ra, rb)
        if quantization is not None:   # equal integers stand for other values
            return self._result(pair, "mismatch", reason=quantization)
        if pair.a.load is None and pair.b.load is None:
            # the shapes and dtypes are known before loading when tensors are compared as stored
            if ra.shape != rb.shape:
                return self._result(pair, "shape_mismatch", reason=shape_mismatch(ra.shape, rb.shape))
            if not (ra.has_data and rb.has_data):
                return self._compare_fingerprints(pair)
        cache_key = self.cache_key(pair)
        if cache_key in self._measured:
            return self._result(pair, *self._measured[cache_key])
        # the two loads (each checked against its fingerprint) at once where a thread is idle
        ta, tb = spread([functools.partial(self._load, pair.a, 0), functools.partial(self._load, pair.b, 1)])
        verdict: tuple[str, TensorMetrics | None, str | None]
        tokens = None
        if cache_key is not None and _same_verified_fingerprint(ra, rb):
            # loading checked both tensors against their fingerprints: equal ones are equal bits
            verdict = ("match", TensorMetrics(numel=ta.numel(), bitwise_equal=True), None)
            if pair.tokens is not None and ta.shape == tb.shape:
                tokens = token_verdict(np.zeros(len(pair.tokens.refs), dtype=bool), pair.tokens)
        elif ta.shape != tb.shape:
            verdict = ("shape_mismatch", None, shape_mismatch(ta.shape, tb.shape))
        else:
            # the metrics and the per-token verdicts in one pass over the pair
            measured = measure(ta, tb, self.tolerance, by_rows=pair.tokens is not None)
            metrics = measured.metrics
            if pair.tokens is not None and measured.rows_differ is not None:
                tokens = token_verdict(measured.rows_differ, pair.tokens)
            if ta.dtype != tb.dtype:
                verdict = ("dtype_mismatch", metrics, f"dtype {_dtype(ta)} vs {_dtype(tb)}")
            else:
                verdict = ("match" if metrics.within(self.tolerance) else "mismatch", metrics, None)
        if cache_key is not None:
            self._measured[cache_key] = verdict
        return self._result(pair, *verdict, tokens=tokens)

    def _load(self, side: Side, which: int):
        return side.load() if side.load is not None else self.dumps[which].load(side.record)

    @staticmethod
    def cache_key(pair: Pair) -> tuple | None:
        """What a pair's verdict is remembered by: its two stored tensors (None: not remembered)."""
        if pair.a is None or pair.b is None or pair.a.load is not None or pair.b.load is not None or len(pair.a.records) + len(pair.b.records) != 2:
            return None
        ra, rb = pair.a.record, pair.b.record
        return (ra.file, ra.key, ra.dtype, ra.shape, rb.file, rb.key, rb.dtype, rb.shape)

    def _compare_fingerprints(self, pair: Pair) -> Comparison:
        """Stats-mode records carry a fingerprint instead of data: equal fingerprints are equal bits."""
        ra, rb = pair.a.record, pair.b.record
        if ra.dtype != rb.dtype:
            return self._result(pair, "dtype_mismatch", reason=f"dtype {ra.dtype} vs {rb.dtype}")
        fa, fb = ra.fingerprint, rb.fingerprint
        algo_a, algo_b = fingerprint_algorithm(fa), fingerprint_algorithm(fb)
        if algo_a != algo_b:
            if ra.has_data:
                fa = fingerprint_as(self.dumps[0].load(ra), algo_b)
            elif rb.has_data:
                fb = fingerprint_as(self.dumps[1].load(rb), algo_a)
            else:
                return self._result(pair, "mismatch", reason=(
                    f"fingerprints of different kinds ({algo_a} vs {algo_b}) cannot be compared; "
                    "capture one side in full mode"))
        if fa is not None and fa == fb:
            return self._result(pair, "match", reason="equal fingerprints (stats mode)")
        if not self.tolerance.exact and not _statistics_exceed(ra.stats or {}, rb.stats or {}, self.tolerance,
                                                               torch_dtype(ra.dtype)):
            raise TdiffError(f"{pair.name}: the fingerprints differ (stats mode), and its statistics cannot tell "
                             f"whether it is within {self.tolerance.describe()}; capture in full mode to compare "
                             "under --atol/--rtol/--ulp, or compare bitwise")
        return self._result(pair, "mismatch", reason="fingerprints differ (stats mode): " +
                            _stats_delta(ra.stats or {}, rb.stats or {}))

    def _result(self, pair: Pair, status: str, metrics: TensorMetrics | None = None,
                reason: str | None = None, tokens: TokenVerdict | None = None) -> Comparison:
        return Comparison(name=pair.name, status=status, a=pair.a.record if pair.a else None,
                          b=pair.b.record if pair.b else None, metrics=metrics, reason=reason,
                          kind=pair.kind, plan_a=pair.a.plan if pair.a else [],
                          plan_b=pair.b.plan if pair.b else [], tokens=tokens)


def quantization_differs(a: Record, b: Record) -> str | None:
    """How two quantized tensors' scales or zero points differ (capture keeps them in
    attrs["quantization"] beside the integers), or None where they agree."""
    qa, qb = a.attrs.get("quantization"), b.attrs.get("quantization")
    if qa == qb:
        return None
    qa, qb = qa or {}, qb or {}
    parts = []
    for key in dict.fromkeys([*qa, *qb]):
        va, vb = qa.get(key), qb.get(key)
        if va == vb:
            continue
        if isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):   # per channel: the first
            i = next(i for i, (x, y) in enumerate(zip(va, vb)) if x != y)
            key, va, vb = f"{key}[{i}]", va[i], vb[i]
        parts.append(f"{key} {va} vs {vb}")
    return "quantization differs: " + ", ".join(parts)


def _same_verified_fingerprint(a: Record, b: Record) -> bool:
    return fingerprint_algorithm(a.fingerprint) == "xxh3" and a.fingerprint == b.fingerprint


def _statistics_exceed(sa: dict, sb: dict, tolerance: Tolerance, dtype: torch.dtype) -> bool:
    """Whether two tensors' statistics alone prove an element beyond the tolerance. Each side's
    minimum is one of its elements, so some element differs by at least the minimums' difference
    (the maximums' likewise), while no element's bound passes atol + rtol * the largest magnitude
    (+ ulp ULPs of ``dtype`` at it, the tensors' scale);
    NaN or infinity counts that differ leave an element without its equal on the other side."""
    if sa.get("nan") != sb.get("nan") or sa.get("inf") != sb.get("inf"):
        return True
    extremes = [sa.get("min"), sa.get("max"), sb.get("min"), sb.get("max")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in extremes):
        return False
    min_a, max_a, min_b, max_b = extremes
    scale = max(abs(v) for v in extremes)
    tolerance = tolerance.at_magnitude(scale, dtype)
    bound = (tolerance.atol or 0.0) + (tolerance.rtol or 0.0) * scale
    return max(abs(min_a - min_b), abs(max_a - max_b)) > bound


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _stats_delta(sa: dict, sb: dict) -> str:
    parts = []
    for key in ("mean", "abs_mean", "min", "max", "nan", "inf"):
        va, vb = sa.get(key), sb.get(key)
        if va != vb:
            parts.append(f"{key} {json_number(va)} vs {json_number(vb)}")
    return ", ".join(parts) if parts else "statistics equal"

