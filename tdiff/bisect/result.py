"""What bisect found, and its JSON form.

    {"status": "diverged",
     "first_divergence": {"name": "model.layers.1.post_attention_layernorm",
                          "module": "model.layers.1.post_attention_layernorm", "module_b": "...",
                          "layer": 1, "kind": "norm", "step": 0, "event": "output",
                          "introduced": true,
                          "metrics": {"max_abs": 0.0156, "max_ulp": 1, "max_ulp_at_scale": 0.5,
                                      "mismatch_fraction": 0.39, "cosine": 0.99999},
                          "description": "...", "call": 0, "rank": 0, "reason": null,
                          "token": null},
     "checked": 75,
     "trail": [{"name": "model.layers.1", "module": "model.layers.1", ...}, ...]}

``status`` is "match" or "diverged"; ``first_divergence`` is null on a match. ``event`` is
"output" (the module's inputs match, its output does not, nothing recorded inside it differs),
"between" (the code of ``module``'s own forward between two recorded events), or "input" (the
first differing event is an input whose producer was not recorded: ``introduced`` is false).
Online runs add ``runs``, ``--graft`` adds ``graft``, repeats add ``repeats``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tdiff.compare.engine import Comparison
from tdiff.compare.metrics import json_number
from tdiff.vocab.paths import layer_of

if TYPE_CHECKING:  # for annotations only: graft and repeats import this module
    from tdiff.bisect.graft import GraftVerdict
    from tdiff.bisect.repeats import RepeatsSection
    from tdiff.bisect.runs import RunLog
    from tdiff.source_patcher.trial import TrialReport


def metrics_json(comparison: Comparison | None) -> dict:
    m = comparison.metrics if comparison is not None else None
    if m is None:
        return {"max_abs": None, "max_ulp": None, "max_ulp_at_scale": None, "mismatch_fraction": None,
                "outside_fraction": None, "cosine": None}
    return {"max_abs": json_number(m.max_abs), "max_ulp": m.max_ulp,
            "max_ulp_at_scale": json_number(m.max_ulp_at_scale),
            "mismatch_fraction": json_number(m.mismatch_fraction),
            "outside_fraction": json_number(m.outside_fraction), "cosine": json_number(m.cosine)}


@dataclass
class Divergence:
    """Where the divergence is introduced, and the first tensor that shows it."""

    name: str                   # the first differing tensor
    module: str | None          # the module (event "output"/"input") or forward ("between"), side A
    module_b: str | None
    kind: str
    event: str
    introduced: bool
    comparison: Comparison      # the verdict on the first differing tensor
    description: str
    module_call: int | None = None  # call index of ``module`` (for graft), when recorded
    before: str | None = None       # module of the event before a "between" (for capture regions)

    @property
    def layer(self) -> int | None:
        """The decoder layer of ``module``'s call. A module shared by layers (SGLang's one
        rotary_emb) is named after its first owner: its call belongs to the layer that made it,
        which its own records (or, inside it, its children's) say."""
        if not self.module:
            return None
        record = self.comparison.record
        if record.role != "explicit" and record.module == self.module:
            return self.comparison.layer
        if record.layer is not None and record.module.startswith(self.module + "."):
            return record.layer     # a child of a call that was attributed to its caller's layer
        return layer_of(self.module)

    @property
    def step(self) -> int:
        return self.comparison.record.step

    def to_json(self) -> dict:
        record = self.comparison.record
        return {"name": self.name, "module": self.module, "module_b": self.module_b,
                "layer": self.layer, "kind": self.kind, "step": record.step, "event": self.event,
                "introduced": self.introduced, "metrics": metrics_json(self.comparison),
                "description": self.description, "call": record.call, "rank": record.rank,
                "reason": self.comparison.reason, "token": self.token}

    @property
    def token(self) -> dict | None:
        """The first differing token {seq_a, seq_b, position, step_a, step_b}; None when the pair
        is not aligned by token."""
        tokens = self.comparison.tokens
        first = tokens.first_differing if tokens is not None else None
        return first.to_json() if first is not None else None


@dataclass
class TrailEntry:
    """An enclosing module whose output diverged too."""

    module: str
    module_b: str | None
    kind: str
    comparison: Comparison

    def to_json(self) -> dict:
        return {"name": self.comparison.name, "module": self.module, "module_b": self.module_b,
                "layer": self.comparison.layer, "kind": self.kind,
                "metrics": metrics_json(self.comparison)}


@dataclass
class BisectResult:
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
    missing: int = 0                # tensors an incomplete dump lacks on one side (not compared; in notes)

    @property
    def status(self) -> str:
        # tensors missing on one side differ, as compare counts them, though no op can be named
        return "match" if self.first_divergence is None and not self.missing else "diverged"

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
