"""Online bisection: run both commands under capture as often as needed, no more.

1. **Stats pass** (default, bitwise only): both sides capture every boundary in stats mode
   (fingerprints, no tensors); the offline walk on those names the culprit exactly.
2. **Binary search** (``--no-stats-pass``, or a tolerance, which fingerprints cannot judge): one
   discovery run on side A records its structure outside the decoder layers; then each probe runs
   both sides capturing one spine boundary (tdiff.bisect.spine) until the first differing one is
   found: at most ceil(log2(boundaries + 1)) probes per side.
3. **Final capture**: both sides capture the narrowed region in full mode; the offline walk on
   those dumps names the culprit with its metrics.

``--budget-gb`` caps the tensor data of a full capture per side: the region is narrowed until it
fits (in search mode that needs one more discovery run on side A, inside the narrowed layer).

Every pair of captures is paired as two dumps are (tdiff.align.choose_pairing, with ``--mapping``
and ``--align``). Runs whose token layouts differ are aligned token by token, which compares rows
of tensors: once the stats pass or the first probe finds that, both runs are captured in full,
every boundary, and bisected as two dumps. Coverage is part of the verdict as in compare:
tensor-tokens both runs fed that were not compared make a match exit 2 unless a divergence was
found, or ``--allow-unaligned`` (then a note lists them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tdiff.bisect.regions import Region, ancestors, enclosing_layer, parents_by_path, record_bytes
from tdiff.bisect.result import BisectResult, Divergence
from tdiff.bisect.runs import Runner
from tdiff.bisect.search import BinarySearch
from tdiff.bisect.spine import INSIDE_LAYER, Boundary, interval_region, spine_boundaries
from tdiff.bisect.verdict import EventComparator
from tdiff.bisect.walk import bisect_dumps
from tdiff.bisect.zoom import zoom_in
from tdiff.compare.engine import Comparison
from tdiff.compare.metrics import EXACT, Tolerance
from tdiff.compare.pairing import NameFilter, Pair, Pairing
from tdiff.errors import TdiffError
from tdiff.store import Dump

GIB = 1 << 30


@dataclass
class OnlineOptions:
    tolerance: Tolerance = EXACT
    stats_pass: bool = True
    budget_bytes: int | None = None
    steps: str | None = None
    pairing: Pairing | None = None   # None: each pair of captures paired as two dumps are (choose_pairing)
    mapping: str | None = None
    align: str | None = None
    allow_unaligned: bool = False
    # --select/--exclude: the tensors every run's comparison keeps
    names: NameFilter = field(default_factory=NameFilter)

    def pairing_of(self, a: Dump, b: Dump) -> Pairing:
        """How two captures pair: as given, else as two dumps pair; under --select/--exclude."""
        if self.pairing is not None:
            chosen = self.pairing
        else:
            from tdiff.align import choose_pairing

            chosen = choose_pairing(a, b, self.mapping, self.align)
        return self.names.applied_to(chosen) or chosen


def bisect_commands(run_a: str, run_b: str, work: Path, options: OnlineOptions,
                    echo: Callable[[str], None]) -> tuple[BisectResult, Runner, Dump | None]:
    """Bisect two commands. Returns the result (with its run log), the runner (for a graft run)
    and side A's final full capture (None when there was none)."""
    runner = Runner({"A": run_a, "B": run_b}, work, echo)
    if options.stats_pass and options.tolerance.exact:
        result, final_a = _with_stats_pass(runner, options)
    else:
        why = "--no-stats-pass" if not options.stats_pass else "fingerprints cannot judge --atol/--rtol/--ulp"
        echo(f"stats pass skipped ({why}): binary search over boundaries with selective captures")
        result, final_a = _with_search(runner, options)
    result.notes += zoom_in(runner, result.first_divergence, options.tolerance, options.pairing_of)  # to the op
    result.runs = runner.log
    return result, runner, final_a


