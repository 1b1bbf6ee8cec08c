"""Where a patch target is defined, and its source text, found from the installed files.

``package.module.Class.method`` is split into the longest importable module prefix and a
qualified name inside it; the definition is found by parsing that module's source, without
importing anything (so `tdiff patch check` runs no package code). The target's *source text*
is its ``def`` block from the ``def`` line to its last line, common indentation removed;
decorators are not part of it. A pin is the sha256 of that text.
"""

from __future__ import annotations

import __future__
import ast
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from tdiff.source_patcher.errors import PatchError, TargetNotInstalled


@dataclass(frozen=True)
class TargetSource:
    target: str
    module: str               # the module that defines it
    qualname: str             # "Class.method" or "function"
    path: str                 # the module's file
    def_line: int             # line of the `def` in that file
    first_line: int           # first decorator line (= def_line when undecorated)
    text: str                 # the def block, dedented
    future_flags: int         # compiler flags of the module's `from __future__ import ...`
    in_class: bool
    node: ast.FunctionDef | ast.AsyncFunctionDef   # parsed from `text` (line 1 = the def line)

    @property
    def sha256(self) -> str:
        return sha256_of(self.text)

    @property
    def location(self) -> str:
        return f"{self.path}:{self.def_line}"


def sha256_of(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def find_module_spec(name: str):
    """The module's spec, found without executing any package's code (None if there is none)."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        return module.__spec__
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    for index in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = _find_in(".".join(parts[: index + 1]), [os.fspath(p) for p in spec.submodule_search_locations])
    return spec


def _find_in(name: str, locations: list[str]):
    """A submodule's spec from its parent's search locations, without importing the parent
    (importlib's PathFinder needs the parent imported to build a namespace package's path)."""
    portions = []
    for location in locations:
        finder = sys.path_importer_cache.get(location)
        if finder is None:
            for hook in sys.path_hooks:
                try:
                    finder = hook(location)
                    break
                except ImportError:
                    continue
        spec = finder.find_spec(name) if finder is not None else None
        if spec is None:
            continue
        if spec.loader is not None:
            return spec
        portions.extend(spec.submodule_search_locations or [])   # a namespace package's portion
    if not portions:
        return None
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = portions
    return spec


def split_target(patch: str, target: str) -> tuple[str, str]:
    """(module, qualname) of a dotted target, taking the longest prefix that is a module."""
    parts = target.split(".")
    if find_module_spec(parts[0]) is None:
        # `python -c`/`-m` children import from the current directory, tdiff itself does not
        here = " (it is in the current directory: run with PYTHONPATH=. to patch it)" if (
            os.path.isdir(parts[0]) or os.path.isfile(f"{parts[0]}.py")) else ""
        raise TargetNotInstalled(patch, target, f"package {parts[0]!r} is not installed{here}")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if find_module_spec(module) is not None:
            return module, ".".join(parts[cut:])
    raise AssertionError("unreachable: the top-level package was found")


def module_source(patch: str, target: str, module: str) -> tuple[str, str]:
    """(file path, source text) of an installed module."""
    spec = find_module_spec(module)
    loader = getattr(spec, "loader", None)
    source = None
    try:
        if loader is not None and hasattr(loader, "get_source"):
            source = loader.get_source(module)
        elif spec is not None and spec.has_location and (spec.origin or "").endswith(".py"):
            # a loader that keeps no source, as pytest's assertion rewriter for a plugin's package
            source = importlib.util.decode_source(Path(spec.origin).read_bytes())
    except (ImportError, OSError) as exc:
        raise PatchError(patch, target, f"cannot read the source of {module}: {exc}") from None
    if source is None:
        raise PatchError(patch, target, f"module {module} has no Python source (compiled or built in)")
    return spec.origin or module, source


def locate(patch: str, target: str) -> TargetSource:
    """Find a function target in the installed files, importing nothing."""
    module, qualname = split_target(patch, target)
    if not qualname:
        raise PatchError(patch, target, f"{target} is a module; name a function or method in it")
    path, text = module_source(patch, target, module)
    return definition(patch, target, module, qualname, path, text)


def definition(patch: str, target: str, module: str, qualname: str, path: str, source: str) -> TargetSource:
    """The def block of ``qualname`` in a module's source text."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise PatchError(patch, target, f"{path} does not parse: {exc}") from None
    body, node, in_class = tree.body, None, False
    parts = qualname.split(".")
    for depth, part in enumerate(parts):
        found = [n for n in _definitions(body) if n.name == part]
        scope = ".".join(parts[:depth]) or module
        if not found:
            raise PatchError(patch, target, f"{part!r} is not defined in {scope} ({path}); "
                                            "name the module and class where it is defined")
        if len(found) > 1:
            where = ", ".join(str(n.lineno) for n in found)
            raise PatchError(patch, target, f"{part!r} is defined {len(found)} times in {scope} (lines {where})")
        node = found[0]
        last = depth == len(parts) - 1
        if not last:
            if not isinstance(node, ast.ClassDef):
                raise PatchError(patch, target, f"{part!r} in {scope} is not a class")
            body, in_class = node.body, True
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise PatchError(patch, target, f"{qualname} in {module} is a class, not a function; name a method")
    lines = source.splitlines()
    text = textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno])) + "\n"
    first_line = min([node.lineno] + [d.lineno for d in node.decorator_list])
    parsed = ast.parse(text).body[0]
    assert isinstance(parsed, (ast.FunctionDef, ast.AsyncFunctionDef)), "the def block parses as that def"
    return TargetSource(target=target, module=module, qualname=qualname, path=path, def_line=node.lineno,
                        first_line=first_line, text=text, future_flags=_future_flags(tree),
                        in_class=in_class, node=parsed)


def _definitions(body: list[ast.stmt]):
    """Definitions at one level, including those inside module-level if/try blocks."""
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield statement
        elif isinstance(statement, ast.If):
            yield from _definitions(statement.body)
            yield from _definitions(statement.orelse)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, *(h.body for h in statement.handlers), statement.orelse, statement.finalbody):
                yield from _definitions(block)


def _future_flags(tree: ast.Module) -> int:
    flags = 0
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module == "__future__":
            for alias in statement.names:
                feature = getattr(__future__, alias.name, None)
                if feature is not None:
                    flags |= feature.compiler_flag
    return flags
