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

Records no rule matches are listed as unmapped in the report. The file is read and checked as
patch files are (:mod:`tdiff.bounded_yaml`): a mistake is reported with its line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tdiff.align.adapters.base import Adapter, View
from tdiff.align.canonical import Piece
from tdiff.align.ops import Narrow, TokensFirst
from tdiff.bounded_yaml import Fields, load_with_lines
from tdiff.errors import TdiffError
from tdiff.store.files import read_regular
from tdiff.vocab.boundaries import LAYER_BOUNDARIES, kind_of
from tdiff.vocab.kinds import KINDS

LAYOUTS = ("bs", "sb", "t")
_LAYOUT_NAMES = " ([batch, seq, ...], [seq, batch, ...], [tokens, ...])"
_RULE_KEYS = ("module", "explicit", "role", "sub", "boundary", "layout", "slice", "shard", "kind")
_FILE_KEYS = ("side", "label", "layout", "rules", "not_exposed")


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
        self.sides: str | None = data.get("side")
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
    """Read and check a mapping file; every mistake is reported with its line and the rule at fault."""
    path = Path(path)
    where = f"--mapping {path}"
    try:
        text = read_regular(path, "mapping file").decode("utf-8")
    except (TdiffError, UnicodeDecodeError) as exc:
        raise TdiffError(f"--mapping {exc}") from None
    top = Fields(load_with_lines(text, where), where, "the file", _FILE_KEYS, 1)
    top.choice("side", ("a", "b", "both"))
    default_layout = top.choice("layout", LAYOUTS, "bs", _LAYOUT_NAMES)
    parsed = [_rule(Fields(rule, where, f"rule {i}", _RULE_KEYS, top.line_of("rules")), default_layout)
              for i, rule in enumerate(top.items("rules", required=True), 1)]
    not_exposed = top.data.get("not_exposed") or {}
    if not isinstance(not_exposed, dict) or not all(isinstance(v, str) for v in not_exposed.values()):
        raise top.error("not_exposed must map boundary names to reasons", "not_exposed")
    return MappingAdapter(path, top.data, parsed, {str(k): v for k, v in not_exposed.items()})


def _rule(rule: Fields, default_layout: str) -> MappingRule:
    if ("module" in rule.data) == ("explicit" in rule.data):
        raise rule.error(f"{rule.what}: give exactly one of 'module' (a module path regex) or 'explicit' (a dump name)")
    explicit = "explicit" in rule.data
    key = "explicit" if explicit else "module"
    source = str(rule.data[key])       # a module named by a number ("0") may be written unquoted
    try:
        pattern = re.compile(source)
    except re.error as exc:
        raise rule.error(f"{rule.what}: {source!r} is not a valid regular expression: {exc}", key) from None
    boundary = rule.text("boundary", required=True)
    has_layer = "layer" in pattern.groupindex
    if boundary in LAYER_BOUNDARIES and not has_layer:
        raise rule.error(f"{rule.what}: {boundary!r} is a per-layer boundary: capture the layer index with "
                         "(?P<layer>\\d+) in the regex", "boundary")
    default_kind = (kind_of(f"layers.0.{boundary}") if has_layer and boundary in LAYER_BOUNDARIES
                    else kind_of(boundary))
    kind = rule.choice("kind", KINDS, default_kind)
    role = rule.choice("role", ("input", "output"), "output")
    sub = rule.data.get("sub")
    subs = (str(sub),) if sub is not None else ("", "0")
    window = rule.data.get("slice")
    if window is not None and not (isinstance(window, list) and len(window) == 2
                                   and all(isinstance(v, int) and v >= 0 for v in window)):
        raise rule.error(f"{rule.what}: slice must be [start, length] of the last dimension", "slice")
    shard = rule.data.get("shard")
    if shard is not None:
        if not (isinstance(shard, list) and all(isinstance(e, dict) and e.get("axis") in ("tp", "etp", "ep")
                                                and (isinstance(e.get("dim"), int) or e.get("reduce") == "sum")
                                                for e in shard)):
            raise rule.error(f"{rule.what}: shard must be a list like [{{axis: tp, dim: -1}}] or "
                             "[{axis: tp, reduce: sum}] (axes tp, etp, ep)", "shard")
        shard = tuple(shard)
    layout = rule.choice("layout", LAYOUTS, default_layout, _LAYOUT_NAMES)
    return MappingRule(pattern, explicit, role, subs, boundary, kind, layout, tuple(window) if window else None, shard)
