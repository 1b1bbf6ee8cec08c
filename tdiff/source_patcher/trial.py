"""`tdiff patch try`: which candidate fix makes run B agree with baseline A?

Run B's command is captured once unpatched (the control) and once per candidate, each run into its
own dump in a working directory; each dump is compared with the baseline. Candidates are ranked:
a match first, then by how far the first divergence moved later in execution order (compared to
the control), then by fewer mismatched tensors, then by smaller ULP at scale, then by fewer patches;
a run that failed last.

    report = try_candidates(candidates_from("builtin"), "dumps/a", ["python", "run.py"])
    report.best          # name of the best candidate, or None
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tdiff.align import choose_pairing
from tdiff.capture_options import DEFAULTS, CaptureOptions
from tdiff.compare.engine import CompareOptions, CompareReport, compare_dumps, unaligned_notes
from tdiff.compare.metrics import EXACT, Tolerance
from tdiff.errors import DumpError, TdiffError
from tdiff.launch import CaptureConfig, failure, run_command
from tdiff.source_patcher.bootstrap import child_config, read_applied_log
from tdiff.source_patcher.spec import Candidate
from tdiff.store.reader import Dump, open_dump

MATCH, DIVERGED, ERROR = "match", "diverged", "error"
CONTROL = "control"


@dataclass
class TrialDivergence:
    """A run's first tensor that differs from the baseline."""

    name: str
    module: str
    role: str
    step: int
    call: int
    rank: int
    status: str
    kind: str
    position: int                        # index in execution order
    reason: str | None = None            # why it differs, where figures cannot say (a shape mismatch)

    def to_json(self) -> dict:
        return {"name": self.name, "module": self.module, "role": self.role, "step": self.step,
                "call": self.call, "rank": self.rank, "status": self.status, "kind": self.kind,
                "position": self.position, "reason": self.reason}

    @classmethod
    def from_json(cls, data: dict) -> TrialDivergence:
        return cls(name=data["name"], module=data["module"], role=data["role"], step=data["step"],
                   call=data["call"], rank=data["rank"], status=data["status"], kind=data["kind"],
                   position=data["position"], reason=data.get("reason"))   # absent before 0.1.1


@dataclass
class TrialResult:
    """One run of command B: the control or one candidate."""

    name: str
    patches: list[str]
    status: str                          # "match" | "diverged" | "error"
    dump: str
    log: str
    applied: list[str] = field(default_factory=list)   # patches that took effect in some process
    first_divergence: TrialDivergence | None = None
    position: int | None = None          # index of the first divergence in execution order
    moved_by: int | None = None          # position minus the control's (later is positive)
    mismatched: int | None = None        # tensors that differ from the baseline
    max_ulp: int | None = None           # raw, over the tensors that differ
    max_ulp_at_scale: float | None = None   # what ranks and shows (tdiff.compare.metrics)
    reason: str | None = None            # why the run failed

    def to_json(self) -> dict:
        first = self.first_divergence
        return {"name": self.name, "status": self.status, "first_divergence": first.to_json() if first else None,
                "moved_by": self.moved_by, "mismatched": self.mismatched, "max_ulp": self.max_ulp,
                "max_ulp_at_scale": self.max_ulp_at_scale,
                "position": self.position, "patches": self.patches, "applied": self.applied,
                "dump": self.dump, "log": self.log, "reason": self.reason}

    @classmethod
    def from_json(cls, data: dict) -> TrialResult:
        first = data["first_divergence"]
        return cls(name=data["name"], patches=data["patches"], status=data["status"], dump=data["dump"],
                   log=data["log"], applied=data["applied"],
                   first_divergence=TrialDivergence.from_json(first) if first is not None else None,
                   position=data["position"], moved_by=data["moved_by"], mismatched=data["mismatched"],
                   max_ulp=data["max_ulp"], max_ulp_at_scale=data.get("max_ulp_at_scale"), reason=data["reason"])


