"""Nested values and the sub-names of their leaves: the one walk by which capture names tensors,
graft replaces them and the SGLang importer reads the dumper's files.

A container's parts are named by position (tuples, lists), key (mappings) or field (namedtuples,
dataclasses); a leaf's sub-name joins the names on its way with dots, and its name in a dump puts
each of them in brackets after a base name (a module path). No torch here: the caller names the
leaf type.

Examples:
    >>> walk = Nested(int, max_depth=6)
    >>> list(walk.leaves((1, {"cos": 2, "sin": [3]})))
    [('0', 1), ('1.cos', 2), ('1.sin.0', 3)]
    >>> walk.replace((1, {"cos": 2}), lambda sub, leaf: leaf * 10 if sub == "1.cos" else leaf)
    (1, {'cos': 20})
    >>> leaf_name("model.layers.0", "position_embeddings.1")
    'model.layers.0[position_embeddings][1]'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


def leaf_name(base: str, sub: str) -> str:
    """The name of the leaf ``sub`` (dotted) of a value named ``base``: ``base[part][part]``."""
    return base + "".join(f"[{part}]" for part in sub.split(".")) if sub else base


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class Nested(Generic[T]):
    """Walks nested values down to the leaves of type ``leaf``, in a stable order.

    Not opened: a container ``max_depth`` levels down, an object whose class is named in
    ``skip``, a container inside itself. Anything else that is neither a leaf nor a container
    (None, numbers, text, other objects) is passed over. A reader that must refuse what it cannot
    name overrides :meth:`mapping_key` and :meth:`too_deep`.
    """

    def __init__(self, leaf: type[T], *, max_depth: int, skip: Collection[str] = ()):
        self.leaf = leaf
        self.max_depth = max_depth
        self.skip = frozenset(skip)

    def mapping_key(self, key: object, prefix: str) -> str:
        """The name of a mapping's entry ``key`` inside the value at ``prefix``."""
        return str(key)

    def too_deep(self, prefix: str) -> None:
        """Called for the container at ``prefix`` that is not opened for its depth."""

    def leaves(self, value: object, prefix: str = "") -> Iterator[tuple[str, T]]:
        """(sub-name, leaf) for every leaf in ``value``; ``prefix`` names ``value`` itself."""
        yield from self._leaves(value, prefix, 0, frozenset())

    def passed_over(self, value: object, prefix: str = "") -> Iterator[tuple[str, object, str]]:
        """(sub-name, part, why) for each part of ``value`` the walk neither yields as a leaf nor
        opens: why is "skipped" (a class named in ``skip``), "too deep" (a container ``max_depth``
        levels down) or "not a container" (None, numbers, text, other objects)."""
        yield from self._passed_over(value, prefix, 0, frozenset())

    def leaf_at(self, value: object, sub: str) -> T | None:
        """The leaf that :meth:`leaves` names ``sub``, None if there is none."""
        return next((leaf for name, leaf in self.leaves(value) if name == sub), None)

    def replace(self, value, new: Callable[[str, T], T], prefix: str = ""):
        """``value`` with each leaf replaced by ``new(sub_name, leaf)``; a container is rebuilt
        (of its own type) only where something in it changed, else kept as it is."""
        return self._replace(value, new, prefix, 0, frozenset())

    def _leaves(self, value, prefix: str, depth: int, seen: frozenset) -> Iterator[tuple[str, T]]:
        if isinstance(value, self.leaf):
            yield prefix, value
            return
        parts = self._parts(value, prefix, depth, seen)
        if parts is None:
            return
        inside = seen | {id(value)}
        for _, name, item in parts:
            yield from self._leaves(item, join(prefix, name), depth + 1, inside)

    def _passed_over(self, value, prefix: str, depth: int, seen: frozenset) -> Iterator[tuple[str, object, str]]:
        if isinstance(value, self.leaf) or id(value) in seen:
            return
        if not _is_container(value):
            yield prefix, value, "not a container"
        elif type(value).__name__ in self.skip:
            yield prefix, value, "skipped"
        elif depth >= self.max_depth:
            yield prefix, value, "too deep"
        else:
            inside = seen | {id(value)}
            for _, name, item in self._parts(value, prefix, depth, seen) or ():
                yield from self._passed_over(item, join(prefix, name), depth + 1, inside)

    def _replace(self, value, new: Callable[[str, T], T], prefix: str, depth: int, seen: frozenset):
        if isinstance(value, self.leaf):
            return new(prefix, value)
        parts = self._parts(value, prefix, depth, seen)
        if parts is None:
            return value
        inside = seen | {id(value)}
        items = [(key, item, self._replace(item, new, join(prefix, name), depth + 1, inside))
                 for key, name, item in parts]
        if all(replaced is item for _, item, replaced in items):
            return value
        if isinstance(value, Mapping):
            return type(value)({key: replaced for key, _, replaced in items})  # type: ignore[call-arg]  # a concrete mapping
        if _is_namedtuple(value):
            return type(value)(*(replaced for _, _, replaced in items))
        if isinstance(value, (tuple, list)):
            return type(value)(replaced for _, _, replaced in items)
        return dataclasses.replace(value, **{str(key): replaced for key, item, replaced in items if replaced is not item})

    def _parts(self, value, prefix: str, depth: int, seen: frozenset) -> list[tuple[object, str, object]] | None:
        """(key, name, item) for each part of a container to open; None for anything else."""
        if not _is_container(value) or id(value) in seen or type(value).__name__ in self.skip:
            return None
        if depth >= self.max_depth:
            self.too_deep(prefix)
            return None
        if isinstance(value, Mapping):
            return [(key, self.mapping_key(key, prefix), item) for key, item in value.items()]
        if _is_namedtuple(value):
            return [(field, field, item) for field, item in zip(value._fields, value)]
        if isinstance(value, (tuple, list)):
            return [(i, str(i), item) for i, item in enumerate(value)]
        return [(f.name, f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _is_container(value) -> bool:
    return isinstance(value, (Mapping, tuple, list)) or (dataclasses.is_dataclass(value)
                                                          and not isinstance(value, type))
