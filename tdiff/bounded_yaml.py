"""YAML every tdiff input file is read with: the safe loader, refusing a document whose aliases
would expand it beyond a bound (an "alias bomb") before anything is built from it.

PyYAML's safe loader shares the object of an anchor among its aliases, so a few lines of nested
aliases build a structure of billions of elements that only looks small: walking or printing it
takes minutes and gigabytes. Here the composed node graph is measured as if every alias were
expanded, in time linear in the file, and refused over :data:`MAX_NODES`.

Files whose mistakes are reported by line (patch files, the fix catalogue, mapping files) are read
with :func:`load_with_lines` and checked through :class:`Fields`, the one validator of their keys.

Examples:
    >>> load("a: [1, 2]", "fixes.yaml")
    {'a': [1, 2]}
    >>> top = Fields(load_with_lines("rules: []", "map.yaml"), "map.yaml", "the file", ("rules",))
    >>> top.items("rules")
    Traceback (most recent call last):
    tdiff.errors.TdiffError: map.yaml line 1: the file: 'rules' must be a non-empty list, not a list
    >>> brief(list(range(100)))          # a value in an error message, never the whole of it
    '[0, 1, 2, 3, 4, 5, ...]'
"""

from __future__ import annotations

import re
import reprlib
from typing import Literal, overload

import yaml

from tdiff.errors import TdiffError

MAX_NODES = 100_000  # scalars, lists and mappings once aliases are expanded; real files hold a few thousand

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 80, 80


def brief(value) -> str:
    """A value's repr cut to a few dozen characters, for error messages."""
    return _BRIEF.repr(value)


class BoundedSafeLoader(yaml.SafeLoader):
    """The safe loader; a document is checked for its expanded size before it is constructed."""

    def compose_document(self):
        node = super().compose_document()
        _check_expanded_size(node, self)
        return node


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return []


def _check_expanded_size(root: yaml.Node, loader) -> None:
    """Count the nodes of ``root`` with aliases expanded (each shared node is measured once)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()       # on the current path: reaching one again is a cycle
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[id(node)] > MAX_NODES:
                raise yaml.YAMLError(f"aliases expand the document beyond {MAX_NODES} values "
                                     f"(from line {node.start_mark.line + 1}); write the values out instead")
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            raise yaml.YAMLError(f"an alias refers to a value that contains it (line {node.start_mark.line + 1})")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


def load(text: str, source: str, loader: type[BoundedSafeLoader] = BoundedSafeLoader):
    """Parse YAML text; every problem is a :class:`TdiffError` naming ``source`` and the line."""
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise TdiffError(f"{source}: not valid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        where = f"{source} line {mark.line + 1}" if mark is not None else source
        raise TdiffError(f"{where}: not valid YAML: {problem}") from None


class _LinedMapping(dict):
    """A YAML mapping that remembers its line and the line of each key."""

    line: int | None = None
    key_lines: dict

    def line_of(self, key: str) -> int | None:
        return self.key_lines.get(key, self.line)


class _LineLoader(BoundedSafeLoader):
    pass


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode):
    data = _LinedMapping()
    data.line = node.start_mark.line + 1
    data.key_lines = {}
    yield data
    loader.flatten_mapping(node)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str):
            raise yaml.constructor.ConstructorError(None, None, f"key {brief(key)} is not text", key_node.start_mark)
        if key in data.key_lines:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {brief(key)} (first on line {data.key_lines[key]})", key_node.start_mark)
        data.key_lines[key] = line
        data[key] = loader.construct_object(value_node, deep=True)


_LineLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


def load_with_lines(text: str, source: str):
    """Parse YAML as :func:`load` does, into mappings that keep their line numbers for
    :class:`Fields` to name (keys must be text, each given once)."""
    return load(text, source, _LineLoader)


class Fields:
    """Typed access to one mapping's keys, the one validator of tdiff's YAML files; every complaint
    names the file and the line (of the key at fault where the mapping came from
    :func:`load_with_lines`, else of the mapping, else ``line``)."""

    def __init__(self, data, source: str, what: str, known: tuple[str, ...], line: int | None = None):
        self.source, self.what = source, what
        self.line = getattr(data, "line", None) or line
        self.data = data if isinstance(data, dict) else {}
        if not isinstance(data, dict):
            raise self.error(f"{what} must be a mapping of keys to values, not {_type_name(data)}")
        for key in data:
            if key not in known:
                raise self.error(f"{what}: unknown key {key!r} (known keys: {', '.join(known)})", key)

    def line_of(self, key: str | None = None) -> int | None:
        if key is not None and isinstance(self.data, _LinedMapping):
            return self.data.line_of(key)
        return self.line

    def where(self, key: str | None = None) -> str:
        line = self.line_of(key)
        return f"{self.source} line {line}" if line else self.source

    def error(self, message: str, key: str | None = None) -> TdiffError:
        return TdiffError(f"{self.where(key)}: {message}")

    @overload
    def text(self, key: str, *, required: Literal[True], pattern: re.Pattern | None = None,
             describe: str = "", allow_empty: bool = False) -> str: ...
    @overload
    def text(self, key: str, *, required: bool = False, pattern: re.Pattern | None = None,
             describe: str = "", allow_empty: bool = False) -> str | None: ...

    def text(self, key: str, *, required: bool = False, pattern: re.Pattern | None = None,
             describe: str = "", allow_empty: bool = False) -> str | None:
        if key not in self.data:
            if required:
                raise self.error(f"{self.what}: missing key {key!r}")
            return None
        value = self.data[key]
        if not isinstance(value, str):
            raise self.error(f"{self.what}: {key!r} must be text, not {_type_name(value)}", key)
        if not allow_empty and not value.strip():
            raise self.error(f"{self.what}: {key!r} is empty", key)
        if pattern is not None and not pattern.fullmatch(value):
            raise self.error(f"{self.what}: {key!r} is {brief(value)}, not {describe}", key)
        return value

    def choice(self, key: str, options: tuple, default=None, describe: str = ""):
        """The value of ``key``, one of ``options``; ``default`` (unchecked) where it is absent or
        left empty."""
        value = self.data.get(key)
        if value is None:
            return default
        if value not in options:
            raise self.error(f"{self.what}: {key} must be one of {', '.join(map(str, options))}{describe}, "
                             f"not {brief(value)}", key)
        return value

    def flag(self, key: str) -> bool:
        value = self.data.get(key, False)
        if not isinstance(value, bool):
            raise self.error(f"{self.what}: {key!r} must be true or false, not {_type_name(value)}", key)
        return value

    def items(self, key: str, *, required: bool = False) -> list:
        if key not in self.data:
            if required:
                raise self.error(f"{self.what}: missing key {key!r}")
            return []
        value = self.data[key]
        if not isinstance(value, list) or not value:
            raise self.error(f"{self.what}: {key!r} must be a non-empty list, not {_type_name(value)}", key)
        return value


def _type_name(value) -> str:
    return {dict: "a mapping", _LinedMapping: "a mapping", list: "a list", str: "text", bool: "true/false",
            int: "a number", float: "a number", type(None): "empty"}.get(type(value), type(value).__name__)
