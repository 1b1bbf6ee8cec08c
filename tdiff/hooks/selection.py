"""Which module calls a capture records: regexes, layer ranges and step ranges.

Examples:
    >>> Selection(select=["mlp"], layers=parse_ranges("0")).wants("model.layers.0.mlp.up_proj")
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tdiff.vocab.parse import compile_patterns
from tdiff.vocab.paths import layer_of


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
        """``layer``: the decoder layer the call belongs to (see
        :func:`tdiff.vocab.paths.call_layer`), when it is not the one the path says."""
        key = (path, explicit, layer)
        wanted = self._cache.get(key)
        if wanted is None:
            wanted = self._cache[key] = self._decide(path, explicit, layer)
        return wanted

    def may_want(self, path: str) -> bool:
        """Whether some call of module ``path`` may be wanted: --select and --exclude let the path
        through (--layers then asks which layer made the call, and a module shared by the layers is
        called from each)."""
        return not self._excluded(path) and (not self._select or any(p.search(path) for p in self._select))

    def _excluded(self, path: str) -> bool:
        return any(p.search(path) for p in self._exclude)

    def _decide(self, path: str, explicit: bool, layer: int | None) -> bool:
        if explicit:
            return not self._excluded(path)
        if not self.may_want(path):
            return False
        return self.layers is None or (layer if layer is not None else layer_of(path)) in self.layers