@dataclass
class TrialReport:
    baseline: str
    command: list[str]
    workdir: str
    tolerance: str
    control: TrialResult
    candidates: list[TrialResult]        # ranked, best first

    @property
    def best(self) -> TrialResult | None:
        return next((c for c in self.candidates if c.status != ERROR), None)

    @property
    def matched(self) -> bool:
        return any(c.status == MATCH for c in self.candidates)

    def to_json(self) -> dict:
        best = self.best
        return {"baseline": self.baseline, "command": self.command, "workdir": self.workdir,
                "tolerance": self.tolerance, "control": self.control.to_json(),
                "candidates": [c.to_json() for c in self.candidates],
                "best": best.name if best else None}

    @classmethod
    def from_json(cls, data: dict) -> TrialReport:
        """The report of its JSON (``best`` follows from the ranked candidates)."""
        return cls(baseline=data["baseline"], command=data["command"], workdir=data["workdir"],
                   tolerance=data["tolerance"], control=TrialResult.from_json(data["control"]),
                   candidates=[TrialResult.from_json(c) for c in data["candidates"]])


def try_candidates(candidates: list[Candidate], baseline: str | Path, command: list[str], *,
                   workdir: str | Path | None = None, tolerance: Tolerance = EXACT,
                   selection: CaptureOptions = DEFAULTS, baseline_command: list[str] | None = None,
                   allow_unaligned: bool = False,
                   progress: Callable[[TrialResult, int, int], None] | None = None, jobs: int = 1) -> TrialReport:
    """Run ``command`` unpatched and under each candidate; compare every run with ``baseline``.

    With ``baseline_command``, side A is captured again under each candidate too, and each
    candidate's run of B is compared with that: for fixes both sides must share (batch
    invariance: the same op overrides on the lone sequence and on the batch). The control still
    compares with ``baseline``. A run aligned by token that matches while rows of tokens both runs
    fed were left uncompared is an error, unless ``allow_unaligned`` (then its reason notes it).
    ``jobs``: pairs of tensors compared at once (compare_dumps). ``selection``: the runs' capture
    options; their mode and format are the baseline's, their ``batch_row`` applies to the runs of
    ``command`` only (one sequence of its batch).
    """
    if not candidates:
        raise TdiffError("no candidates to try")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise TdiffError(f"candidate {next(n for n in names if names.count(n) > 1)!r} is listed twice")
    base = open_dump(baseline)
    work = _workdir(workdir)
    runner = _Runner(base, list(command), work, tolerance, selection,
                     list(baseline_command) if baseline_command else None, allow_unaligned, jobs)
    total = len(candidates) + 1
    control = runner.run(0, CONTROL, [])
    if progress is not None:
        progress(control, 1, total)
    if control.status == ERROR:
        raise TdiffError(f"the unpatched control run failed: {control.reason}; its log: {control.log}")
    results = []
    for index, candidate in enumerate(candidates, 1):
        result = runner.run(index, candidate.name, list(candidate.patches))
        if result.position is not None and control.position is not None:
            result.moved_by = result.position - control.position
        results.append(result)
        if progress is not None:
            progress(result, index + 1, total)
    results.sort(key=_rank)
    return TrialReport(baseline=str(baseline), command=list(command), workdir=str(work),
                       tolerance=tolerance.describe(), control=control, candidates=results)


def _rank(result: TrialResult) -> tuple:
    """Match first, then the latest first divergence, fewer mismatches, smaller ULP at scale (raw
    ULP would let one sign flip near zero outweigh a tensor off by many steps); among equals the
    candidate with fewer patches (the smaller fix) first."""
    if result.status == MATCH:
        return (0, len(result.patches))
    if result.status == ERROR:
        return (2, len(result.patches))
    ulp = result.max_ulp_at_scale if result.max_ulp_at_scale is not None else math.inf
    assert result.position is not None, "_measure sets it with every divergence"
    return (1, -result.position, result.mismatched, ulp, len(result.patches))


