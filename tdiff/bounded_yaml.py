"""YAML every tdiff input file is read with: the safe loader, refusing a document whose aliases
would expand it beyond a bound (an "alias bomb") before anything is built from it.

PyYAML's safe loader shares the object of an anchor among its aliases, so a few lines of nested
aliases build a structure of billions of elements that only looks small: walking or printing it
takes minutes and gigabytes. Here the composed node graph is measured as if every alias were
expanded, in time linear in the file, and refused over :data:`MAX_NODES`.

Examples:
    >>> load("a: [1, 2]", "fixes.yaml")
    {'a': [1, 2]}
    >>> brief(list(range(100)))          # a value in an error message, never the whole of it
    '[0, 1, 2, 3, 4, 5, ...]'
"""

from __future__ import annotations

import reprlib

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