# ---- 1. stats pass ----
def _with_stats_pass(runner: Runner, options: OnlineOptions) -> tuple[BisectResult, Dump | None]:
    runner.log.strategy = "a stats pass, then a full capture of the region"
    why = "fingerprints of every boundary (stats mode)"
    run_a, a = runner.capture("A", "stats pass", why, mode="stats", steps=options.steps)
    run_b, b = runner.capture("B", "stats pass", why, mode="stats", steps=options.steps)
    pairing = options.pairing_of(a, b)
    if _by_rows(pairing.pair(a, b)):
        run_a.outcome = run_b.outcome = "aligned by token"
        return _full_pass(runner, options)
    stats = bisect_dumps(a, b, pairing=pairing, allow_unaligned=options.allow_unaligned)
    run_a.outcome = run_b.outcome = stats.status
    divergence = stats.first_divergence
    if divergence is None:
        return stats, None
    runner.echo(f"  first divergence: {divergence.description}")
    region = _region_around(divergence, a.records, options.budget_bytes)
    if region is None:
        stats.notes.append("no full capture: the smallest region around the divergence is larger than "
                           "--budget-gb; metrics are not available")
        return stats, None
    final, final_a = _final(runner, region, options)
    if final.first_divergence is None:
        stats.notes.append(f"the full capture of {region.describe()} did not reproduce the divergence "
                           "the stats pass found: the runs are not repeatable (see tdiff capture --repeat)")
        return stats, None
    final.checked += stats.checked
    return final, final_a


def _by_rows(pairs: list[Pair]) -> bool:
    """Whether the pairs compare rows of tensors token by token (runs whose token layouts differ):
    a stats capture stores no rows, and a search over one step of side A cannot follow tokens the
    other run feeds at other steps, so such runs are captured in full, every boundary at once."""
    return any(pair.tokens is not None for pair in pairs)


def _full_pass(runner: Runner, options: OnlineOptions) -> tuple[BisectResult, Dump | None]:
    """Runs aligned by token: both captured in full mode, every boundary, and bisected as two dumps."""
    runner.log.strategy = "a full capture of every boundary (the runs are aligned by token)"
    runner.echo("  the runs' token layouts differ: their rows are compared token by token, which needs every "
                "boundary's tensors; capturing them in full mode")
    why = "every boundary's tensors, to align the runs by token"
    _, a = runner.capture("A", "final capture", why, mode="full", steps=options.steps, params=True)
    needed = sum(record_bytes(r) for r in a.records if r.alias_of is None)
    if options.budget_bytes is not None and needed > options.budget_bytes:
        raise TdiffError(f"the runs are aligned by token, which needs every boundary's tensors: {needed / GIB:.3g} "
                         f"GiB on side A, more than --budget-gb ({options.budget_bytes / GIB:.3g}); raise it, or "
                         "capture fewer steps with --steps")
    _, b = runner.capture("B", "final capture", why, mode="full", steps=options.steps, params=True)
    return (bisect_dumps(a, b, tolerance=options.tolerance, pairing=options.pairing_of(a, b),
                         allow_unaligned=options.allow_unaligned), a)


def _region_around(divergence: Divergence, records, budget: int | None) -> Region | None:
    """The largest of: the enclosing decoder layer, the culprit's subtree, the culprit alone (with
    the events it is judged against), that fits the budget."""
    parents = parents_by_path(records)
    location = divergence.module
    needed: list[tuple[str, bool]] = []
    if divergence.before is not None:
        needed.append((divergence.before, False))
    assert divergence.first is not None, "a divergence found in this process carries its comparison"
    first = divergence.first.record
    if first.role == "input" and first.module != location:
        needed.append((first.module, False))  # the module whose input showed the divergence
    needed += [(path, False) for path in ancestors(location, parents)] if location is not None else []
    candidates = []
    layer = enclosing_layer(location)
    if layer is not None and layer != location:
        candidates.append([(layer, True), *needed])
    if location is not None:
        candidates += [[(location, True), *needed], [(location, False), *needed]]
    else:
        candidates.append(needed)
    for entries in candidates:
        region = Region(entries, divergence.step)
        if budget is None or region.nbytes(records) <= budget:
            return region
    return None


