"""What bisect found, and its JSON form.

    {"status": "diverged",
     "first_divergence": {"name": "model.layers.1.post_attention_layernorm",
                          "module": "model.layers.1.post_attention_layernorm", "module_b": "...",
                          "layer": 1, "kind": "norm", "step": 0, "event": "output",
                          "introduced": true,
                          "metrics": {"max_abs": 0.0156, "max_ulp": 1, "max_ulp_at_scale": 0.5,
                                      "mismatch_fraction": 0.39, "cosine": 0.99999},
                          "description": "...", "call": 0, "rank": 0, "reason": null,
                          "token": null, "op": null},
     "checked": 75,
     "trail": [{"name": "model.layers.1", "module": "model.layers.1", ...}, ...]}

``status`` is "match" or "diverged"; ``first_divergence`` is null on a match. ``event`` is
"output" (the module's inputs match, its output does not, nothing recorded inside it differs),
"between" (the code of ``module``'s own forward between two recorded events), or "input" (the
first differing event is an input whose producer was not recorded: ``introduced`` is false).
Online runs add ``runs``, ``--graft`` adds ``graft``, repeats add ``repeats``, ``--try`` adds ``trials``.

The result holds what its JSON holds, so ``BisectResult.from_json(r.to_json()) == r``; what the
bisection that made it still needs (the first differing tensor's records, for the region to capture
and the console's full description) rides along outside that equality, and is None once read back.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from tdiff.bisect.runs import RunLog
from tdiff.compare.engine import Comparison
from tdiff.compare.metrics import json_number
from tdiff.source_patcher.trial import TrialReport
from tdiff.vocab.paths import ROOT_LABEL, layer_of


@dataclass
class Metrics:
    """A tensor's metrics as the JSON carries them: NaN as None, infinities as "inf"/"-inf"; all
    None where only fingerprints were compared."""

    max_abs: float | str | None = None
    max_ulp: int | None = None
    max_ulp_at_scale: float | str | None = None
    mismatch_fraction: float | str | None = None
    outside_fraction: float | str | None = None
    cosine: float | str | None = None

    @classmethod
    def of(cls, comparison: Comparison | None) -> Metrics:
        m = comparison.metrics if comparison is not None else None
        if m is None:
            return cls()
        return cls(max_abs=json_number(m.max_abs), max_ulp=m.max_ulp,
                   max_ulp_at_scale=json_number(m.max_ulp_at_scale),
                   mismatch_fraction=json_number(m.mismatch_fraction),
                   outside_fraction=json_number(m.outside_fraction), cosine=json_number(m.cosine))

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict) -> Metrics:
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def _fields_to_json(result: Any) -> dict:
    """The compared fields of a result dataclass, in order, nested results as their JSON."""
    return {f.name: _to_json(getattr(result, f.name)) for f in fields(result) if f.compare}


def _to_json(value: Any) -> Any:
    return value.to_json() if hasattr(value, "to_json") else value


def _fields_from_json(cls: Any, data: dict, **nested: Any) -> dict:
    """Constructor arguments of ``cls`` read from its JSON: a field with a default (an optional one,
    added later) reads as its default when the JSON lacks it; ``nested`` holds those already read."""
    values = {}
    for f in fields(cls):
        if not f.compare:
            continue
        if f.name in nested:
            values[f.name] = nested[f.name]
        elif f.name in data or (f.default is MISSING and f.default_factory is MISSING):
            values[f.name] = data[f.name]  # a required field the JSON lacks: KeyError
    return values


@dataclass
class Divergence:
    """Where the divergence is introduced, and the first tensor that shows it.

    New optional facts about it are fields with a default of None: they are written as null and
    read back as None from JSON that lacks them."""

    name: str                   # the first differing tensor
    module: str | None          # the module (event "output"/"input") or forward ("between"), side A
    module_b: str | None
    layer: int | None           # the decoder layer of ``module``'s call (see ``found``)
    kind: str
    step: int
    event: str
    introduced: bool
    metrics: Metrics            # those of the first differing tensor
    description: str
    call: int                   # the first differing tensor's
    rank: int
    reason: str | None          # why its comparison has no metrics (one side only, fingerprints...)
    # the first differing token {seq_a, seq_b, position, step_a, step_b}; None unless aligned by token
    token: dict | None = None
    op: OpDivergence | None = None  # the op inside the culprit's call, from op records (tdiff.bisect.ops)
    # the culprit module's inputs bisect did not compare, "<names> (<why>); ..." (event "output")
    not_compared: str | None = None
    cause: Cause | None = None      # which side is right: the exact-reference replay (tdiff.bisect.cause)
    swap: Swap | None = None        # each side's op on the other side's inputs (tdiff.bisect.swap)
    # the bisection's working state, not part of the result:
    first: Comparison | None = field(default=None, compare=False, repr=False)  # the verdict on ``name``
    module_call: int | None = field(default=None, compare=False)  # call index of ``module`` (for graft)
    before: str | None = field(default=None, compare=False)  # module of the event before a "between"

    @classmethod
    def found(cls, *, name: str, module: str | None, module_b: str | None, kind: str, event: str,
              introduced: bool, comparison: Comparison, description: str, module_call: int | None = None,
              before: str | None = None) -> Divergence:
        record = comparison.record
        return cls(name=name, module=module, module_b=module_b, layer=_layer(module, comparison), kind=kind,
                   step=record.step, event=event, introduced=introduced, metrics=Metrics.of(comparison),
                   description=description, call=record.call, rank=record.rank, reason=comparison.reason,
                   token=_first_token(comparison), first=comparison, module_call=module_call, before=before)

    def to_json(self) -> dict:
        return _fields_to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> Divergence:
        op = OpDivergence.from_json(data["op"]) if data.get("op") is not None else None
        cause = Cause.from_json(data["cause"]) if data.get("cause") is not None else None
        swap = Swap.from_json(data["swap"]) if data.get("swap") is not None else None
        return cls(**_fields_from_json(cls, data, metrics=Metrics.from_json(data["metrics"]), op=op, cause=cause,
                                       swap=swap))


@dataclass
class SwapRun:
    """Side ``side``'s implementation of the culprit (its module rebuilt from the dump, class
    ``module_class``) run on side ``on``'s recorded inputs: whether it gives its own side's output
    bitwise (``equals_own``) and the other side's (``equals_other``); ``problem`` says why it did
    not run (then both are None)."""

    side: str
    on: str
    module_class: str | None
    equals_own: bool | None
    equals_other: bool | None
    problem: str | None

    @classmethod
    def failed(cls, side: str, on: str, problem: str, module_class: str | None = None) -> SwapRun:
        return cls(side=side.lower(), on=on.lower(), module_class=module_class, equals_own=None, equals_other=None,
                   problem=problem)

    def describe(self) -> str:
        side, on = self.side.upper(), self.on.upper()
        name = self.module_class.rpartition(":")[2] if self.module_class else "op"
        ran = f"side {side}'s {name} on side {on}'s inputs"
        if self.problem is not None:
            return f"{ran}: not run, {self.problem}"
        if self.equals_other:
            return f"{ran} gives side {on}'s output bitwise: the same kernel, the inputs make the difference"
        if self.equals_own:
            return f"{ran} gives side {side}'s own output bitwise: the op itself differs, not its inputs"
        return f"{ran} gives neither side's output: the op and the inputs both differ"

    def to_json(self) -> dict:
        return {**_fields_to_json(self), "description": self.describe()}

    @classmethod
    def from_json(cls, data: dict) -> SwapRun:
        return cls(**_fields_from_json(cls, data))


@dataclass
class Swap:
    """The cross-framework op swap of the culprit (tdiff.bisect.swap): ``b_on_a`` is side B's op
    on side A's inputs, ``a_on_b`` the reverse."""

    b_on_a: SwapRun
    a_on_b: SwapRun

    def lines(self) -> list[str]:
        return [f"swap: {self.b_on_a.describe()}", f"swap: {self.a_on_b.describe()}"]

    def to_json(self) -> dict:
        return {"b_on_a": self.b_on_a.to_json(), "a_on_b": self.a_on_b.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> Swap:
        return cls(b_on_a=SwapRun.from_json(data["b_on_a"]), a_on_b=SwapRun.from_json(data["a_on_b"]))


@dataclass
class Cause:
    """Which side is right (tdiff.bisect.cause): the culprit's canonical ``op`` replayed in float64
    (``reference``) on each side's own inputs, parameters and settings; each side's distance from
    it (``ulp_a``/``ulp_b``: ULPs of the output's dtype at the tensor's scale; ``equal_a``/``equal_b``:
    the share of elements equal to the exact result correctly rounded); the class (``rounding``,
    ``precision``, ``logic``, ``inherited``, ``unknown``) and the ``side`` it names ("a", "b" or
    None); ``differing``: the settings or parameters that differ (``eps 1e-06 vs 0.1``)."""

    cause_class: str
    side: str | None
    description: str
    op: str | None = None
    ulp_a: float | str | None = None
    ulp_b: float | str | None = None
    equal_a: float | None = None
    equal_b: float | None = None
    differing: list[str] = field(default_factory=list)
    reference: str = "float64"

    @classmethod
    def found(cls, cause_class: str, side: str | None, *, description: str, ulp_a: float | None = None,
              ulp_b: float | None = None, **facts: Any) -> Cause:
        return cls(cause_class, side, description, ulp_a=json_number(ulp_a), ulp_b=json_number(ulp_b), **facts)

    def line(self) -> str:
        """The one line the reports give it: ``cause: precision (side B): side A equals ...``."""
        side = f" (side {self.side.upper()})" if self.side else ""
        return f"cause: {self.cause_class}{side}: {self.description}"

    def to_json(self) -> dict:
        return {"class": self.cause_class, "side": self.side, "ulp_a": self.ulp_a, "ulp_b": self.ulp_b,
                "reference": self.reference, "op": self.op, "equal_a": self.equal_a, "equal_b": self.equal_b,
                "differing": self.differing, "description": self.description}

    @classmethod
    def from_json(cls, data: dict) -> Cause:
        return cls(cause_class=data["class"], side=data["side"], description=data["description"], op=data["op"],
                   ulp_a=data["ulp_a"], ulp_b=data["ulp_b"], equal_a=data["equal_a"], equal_b=data["equal_b"],
                   differing=data["differing"], reference=data["reference"])


@dataclass
class OpDivergence:
    """The op of the culprit's call where the two runs part (tdiff.bisect.ops): side A's op
    (``name`` ``aten::mul.Tensor``, its ``index`` in the call, the ``function`` and ``source``
    file:line that ran it) and side B's (``_b``); a side whose ops ended first has None.
    ``parted``: the op sequences part there; else the op's inputs match and its output differs."""

    name: str | None
    index: int | None
    function: str | None
    source: str | None
    name_b: str | None
    index_b: int | None
    function_b: str | None
    source_b: str | None
    parted: bool
    # the op's inputs no record held, "<names> (<why>)"; None when every input was compared
    not_compared: str | None = None

    def describe(self) -> str:
        side_a = _describe_op(self.name, self.index, self.function, self.source)
        if not self.parted:
            return f"op {side_a}: {inputs_verdict(self.not_compared)}"
        side_b = _describe_op(self.name_b, self.index_b, self.function_b, self.source_b)
        return f"the op sequences part at op {side_a} on side A and op {side_b} on side B"

    def to_json(self) -> dict:
        return _fields_to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> OpDivergence:
        return cls(**_fields_from_json(cls, data))


def inputs_verdict(not_compared: str | None, differing_state: str | None = None) -> str:
    """What bisect says of a culprit whose output differs: "its inputs match" only when every
    input was compared and equal; parameters or buffers both runs stored (--params) that differ
    are said first."""
    if differing_state is not None:
        said = f"its parameters differ between the runs: {differing_state} (their fingerprints, stored by --params)"
        if not_compared is None:
            return f"{said}; its other inputs match; its output differs"
        return f"{said}; not compared: {not_compared}; its output differs"
    if not_compared is None:
        return "its inputs match, its output differs"
    return f"its compared inputs match; not compared: {not_compared}; its output differs"


def _describe_op(name: str | None, index: int | None, function: str | None, source: str | None) -> str:
    if name is None:
        return "(none: its ops ended)"
    return f"#{index} {name} in " + (f"{function} ({source})" if function else "an unknown caller")


def _first_token(comparison: Comparison) -> dict | None:
    tokens = comparison.tokens
    first = tokens.first_differing if tokens is not None else None
    return first.to_json() if first is not None else None


def _layer(module: str | None, comparison: Comparison) -> int | None:
    """The decoder layer of ``module``'s call. A module shared by layers (SGLang's one rotary_emb)
    is named after its first owner: its call belongs to the layer that made it, which its own
    records (or, inside it, its children's) say."""
    if not module:
        return None
    record = comparison.record
    if record.role != "explicit" and record.module == module:
        return comparison.layer
    if record.layer is not None and record.module.startswith(module + "."):
        return record.layer     # a child of a call that was attributed to its caller's layer
    return layer_of(module)


@dataclass
class TrailEntry:
    """An enclosing module whose output diverged too."""

    name: str
    module: str
    module_b: str | None
    layer: int | None
    kind: str
    metrics: Metrics

    @classmethod
    def found(cls, *, module: str, module_b: str | None, kind: str, comparison: Comparison) -> TrailEntry:
        return cls(name=comparison.name, module=module, module_b=module_b, layer=comparison.layer, kind=kind,
                   metrics=Metrics.of(comparison))

    def to_json(self) -> dict:
        return _fields_to_json(self)

    @classmethod
    def from_json(cls, data: dict) -> TrailEntry:
        return cls(**_fields_from_json(cls, data, metrics=Metrics.from_json(data["metrics"])))


@dataclass
class GraftVerdict:
    module: str
    module_b: str
    step: int
    call: int
    verdict: str
    metrics: Metrics            # of B's grafted output against A's output
    run: str

    @property
    def description(self) -> str:
        if self.verdict == "op_differs":
            return f"`{self.module or ROOT_LABEL}` differs on identical inputs: the op itself differs"
        return (f"`{self.module or ROOT_LABEL}` matches on side A's inputs: only its inputs differed, "
                "it did not introduce the divergence")

    def to_json(self) -> dict:
        return {"module": self.module, "module_b": self.module_b, "step": self.step, "call": self.call,
                "verdict": self.verdict, "description": self.description,
                "metrics": self.metrics.to_json(), "run": self.run}

    @classmethod
    def from_json(cls, data: dict) -> GraftVerdict:
        return cls(module=data["module"], module_b=data["module_b"], step=data["step"], call=data["call"],
                   verdict=data["verdict"], metrics=Metrics.from_json(data["metrics"]), run=data["run"])


@dataclass
class RepeatsSection:
    runs: list[str]
    reference: str
    differing: list[str]

    def to_json(self) -> dict:
        return {"runs": self.runs, "reference": self.reference, "differing": self.differing}

    @classmethod
    def from_json(cls, data: dict) -> RepeatsSection:
        return cls(runs=data["runs"], reference=data["reference"], differing=data["differing"])


@dataclass
class BisectResult:
    # "diverged" with a first divergence, or without one when tensors are missing on one side
    # (they differ, as compare counts them, though no op can be named: the notes say how many)
    status: str
    first_divergence: Divergence | None
    checked: int
    trail: list[TrailEntry] = field(default_factory=list)
    tolerance: str = "bitwise"
    sides: dict = field(default_factory=dict)       # {"a": path, "b": path}
    notes: list[str] = field(default_factory=list)  # what the reader should know (incomplete dumps)
    runs: RunLog | None = None
    graft: GraftVerdict | None = None
    repeats: RepeatsSection | None = None
    trials: TrialReport | None = None  # `--try`: candidate fixes for the culprit (tdiff.source_patcher)

    @property
    def exit_code(self) -> int:
        return 0 if self.status == "match" else 1

    def to_json(self) -> dict:
        out = {"status": self.status,
               "first_divergence": self.first_divergence.to_json() if self.first_divergence else None,
               "checked": self.checked, "trail": [t.to_json() for t in self.trail],
               "tolerance": self.tolerance, "sides": self.sides, "notes": self.notes}
        for key in ("runs", "graft", "repeats", "trials"):
            section = getattr(self, key)
            if section is not None:
                out[key] = section.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict) -> BisectResult:
        first = data["first_divergence"]

        def section(key, kind):
            return kind.from_json(data[key]) if key in data else None

        return cls(status=data["status"], first_divergence=Divergence.from_json(first) if first else None,
                   checked=data["checked"], trail=[TrailEntry.from_json(t) for t in data["trail"]],
                   tolerance=data["tolerance"], sides=data["sides"], notes=data["notes"],
                   runs=section("runs", RunLog), graft=section("graft", GraftVerdict),
                   repeats=section("repeats", RepeatsSection), trials=section("trials", TrialReport))
