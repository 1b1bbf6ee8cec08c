"""What `tdiff compare` found, as its JSON holds it, and that JSON read back.

    {"status": "diverged",
     "a": {"path": "runs/a", "side": "reference", "problems": [], "notes": []}, "b": {...},
     "tolerance": "bitwise",
     "summary": {"compared": 143, "match": 99, "mismatch": 44, "only_a": 0, "only_b": 0,
                 "shape_mismatch": 0, "dtype_mismatch": 0},
     "left_out": 0, "same_dump": false,
     "first_divergence": {...one of tensors...},
     "tensors": [{"name": ..., "status": ..., "metrics": {...}, "plan": {...}, "tokens": {...}}, ...],
     "alignment": {...}}   # only where a cross-framework pairing aligned the dumps

A token alignment's ``alignment.parted`` (sequences the runs sampled differently) is a divergence too.

``status``, ``summary`` and ``first_divergence`` follow from ``tensors``; reading JSON whose copies of
them disagree with its tensors is refused. ``alignment`` stays the pairing's own JSON (a boundary or a
token alignment), held as written. ``CompareResult.from_json(r.to_json()) == r``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tdiff.compare.metrics import ReportedMetrics
from tdiff.compare.tokens import TokenVerdict
from tdiff.store.record import MAIN_THREAD
from tdiff.errors import TdiffError

DIVERGED_STATUSES = ("mismatch", "only_a", "only_b", "shape_mismatch", "dtype_mismatch")


def status_counts(statuses: Iterable[str]) -> dict[str, int]:
    """How many pairs got each verdict, in the order of ``summary``."""
    counts = {"compared": 0, "match": 0, **dict.fromkeys(DIVERGED_STATUSES, 0)}
    for status in statuses:
        counts["compared"] += 1
        counts[status] += 1
    return counts


@dataclass(frozen=True)
class TensorVerdict:
    """The verdict on one pair, as `tdiff compare --json` lists it under ``tensors``."""

    name: str
    status: str                         # "match" or one of DIVERGED_STATUSES
    role: str
    step: int
    call: int
    rank: int
    thread: str                         # the recording thread (tdiff.hooks.running names it)
    module: str | None                  # side A's module (None where only B has the tensor)
    module_b: str | None
    layer: int | None
    kind: str
    dtype_a: str | None
    dtype_b: str | None
    shape_a: list[int] | None
    shape_b: list[int] | None
    reason: str | None = None
    metrics: ReportedMetrics | None = None
    plan_a: list[str] = field(default_factory=list)
    plan_b: list[str] = field(default_factory=list)
    tokens: TokenVerdict | None = None

    @property
    def diverged(self) -> bool:
        return self.status != "match"

    def to_json(self) -> dict:
        out: dict = {"name": self.name, "status": self.status, "role": self.role, "step": self.step,
                     "call": self.call, "rank": self.rank, "thread": self.thread, "module": self.module, "module_b": self.module_b,
                     "layer": self.layer, "kind": self.kind, "dtype_a": self.dtype_a, "dtype_b": self.dtype_b,
                     "shape_a": self.shape_a, "shape_b": self.shape_b}
        if self.reason:
            out["reason"] = self.reason
        if self.metrics is not None:
            out["metrics"] = self.metrics.to_json()
        if self.plan_a or self.plan_b:
            out["plan"] = {"a": self.plan_a, "b": self.plan_b}
        if self.tokens is not None:
            out["tokens"] = self.tokens.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict) -> TensorVerdict:
        if data["status"] != "match" and data["status"] not in DIVERGED_STATUSES:
            raise ValueError(f"{data['name']}: unknown status {data['status']!r}")
        plan = data.get("plan", {"a": [], "b": []})
        return cls(name=data["name"], status=data["status"], role=data["role"], step=data["step"],
                   call=data["call"], rank=data["rank"], thread=data.get("thread", MAIN_THREAD), module=data["module"], module_b=data["module_b"],
                   layer=data["layer"], kind=data["kind"], dtype_a=data["dtype_a"], dtype_b=data["dtype_b"],
                   shape_a=data["shape_a"], shape_b=data["shape_b"], reason=data.get("reason"),
                   metrics=ReportedMetrics.from_json(data["metrics"]) if "metrics" in data else None,
                   plan_a=plan["a"], plan_b=plan["b"],
                   tokens=TokenVerdict.from_json(data["tokens"]) if "tokens" in data else None)


@dataclass(frozen=True)
class DumpSide:
    """One compared dump: its directory, label, what is wrong with it and what capture noted."""

    path: str
    side: str
    problems: list[str]
    notes: list[str]

    def to_json(self) -> dict:
        return {"path": self.path, "side": self.side, "problems": self.problems, "notes": self.notes}

    @classmethod
    def from_json(cls, data: dict) -> DumpSide:
        return cls(path=data["path"], side=data["side"], problems=data["problems"], notes=data["notes"])


@dataclass(frozen=True)
class CompareResult:
    """The JSON of `tdiff compare --json` as an object (see the module's docstring)."""

    a: DumpSide
    b: DumpSide
    tolerance: str                      # Tolerance.describe(): "bitwise" or "atol=... rtol=..."
    left_out: int                       # pairs that --layers/--select/--exclude left out
    same_dump: bool
    tensors: list[TensorVerdict]
    alignment: dict | None = None       # the cross-framework pairing's alignment, as it wrote it

    @property
    def status(self) -> str:
        parted = (self.alignment or {}).get("parted")
        return "diverged" if any(t.diverged for t in self.tensors) or parted else "match"

    @property
    def summary(self) -> dict[str, int]:
        return status_counts(t.status for t in self.tensors)

    @property
    def first_divergence(self) -> TensorVerdict | None:
        return next((t for t in self.tensors if t.diverged), None)

    def to_json(self) -> dict:
        first = self.first_divergence
        return {
            "status": self.status, "a": self.a.to_json(), "b": self.b.to_json(), "tolerance": self.tolerance,
            "summary": self.summary, "left_out": self.left_out, "same_dump": self.same_dump,
            "first_divergence": first.to_json() if first else None,
            "tensors": [t.to_json() for t in self.tensors],
            **({"alignment": self.alignment} if self.alignment is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> CompareResult:
        """The result of `tdiff compare --json`'s output; anything else raises TdiffError."""
        try:
            result = cls(a=DumpSide.from_json(data["a"]), b=DumpSide.from_json(data["b"]),
                         tolerance=data["tolerance"], left_out=data["left_out"], same_dump=data["same_dump"],
                         tensors=[TensorVerdict.from_json(t) for t in data["tensors"]],
                         alignment=data.get("alignment"))
            derived = result.to_json()
            disagree = [key for key in ("status", "summary", "first_divergence") if data[key] != derived[key]]
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise TdiffError("not the JSON of `tdiff compare --json` (expected an object with its dumps, "
                             f"tolerance and tensors; {type(exc).__name__}: {exc})") from None
        if disagree:
            raise TdiffError(f"the JSON of `tdiff compare --json` disagrees with its own tensors on {', '.join(disagree)}")
        return result