# ---- 2. binary search ----
def _with_search(runner: Runner, options: OnlineOptions) -> tuple[BisectResult, Dump | None]:
    runner.log.strategy = "a discovery run, a binary search over boundaries, a full capture"
    _, discovery = runner.capture(
        "A", "discovery", "side A's structure outside the decoder layers (stats mode; nothing is compared)",
        mode="stats", exclude=[INSIDE_LAYER], steps=options.steps)
    spine = spine_boundaries(discovery)
    if options.names:   # a boundary whose tensors --select/--exclude leave out cannot be probed
        spine = [b for b in spine if any(b.matches(r) and options.names.wants_record(r) for r in discovery.records)]
    if not spine:
        raise TdiffError("side A's discovery run recorded nothing to search over (no decoder layer, "
                         "outermost model output or explicit dump)")
    runner.log.boundaries = len(spine)
    runner.echo(f"  {len(spine)} boundaries: at most {BinarySearch.max_probes(len(spine))} probes per side")
    search = BinarySearch(len(spine))
    differing: dict[int, Comparison] = {}
    checked = 0
    while (index := search.next_probe()) is not None:
        probed = _probe(runner, spine[index], options)
        if probed is None:
            return _full_pass(runner, options)
        verdict, compared = probed
        checked += compared
        if verdict is not None:
            differing[index] = verdict
        search.record(index, verdict is not None)
    if search.result == len(spine):
        note = (f"every probed boundary matches, including the last of {len(spine)} "
                "(the search assumes that a divergence, once introduced, persists to every later boundary)")
        return BisectResult(status="match", first_divergence=None, checked=checked, tolerance=options.tolerance.describe(),
                            notes=[note]), None
    boundary = spine[search.result]
    region = interval_region(discovery, spine, search.result)
    if options.budget_bytes is not None:
        region = _fit(runner, region, discovery, options.budget_bytes)
    final, final_a = _final(runner, region, options)
    final.checked += checked
    if final.first_divergence is None:
        comparison = differing[search.result]
        final.status = "diverged"
        final.first_divergence = Divergence.found(
            name=comparison.name, module=boundary.module, module_b=boundary.module, kind="other",
            event="output", introduced=False, comparison=comparison,
            description=f"the probe found {boundary} differing, but the full capture of the region "
                        "matched: the runs are not repeatable (see tdiff capture --repeat)")
        return final, None
    return final, final_a


def _probe(runner: Runner, boundary: Boundary, options: OnlineOptions) -> tuple[Comparison | None, int] | None:
    """Capture one boundary on both sides; the first differing tensor there (or None) and the
    tensors compared; None when the runs are aligned by token (a search over one step's boundaries
    of side A cannot follow tokens that the other run feeds at other steps)."""
    mode = "stats" if options.tolerance.exact else "full"
    why = f"does {boundary} differ?"
    select, steps = boundary.probe_select(), str(boundary.step)
    run_a, a = runner.capture("A", "probe", why, mode=mode, select=select, steps=steps)
    run_b, b = runner.capture("B", "probe", why, mode=mode, select=select, steps=steps)
    paired = options.pairing_of(a, b).pair(a, b)
    if _by_rows(paired):
        run_a.outcome = run_b.outcome = "aligned by token"
        return None
    pairs = [p for p in paired if boundary.matches(p.record)]
    if not any(p.a is not None for p in pairs):
        raise TdiffError(f"side A did not record {boundary} again: its runs differ in structure")
    if not any(p.b is not None for p in pairs):
        raise TdiffError(f"side B has no {boundary}: online bisection pairs boundaries by name, so both "
                         "commands must run the same model code")
    comparator = EventComparator(a, b, options.tolerance)
    differing = next((c for c in map(comparator.compare, pairs) if c.diverged), None)
    run_a.outcome = run_b.outcome = "differs" if differing else "matches"
    runner.echo(f"  {boundary} {run_a.outcome}")
    return differing, comparator.compared


def _fit(runner: Runner, region: Region, discovery: Dump, budget: int) -> Region:
    """Make the search's region fit the budget, measuring the inside of its decoder layer first."""
    records = list(discovery.records)
    for layer in region.unknown:
        inside = Region([(layer, True)], region.step)
        _, sizes = runner.capture("A", "discovery", f"sizes inside `{layer}` for --budget-gb (stats mode)",
                                  mode="stats", select=inside.select(), steps=str(region.step))
        records += sizes.records
    region.unknown = []
    if region.nbytes(records) <= budget:
        return region
    parents = parents_by_path(records)
    narrower = [(path, False) for path, _ in region.entries]
    narrower += [(path, False) for path, parent in parents.items()
                 if any(parent == layer and subtree for layer, subtree in region.entries)]
    narrowed = Region(narrower, region.step)
    if narrowed.nbytes(records) <= budget:
        return narrowed
    raise TdiffError(f"the narrowed region ({region.describe()}) needs {narrowed.nbytes(records) / GIB:.3g} "
                     f"GiB per side even without the inside of its layer's children; raise --budget-gb "
                     f"(now {budget / GIB:.3g})")


# ---- 3. the full capture ----
def _final(runner: Runner, region: Region, options: OnlineOptions) -> tuple[BisectResult, Dump]:
    why = f"full tensors of {region.describe()}"
    steps = str(region.step)
    # with the region's parameters: the culprit's exact replay reads them (tdiff.bisect.cause)
    _, a = runner.capture("A", "final capture", why, mode="full", select=region.select(), steps=steps, params=True)
    _, b = runner.capture("B", "final capture", why, mode="full", select=region.select(), steps=steps, params=True)
    return bisect_dumps(a, b, tolerance=options.tolerance, pairing=options.pairing_of(a, b),
                        allow_unaligned=options.allow_unaligned), a
