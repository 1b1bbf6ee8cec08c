"""The report's model: typed records built from a :class:`CompareReport`, read by every renderer.

    >>> compare = compare_dumps(open_dump("dumps/a"), open_dump("dumps/b"))
    >>> report = build_report(compare)
    >>> report.culprit.boundary, [(row.layer, row.boundary) for row in report.boundaries][:2]
    ('post_attention_layernorm', [(None, 'model.embed_tokens'), (None, 'model.rotary_emb')])

Rows group tensors by op boundary within a decoder layer (:func:`boundary_of`). The culprit (the
first divergence) is reloaded from both dumps for its per-token error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tdiff.compare.engine import CompareReport, Comparison
from tdiff.compare.metrics import json_number
from tdiff.errors import TdiffError
from tdiff.report.console import summary_line
from tdiff.report.environment import Environment, environment_of
from tdiff.report.parity import ParityRow, token_parity, token_phase
from tdiff.report.tokens import TokenErrors, culprit_token_errors
from tdiff.vocab.boundaries import parse_layer_name
from tdiff.vocab.paths import ROOT_LABEL, layer_of

if TYPE_CHECKING:  # the results the report shows; `tdiff report` makes them
    from tdiff.bisect.result import BisectResult
    from tdiff.source_patcher.trial import TrialReport

LAYER_ITSELF = "(layer)"    # the boundary of a decoder layer's own inputs and outputs


def boundary_of(c: Comparison) -> tuple[int | None, str]:
    """(layer, boundary) of a comparison: the one place rows are grouped.

    A canonical name (set by cross-framework alignment as the pair's name, or as the record's
    ``attrs["canonical"]``) such as ``layers.3.q_proj`` wins; otherwise the module path relative
    to its decoder layer (``self_attn.q_proj``), the module path outside layers, or the name of
    an explicit dump.
    """
    record = c.record
    canonical = record.attrs.get("canonical") or (c.name if c.name != record.name else None)
    if canonical:
        in_layer = parse_layer_name(canonical)
        if in_layer:
            return in_layer[0], in_layer[1] or LAYER_ITSELF
        return None, canonical
    if record.role == "explicit":
        return None, record.name
    layer = c.layer
    if layer is None:
        return None, record.module or ROOT_LABEL
    return layer, _within_layer(record.module, layer)


def _within_layer(module: str, layer: int) -> str:
    """The module path after its (innermost) decoder layer: 'self_attn.q_proj'. A module shared
    by layers is named after its first owner (layer 0's path, called by layer 3): the path after
    that owner's layer."""
    parts = module.split(".")
    for owner in (layer, layer_of(module)):
        for i in range(len(parts) - 1, 0, -1):
            if parts[i] == str(owner) and layer_of(f"{parts[i - 1]}.{parts[i]}") == owner:
                return ".".join(parts[i + 1:]) or LAYER_ITSELF
    return module


@dataclass
class BoundaryRow:
    """The tensors of one boundary in one layer, aggregated. Outputs (and explicit dumps) are
    counted; inputs only where the boundary recorded no output."""

    layer: int | None
    boundary: str
    kind: str | None = None
    order: int = 0                  # execution position of its first counted tensor
    tensors: int = 0
    diverged: int = 0
    unmeasured: int = 0             # diverged tensors without element metrics (stats mode, one side only)
    numel: int = 0                  # elements measured
    mismatched: int = 0             # elements whose bits differ
    outside: int = 0                # elements outside the tolerance (= mismatched when bitwise)
    max_abs: float | None = None    # None: nothing measured
    max_ulp: int | None = None
    max_ulp_at_scale: float | None = None
    first: Comparison | None = None  # the boundary's first diverged tensor

    @property
    def mismatch_fraction(self) -> float | None:
        return self.mismatched / self.numel if self.numel else None

    @property
    def outside_fraction(self) -> float | None:
        return self.outside / self.numel if self.numel else None

    def add(self, c: Comparison) -> None:
        self.tensors += 1
        self.kind = self.kind or c.boundary_kind
        if c.diverged:
            self.diverged += 1
            self.first = self.first or c
        m = c.metrics
        if m is None:
            if c.diverged:
                self.unmeasured += 1
            else:  # equal fingerprints: every element matches
                self._measure(c.record.numel, 0, 0, 0.0, 0, 0.0)
            return
        self._measure(m.numel, m.mismatched, m.outside_tolerance, m.max_abs, m.max_ulp, m.max_ulp_at_scale)

    def _measure(self, numel: int, mismatched: int, outside: int, max_abs: float, max_ulp: int | None,
                 at_scale: float | None) -> None:
        self.numel += numel
        self.mismatched += mismatched
        self.outside += outside
        self.max_abs = max_abs if self.max_abs is None else max(self.max_abs, max_abs)
        if max_ulp is not None:
            self.max_ulp = max_ulp if self.max_ulp is None else max(self.max_ulp, max_ulp)
        if at_scale is not None:
            self.max_ulp_at_scale = at_scale if self.max_ulp_at_scale is None else max(self.max_ulp_at_scale,
                                                                                       at_scale)

    def severity(self) -> tuple:
        return (self.diverged > 0, self.max_ulp_at_scale or 0.0, self.max_abs or 0.0, self.outside)

    def to_json(self) -> dict:
        return {"layer": self.layer, "boundary": self.boundary, "kind": self.kind,
                "tensors": self.tensors, "diverged": self.diverged, "unmeasured": self.unmeasured,
                "numel": self.numel, "mismatched": self.mismatched,
                "mismatch_fraction": self.mismatch_fraction, "outside_tolerance": self.outside,
                "outside_fraction": self.outside_fraction, "max_abs": json_number(self.max_abs),
                "max_ulp": self.max_ulp, "max_ulp_at_scale": json_number(self.max_ulp_at_scale),
                "first_diverged": self.first.name if self.first else None}


@dataclass
class LayerRow:
    """One decoder layer (or the boundaries before or after the layers) in one line."""

    label: str                      # "0", "1", ... or "before layers" / "after layers"
    layer: int | None
    boundaries: list[BoundaryRow]

    @property
    def tensors(self) -> int:
        return sum(b.tensors for b in self.boundaries)

    @property
    def diverged(self) -> int:
        return sum(b.diverged for b in self.boundaries)

    @property
    def first_diverged(self) -> BoundaryRow | None:
        return next((b for b in self.boundaries if b.diverged), None)

    @property
    def output(self) -> BoundaryRow:
        """The layer's own output, else its last boundary in execution order."""
        own = [b for b in self.boundaries if b.boundary == LAYER_ITSELF]
        return own[0] if own else self.boundaries[-1]

    def to_json(self) -> dict:
        first = self.first_diverged
        return {"label": self.label, "layer": self.layer, "tensors": self.tensors,
                "diverged": self.diverged, "first_diverged_boundary": first.boundary if first else None,
                "output": self.output.to_json()}


@dataclass
class Culprit:
    """The first divergence, where it lies, and its error per token."""

    comparison: Comparison
    layer: int | None
    boundary: str
    tokens: TokenErrors | None
    tokens_note: str | None = None  # why there is no per-token error
    # aligned by token: the first differing token (TokenRef's keys) and how each run computed it
    # ("phase_a", "phase_b": prefill or decode)
    first_token: dict | None = None

    def to_json(self) -> dict:
        return {"tensor": self.comparison.to_json(), "layer": self.layer, "boundary": self.boundary,
                "tokens": self.tokens.to_json() if self.tokens else None, "tokens_note": self.tokens_note,
                "first_token": self.first_token}


@dataclass
class Report:
    side_a: str
    side_b: str
    tolerance: str
    status: str
    counts: dict
    summary: str
    comparisons: list[Comparison]
    boundaries: list[BoundaryRow]
    layers: list[LayerRow]
    culprit: Culprit | None
    environment: Environment
    problems: list[str] = field(default_factory=list)
    bisect: BisectResult | None = None
    patch_results: TrialReport | None = None
    same_dump: str | None = None      # the path, when A and B are the same dump
    left_out: int = 0                 # tensors --layers/--select/--exclude left out of the comparison
    token_parity: list[ParityRow] = field(default_factory=list)   # log-probs per sequence and rank

    @property
    def layer_numbers(self) -> list[int]:
        return sorted({b.layer for b in self.boundaries if b.layer is not None})

    def to_json(self) -> dict:
        return {"status": self.status, "a": self.side_a, "b": self.side_b, "tolerance": self.tolerance,
                "summary": self.counts, "summary_line": self.summary, "same_dump": self.same_dump is not None,
                "culprit": self.culprit.to_json() if self.culprit else None,
                "layers": [row.to_json() for row in self.layers],
                "boundaries": [row.to_json() for row in self.boundaries],
                "bisect": self.bisect.to_json() if self.bisect else None,
                "patch_results": self.patch_results.to_json() if self.patch_results else None,
                "environment": self.environment.to_json(), "problems": self.problems,
                "token_parity": [row.to_json() for row in self.token_parity],
                "diverged_tensors": [c.to_json() for c in self.comparisons if c.diverged]}


def build_report(compare: CompareReport, *, bisect: BisectResult | None = None,
                 patch_results: TrialReport | None = None, notes: list[str] | None = None) -> Report:
    """The report of one comparison. The culprit is reloaded through the pairing the comparison
    used (aligned tensors included) for its per-token error. ``notes``: what the verdict accepted
    without comparing (rows of tokens left uncompared under --allow-unaligned), listed as warnings."""
    boundaries = boundary_rows(compare.comparisons)
    first = compare.first_divergence
    token_aligned = any(c.tokens is not None for c in compare.comparisons)
    # the pairing made again, once, for the tensors' data (the culprit's, the log-probs')
    pairs = compare.pairing.pair(compare.a, compare.b) if first is not None or token_aligned else []
    culprit = None
    if first is not None:
        layer, boundary = boundary_of(first)
        tokens, note = culprit_token_errors(compare.a, compare.b, first, pairs, compare.options.tolerance)
        token = first.tokens.first_differing if first.tokens is not None else None
        first_token = None if token is None else {
            **token.to_json(), "phase_a": token_phase(compare.a, token.seq_a, token.step_a),
            "phase_b": token_phase(compare.b, token.seq_b, token.step_b)}
        culprit = Culprit(first, layer, boundary, tokens, note, first_token)
    parity = token_parity(compare.a, compare.b, pairs, compare.comparisons, compare.options.tolerance) \
        if token_aligned else []
    problems = [f"side {label} incomplete: {problem}"
                for label, dump in (("A", compare.a), ("B", compare.b)) for problem in dump.problems]
    problems += notes or []
    return Report(side_a=compare.a.side, side_b=compare.b.side,
                  tolerance=compare.options.tolerance.describe(), status=compare.status,
                  counts=compare.counts(), summary=summary_line(compare), comparisons=compare.comparisons,
                  boundaries=boundaries, layers=layer_rows(boundaries), culprit=culprit,
                  environment=environment_of(compare.a, compare.b), problems=problems,
                  bisect=bisect, patch_results=patch_results, token_parity=parity,
                  same_dump=str(compare.a.path) if compare.same_dump else None, left_out=compare.left_out)


def boundary_rows(comparisons: list[Comparison]) -> list[BoundaryRow]:
    """One row per (layer, boundary), in execution order of their first counted tensor (a module's
    output comes after its children's)."""
    keys = [boundary_of(c) for c in comparisons]
    with_output = {key for key, c in zip(keys, comparisons) if c.record.role != "input"}
    rows: dict[tuple, BoundaryRow] = {}
    for index, (key, c) in enumerate(zip(keys, comparisons)):
        if c.record.role != "input" or key not in with_output:
            if key not in rows:
                rows[key] = BoundaryRow(layer=key[0], boundary=key[1], order=index)
            rows[key].add(c)
    return list(rows.values())


def layer_rows(boundaries: list[BoundaryRow]) -> list[LayerRow]:
    """Decoder layers in order; boundaries outside them before the first and after the last."""
    layers = sorted({b.layer for b in boundaries if b.layer is not None})
    inside = {n: [b for b in boundaries if b.layer == n] for n in layers}
    first_order = min((b.order for b in boundaries if b.layer is not None), default=None)
    outside = [b for b in boundaries if b.layer is None]
    before = [b for b in outside if first_order is None or b.order < first_order]
    after = [b for b in outside if b not in before]
    rows = [LayerRow("before layers" if layers else "outside layers", None, before)] if before else []
    rows += [LayerRow(str(n), n, inside[n]) for n in layers]
    if after:
        rows.append(LayerRow("after layers", None, after))
    return rows


def read_patch_results(text: str, where: str) -> TrialReport:
    """The trials of ``tdiff patch try --json``, read back."""
    from tdiff.source_patcher.trial import TrialReport

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TdiffError(f"{where}: not JSON ({exc.msg} at line {exc.lineno}); "
                         "pass the output of `tdiff patch try --json`") from None
    except RecursionError:
        raise TdiffError(f"{where}: JSON nested too deeply; pass the output of `tdiff patch try --json`") from None
    try:
        return TrialReport.from_json(data)
    except (KeyError, TypeError, AttributeError) as exc:
        raise TdiffError(f"{where}: not the JSON of `tdiff patch try --json` (expected an object with "
                         f"its control and candidates; {type(exc).__name__}: {exc})") from None