def _workdir(workdir: str | Path | None) -> Path:
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix="tdiff-try-", dir="."))
    path = Path(workdir)
    if path.exists() and any(path.iterdir()):
        raise TdiffError(f"{path} is not empty; give a new --workdir")
    path.mkdir(parents=True, exist_ok=True)
    return path


class _Runner:
    def __init__(self, baseline: Dump, command: list[str], workdir: Path, tolerance: Tolerance,
                 selection: CaptureOptions, baseline_command: list[str] | None, allow_unaligned: bool,
                 jobs: int):
        self.baseline, self.command, self.workdir, self.jobs = baseline, command, workdir, jobs
        self.tolerance, self.selection, self.baseline_command = tolerance, selection, baseline_command
        self.allow_unaligned = allow_unaligned

    def run(self, index: int, name: str, patches: list) -> TrialResult:
        stem = f"{index:02d}-{re.sub(r'[^A-Za-z0-9._+-]', '_', name)}"
        out, log = self.workdir / stem, self.workdir / f"{stem}.log"
        applied_log = self.workdir / f"{stem}.applied.jsonl"
        baseline = self.baseline
        patches_config = child_config(patches, applied_log=str(applied_log.resolve()))
        result = TrialResult(name=name, patches=[p.name for p in patches], status=ERROR, dump=str(out),
                             log=str(log))
        if self.baseline_command is not None and patches:
            baseline_out = self.workdir / f"{stem}.baseline"
            returncode = self._capture(self.baseline_command, baseline_out, f"{name} (A)", patches_config,
                                       self.workdir / f"{stem}.baseline.log", batch_row=None)
            if returncode != 0:
                result.reason = "side A: " + failure(returncode, self.workdir / f"{stem}.baseline.log")
                return result
            baseline = open_dump(baseline_out)
        returncode = self._capture(self.command, out, name, patches_config, log,
                                   batch_row=self.selection.batch_row)
        result.applied = sorted({e["patch"] for e in read_applied_log(str(applied_log))})
        if returncode != 0:
            result.reason = failure(returncode, log)
            return result
        try:
            dump = open_dump(out)
            report = compare_dumps(baseline, dump, CompareOptions(tolerance=self.tolerance),
                                   pairing=choose_pairing(baseline, dump), jobs=self.jobs)
        except DumpError as exc:
            result.reason = str(exc)
            return result
        try:
            notes = unaligned_notes(report.alignment, diverged=report.status != "match",
                                    allow_unaligned=self.allow_unaligned)
        except TdiffError as exc:   # a match that compared less than both runs fed
            result.reason = str(exc)
            return result
        _measure(result, report)
        result.reason = result.reason or (notes[0] if notes else None)
        return result

    def _capture(self, command: list[str], out: Path, side: str, patches: dict, log: Path, *,
                 batch_row: int | None) -> int:
        info = self.baseline.info
        options = replace(self.selection, side=side, mode=info.get("mode", "full"),
                          storage=info.get("storage", "safetensors"), batch_row=batch_row)
        config = CaptureConfig(out=out, options=options)
        return run_command(command, capture=config, patches=patches, log=log)


def _measure(result: TrialResult, report: CompareReport) -> None:
    diverged = [c for c in report.comparisons if c.diverged]
    result.mismatched = len(diverged)
    measured = [c.metrics for c in diverged if c.metrics is not None]
    result.max_ulp = max((m.max_ulp for m in measured if m.max_ulp is not None), default=None)
    result.max_ulp_at_scale = max((m.max_ulp_at_scale for m in measured if m.max_ulp_at_scale is not None),
                                  default=None)
    first = report.first_divergence
    if first is None:
        result.status = MATCH
        return
    result.status = DIVERGED
    result.position = report.comparisons.index(first)
    record = first.record
    result.first_divergence = TrialDivergence(name=first.name, module=record.module, role=record.role,
                                              step=record.step, call=record.call, rank=record.rank,
                                              status=first.status, kind=first.boundary_kind,
                                              position=result.position, reason=first.reason)
