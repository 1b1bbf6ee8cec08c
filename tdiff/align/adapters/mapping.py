"""A user's mapping file (YAML) for models no built-in adapter knows.

    side: b                     # a, b or both; default: the sides no built-in adapter knows
    label: my-model             # shown in reports
    layout: bs                  # stored leading dims of activations: bs, sb or t
    rules:
      - module: 'blocks\\.(?P<layer>\\d+)\\.attn\\.qkv'   # regex, full match on the module path
        role: output            # input or output (default output)
        sub: "0"                # default: "" or "0" (a bare tensor, or a tuple's first)
        boundary: attn.q        # per-layer (the regex captures `layer`) or model-level name
        layout: bs              # overrides the file's default
        slice: [0, 64]          # optional: [start, length] of the last dim (part of a fused output)
        shard: [{axis: tp, dim: -1}]   # optional: how ranks split it, if the capture did not say
      - explicit: my_logprobs   # a value dumped with tdiff.dump
        boundary: logprobs
    not_exposed:
      attn.q_rope: applied in a function

Records no rule matches are listed as unmapped in the report. The file is read with
the bounded safe loader of :mod:`tdiff.bounded_yaml`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tdiff.align.adapters.base import Adapter, View
from tdiff.align.canonical import Piece
from tdiff.align.ops import Narrow, TokensFirst
from tdiff import bounded_yaml
from tdiff.bounded_yaml import brief
from tdiff.errors import TdiffError
from tdiff.store.files import read_regular
from tdiff.vocab.boundaries import LAYER_BOUNDARIES, kind_of
from tdiff.vocab.kinds import KINDS

LAYOUTS = ("bs", "sb", "t")
_RULE_KEYS = {"module", "explicit", "role", "sub", "boundary", "layout", "slice", "shard", "kind"}
_FILE_KEYS = {"side", "label", "layout", "rules", "not_exposed"}


@dataclass(frozen=True)
class MappingRule:
    pattern: re.Pattern
    explicit: bool
    role: str
    subs: tuple[str, ...]
    boundary: str
    kind: str
    layout: str
    slice: tuple[int, int] | None
    shard: tuple | None


class MappingAdapter(Adapter):
    """An adapter made from a mapping file."""

    framework = "mapping"

    def __init__(self, path: str | Path, data: dict, mapping_rules: list[MappingRule], not_exposed: dict):
        super().__init__()
        self.path = Path(path)
        self.label = str(data.get("label") or f"mapping {self.path.name}")
        self.sides = data.get("side")
        self.mapping_rules = mapping_rules
        self.not_exposed = not_exposed

    def pieces(self, view: View) -> list[Piece]:
        out = []
        for record in view.records:
            for rule in self.mapping_rules:
                if rule.explicit != (record.role == "explicit"):
                    continue
                if not rule.explicit and (record.role != rule.role or record.sub not in rule.subs):
                    continue
                match = rule.pattern.fullmatch(record.name if rule.explicit else record.module)
                if match is None:
                    continue
                layer = match.groupdict().get("layer")
                name = f"layers.{int(layer)}.{rule.boundary}" if layer is not None else rule.boundary
                part = (Narrow(rule.slice[0], rule.slice[1], rule.boundary),) if rule.slice else ()
                out.append(Piece(name, view.step, record.call, [record], transforms=part,
                                 layout=(TokensFirst(rule.layout),) if not rule.explicit else (),
                                 kind=rule.kind, spec=list(rule.shard) if rule.shard else None))
        return out


def load_mapping(path: str | Path) -> MappingAdapter:
    """Read and check a mapping file; every mistake is reported with the rule at fault."""
    path = Path(path)
    where = f"--mapping {path}"
    try:
        text = read_regular(path, "mapping file").decode("utf-8")
    except (TdiffError, UnicodeDecodeError) as exc:
        raise TdiffError(f"--mapping {exc}") from None
    data = bounded_yaml.load(text, where)
    if not isinstance(data, dict):
        raise TdiffError(f"{where}: expected a mapping with a 'rules' list")
    unknown = set(data) - _FILE_KEYS
    if unknown:
        raise TdiffError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; use {', '.join(sorted(_FILE_KEYS))}")
    if data.get("side") not in (None, "a", "b", "both"):
        raise TdiffError(f"{where}: side must be a, b or both, not {brief(data.get('side'))}")
    default_layout = _layout(data.get("layout", "bs"), where)
    rules = data.get("rules")
    if not isinstance(rules, list) or not rules:
        raise TdiffError(f"{where}: 'rules' must be a non-empty list")
    parsed = [_rule(rule, default_layout, f"{where}: rule {i + 1}") for i, rule in enumerate(rules)]
    not_exposed = data.get("not_exposed") or {}
    if not isinstance(not_exposed, dict) or not all(isinstance(v, str) for v in not_exposed.values()):
        raise TdiffError(f"{where}: not_exposed must map boundary names to reasons")
    return MappingAdapter(path, data, parsed, {str(k): v for k, v in not_exposed.items()})


def _rule(rule, default_layout: str, where: str) -> MappingRule:
    if not isinstance(rule, dict):
        raise TdiffError(f"{where}: expected a mapping with 'module' (or 'explicit') and 'boundary'")
    unknown = set(rule) - _RULE_KEYS
    if unknown:
        raise TdiffError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    if ("module" in rule) == ("explicit" in rule):
        raise TdiffError(f"{where}: give exactly one of 'module' (a module path regex) or 'explicit' (a dump name)")
    explicit = "explicit" in rule
    source = str(rule["explicit" if explicit else "module"])
    try:
        pattern = re.compile(source)
    except re.error as exc:
        raise TdiffError(f"{where}: {source!r} is not a valid regular expression: {exc}") from None
    boundary = rule.get("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise TdiffError(f"{where}: 'boundary' must name a canonical boundary (docs/BOUNDARIES.md)")
    has_layer = "layer" in pattern.groupindex
    if boundary in LAYER_BOUNDARIES and not has_layer:
        raise TdiffError(f"{where}: {boundary!r} is a per-layer boundary: capture the layer index with "
                         "(?P<layer>\\d+) in the regex")
    kind = rule.get("kind") or (kind_of(f"layers.0.{boundary}") if has_layer and boundary in LAYER_BOUNDARIES
                                else kind_of(boundary))
    if kind not in KINDS:
        raise TdiffError(f"{where}: kind {brief(kind)} is not one of {', '.join(KINDS)}")
    role = rule.get("role", "output")
    if role not in ("input", "output"):
        raise TdiffError(f"{where}: role must be input or output, not {brief(role)}")
    sub = rule.get("sub")
    subs = (str(sub),) if sub is not None else ("", "0")
    window = rule.get("slice")
    if window is not None and not (isinstance(window, list) and len(window) == 2
                                   and all(isinstance(v, int) and v >= 0 for v in window)):
        raise TdiffError(f"{where}: slice must be [start, length] of the last dimension")
    shard = rule.get("shard")
    if shard is not None:
        if not (isinstance(shard, list) and all(isinstance(e, dict) and e.get("axis") in ("tp", "etp", "ep")
                                                and (isinstance(e.get("dim"), int) or e.get("reduce") == "sum")
                                                for e in shard)):
            raise TdiffError(f"{where}: shard must be a list like [{{axis: tp, dim: -1}}] or "
                             "[{axis: tp, reduce: sum}] (axes tp, etp, ep)")
        shard = tuple(shard)
    layout = _layout(rule.get("layout", default_layout), where)
    return MappingRule(pattern, explicit, role, subs, boundary, kind, layout, tuple(window) if window else None, shard)


def _layout(value, where: str) -> str:
    if value not in LAYOUTS:
        raise TdiffError(f"{where}: layout must be one of {', '.join(LAYOUTS)} "
                         f"([batch, seq, ...], [seq, batch, ...], [tokens, ...]), not {brief(value)}")
    return value
