"""Which module calls a capture records: regexes, layer ranges and step ranges.

Examples:
    >>> parse_ranges("0-3,7")
    frozenset({0, 1, 2, 3, 7})
    >>> layer_of("model.layers.12.mlp.down_proj"), layer_of("decoder.final_layernorm")
    (12, None)
    >>> call_layer("model.layers.0.self_attn.rotary_emb", "model.layers.3.self_attn", 3)
    3
    >>> Selection(select=["mlp"], layers=parse_ranges("0")).wants("model.layers.0.mlp.up_proj")
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tdiff.errors import TdiffError

# Decoder-layer containers across frameworks: HF and SGLang "model.layers.N", Megatron
# "decoder.layers.N", GPT-2 "transformer.h.N", BERT "encoder.layer.N", others "blocks.N".
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?=$|[.\[])")
_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def layer_of(path: str) -> int | None:
    """The decoder-layer index a module path lies in (the innermost one), or None."""
    found = _LAYER.findall(path)
    return int(found[-1]) if found else None


def call_layer(path: str, caller: str | None, caller_layer: int | None) -> int | None:
    """The decoder layer a call of module ``path`` belongs to, made by the call of module
    ``caller`` (None at the top) that belongs to layer ``caller_layer``.

    The module path says the layer unless the module lies outside its caller, or its caller was
    attributed to a layer its own path does not say: a module shared by all layers (SGLang's one
    ``rotary_emb``) is named after its first owner, ``model.layers.0.self_attn.rotary_emb``, and
    each of its calls belongs to the layer that made it.
    """
    own = layer_of(path)
    if caller is None or caller_layer is None:
        return own
    owned = caller == "" or path.startswith(caller + ".")
    return own if owned and caller_layer == layer_of(caller) else caller_layer


def record_layer(record) -> int | None:
    """The decoder layer of a module record's call: the one recorded at capture time where the
    module path does not say it (``Record.layer``); for dumps that lack it, derived from the
    record's module path and its caller's (``Record.parent``)."""
    if record.layer is not None:
        return record.layer
    parent = record.parent
    return call_layer(record.module, parent, layer_of(parent) if parent else None)


def parse_ranges(text: str | None, what: str = "range") -> frozenset[int] | None:
    """Parse "0-3,7" into a set of integers; None or "" means no restriction."""
    if text is None or str(text).strip() in ("", "all"):
        return None
    values: set[int] = set()
    for piece in str(text).split(","):
        match = _RANGE.fullmatch(piece)
        if not match:
            raise TdiffError(f"{what} {text!r} is not a list of ranges like 0-3,7")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise TdiffError(f"{what} {text!r}: range {piece.strip()!r} runs backwards")
        values.update(range(lo, hi + 1))
    return frozenset(values)


def compile_patterns(patterns, what: str) -> tuple[re.Pattern, ...]:
    compiled = []
    for pattern in patterns or ():
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise TdiffError(f"{what} {pattern!r} is not a valid regular expression: {exc}") from None
    return tuple(compiled)


@dataclass
class Selection:
    """A module path is wanted when it matches a --select pattern (or none is given), matches no
    --exclude pattern, and its call lies in one of the --layers (when given). Explicit dumps ignore
    --select and --layers: they were placed on purpose."""

    select: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    layers: frozenset[int] | None = None
    steps: frozenset[int] | None = None

    def __post_init__(self):
        self._select = compile_patterns(self.select, "--select")
        self._exclude = compile_patterns(self.exclude, "--exclude")
        self._cache: dict[tuple[str, bool, int | None], bool] = {}

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def wants(self, path: str, explicit: bool = False, layer: int | None = None) -> bool:
        """``layer``: the decoder layer the call belongs to (see :func:`call_layer`), when it is
        not the one the path says."""
        key = (path, explicit, layer)
        wanted = self._cache.get(key)
        if wanted is None:
            wanted = self._cache[key] = self._decide(path, explicit, layer)
        return wanted

    def _decide(self, path: str, explicit: bool, layer: int | None) -> bool:
        if any(p.search(path) for p in self._exclude):
            return False
        if explicit:
            return True
        if self._select and not any(p.search(path) for p in self._select):
            return False
        return self.layers is None or (layer if layer is not None else layer_of(path)) in self.layers
