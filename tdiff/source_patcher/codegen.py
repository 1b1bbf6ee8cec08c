"""Code objects that can be swapped into an existing function: from edited source, or a call to a
replacement function.

A function's ``__code__`` may only be replaced by code with the same free variables (its closure
cells stay: a method using ``super()`` has a ``__class__`` cell). The new def is therefore compiled
inside a small factory that defines those names, with a never-run reference to each of them, so
the new code asks for exactly the original cells in the original order. Annotations are dropped
and defaults are not evaluated when the signature is unchanged: the function object keeps its own
``__defaults__``, ``__kwdefaults__`` and ``__annotations__``.
"""

from __future__ import annotations

import ast
import copy
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any

from tdiff.source_patcher.source import TargetSource

FACTORY = "__tdiff_factory__"
_TYPE_PARAMS: dict[str, Any] = {"type_params": []} if sys.version_info >= (3, 12) else {}
REPLACEMENT = "__tdiff_replacement__"


FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


class CompileError(ValueError):
    pass


@dataclass
class Compiled:
    code: types.CodeType
    function: types.FunctionType       # built in the target's globals; its defaults when they changed
    signature_changed: bool


def parse_function(text: str, name: str) -> FunctionNode:
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        bad = (exc.text or "").strip()
        raise CompileError(f"the edited source does not compile: {exc.msg} at its line {exc.lineno}"
                           + (f": {bad!r}" if bad else "")) from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise CompileError("the edited source must stay one def block")
    node = tree.body[0]
    if node.name != name:
        raise CompileError(f"the edited def is named {node.name!r}, not {name!r}")
    if node.decorator_list:
        raise CompileError("edits cannot add decorators (the function keeps its own)")
    return node


def edited_node(source: TargetSource, text: str, preamble: str | None) -> tuple[FunctionNode, bool]:
    """The edited def (with the preamble at the start of its body) and whether its signature changed."""
    node = parse_function(text, source.node.name)
    changed = ast.dump(node.args) != ast.dump(source.node.args)
    if preamble:
        try:
            statements = ast.parse(preamble).body
        except SyntaxError as exc:
            raise CompileError(f"the preamble does not compile: {exc.msg} at its line {exc.lineno}") from None
        for statement in statements:
            for sub in ast.walk(statement):
                if hasattr(sub, "lineno"):
                    sub.lineno = sub.end_lineno = node.lineno  # type: ignore[attr-defined]  # has lineno
        docstring = ast.get_docstring(node, clean=False) is not None
        node.body[1 if docstring else 0:1 if docstring else 0] = statements
    return node, changed


def trampoline_node(source: TargetSource, replacement: str) -> FunctionNode:
    """A def with the target's signature whose body calls ``module:function`` with the same arguments."""
    module, attribute = replacement.split(":")
    node = copy.deepcopy(source.node)
    args = node.args
    target: ast.expr = ast.Name(REPLACEMENT, ast.Load())
    for part in attribute.split("."):
        target = ast.Attribute(target, part, ast.Load())
    call = ast.Call(
        func=target,
        args=[ast.Name(a.arg, ast.Load()) for a in args.posonlyargs + args.args]
        + ([ast.Starred(ast.Name(args.vararg.arg, ast.Load()), ast.Load())] if args.vararg else []),
        keywords=[ast.keyword(a.arg, ast.Name(a.arg, ast.Load())) for a in args.kwonlyargs]
        + ([ast.keyword(None, ast.Name(args.kwarg.arg, ast.Load()))] if args.kwarg else []))
    value = ast.Await(call) if isinstance(node, ast.AsyncFunctionDef) else call
    node.body = [ast.Import([ast.alias(module, REPLACEMENT)]), ast.Return(value)]
    node.decorator_list = []
    for statement in node.body:
        ast.copy_location(statement, node)
    return ast.fix_missing_locations(node)


def factory_module(node: FunctionNode, freevars: tuple[str, ...], *, evaluate_defaults: bool) -> ast.Module:
    """``def __tdiff_factory__(): <freevar> = None ...; <node>; return <name>``."""
    node = copy.deepcopy(node)
    args = node.args
    for arg in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
        if arg is not None:
            arg.annotation = None
    node.returns = None
    if not evaluate_defaults:
        args.defaults = [ast.Constant(None) for _ in args.defaults]
        args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    if freevars:
        keep = ast.If(test=ast.Constant(False), orelse=[], body=[
            ast.Expr(ast.Tuple([ast.Name(v, ast.Load()) for v in freevars], ast.Load()))])
        node.body.append(keep)
    body: list[ast.stmt] = [ast.Assign([ast.Name(v, ast.Store())], ast.Constant(None)) for v in freevars]
    factory = ast.FunctionDef(name=FACTORY, args=ast.arguments([], [], None, [], [], None, []),
                              body=body + [node, ast.Return(ast.Name(node.name, ast.Load()))],
                              decorator_list=[], returns=None, **_TYPE_PARAMS)
    return ast.fix_missing_locations(ast.Module([factory], type_ignores=[]))


def compile_factory(node: FunctionNode, freevars: tuple[str, ...], *, signature_changed: bool, future_flags: int,
                    filename: str) -> types.CodeType:
    """Compile the factory around ``node``; checks that the new code keeps the closure ``freevars``."""
    module = factory_module(node, freevars, evaluate_defaults=signature_changed)
    try:
        code = compile(module, filename, "exec", flags=future_flags, dont_inherit=True)
    except SyntaxError as exc:
        raise CompileError(f"the patched function does not compile: {exc.msg} at its line {exc.lineno}") from None
    factory = _find_code(code, FACTORY)
    inner = _find_code(factory, node.name) if factory is not None else None
    assert inner is not None, "the module built above defines the factory and the function"
    if inner.co_freevars != freevars:
        raise CompileError(f"the patched function would use closure variables {inner.co_freevars}, "
                           f"the original uses {freevars}; a patch cannot change a function's closure")
    return code


def build(node: FunctionNode, freevars: tuple[str, ...], *, signature_changed: bool, future_flags: int,
          filename: str, globals_: dict) -> Compiled:
    """Compile ``node`` for a function whose closure has ``freevars``, in ``globals_``."""
    code = compile_factory(node, freevars, signature_changed=signature_changed, future_flags=future_flags,
                           filename=filename)
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - the patched function's own compiled code; defines the factory only
    factory = types.FunctionType(namespace[FACTORY].__code__, globals_)
    try:
        function = factory()
    except Exception as exc:  # noqa: BLE001 - new default values that fail to evaluate
        raise CompileError(f"the new signature's defaults cannot be evaluated: {type(exc).__name__}: {exc}") from None
    return Compiled(function.__code__, function, signature_changed)


def static_freevars(node: FunctionNode, *, in_class: bool) -> tuple[str, ...]:
    """The free variables a def would have where it stands (inside its class, if it is a method)."""
    node = copy.deepcopy(node)
    node.decorator_list = []
    outer: ast.stmt = node
    if in_class:
        outer = ast.ClassDef(name="__tdiff_class__", bases=[], keywords=[], body=[node], decorator_list=[],
                             **_TYPE_PARAMS)
    module = ast.fix_missing_locations(ast.Module([outer], type_ignores=[]))
    code = compile(module, "<tdiff>", "exec", dont_inherit=True)
    found = _find_code(code, node.name)
    return found.co_freevars if found is not None else ()


def _find_code(code: types.CodeType, name: str) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name:
                return const
            deeper = _find_code(const, name)
            if deeper is not None:
                return deeper
    return None


def check_replacement_signature(node: FunctionNode, replacement) -> None:
    """The replacement must accept every argument the trampoline passes to it."""
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args] + (["*args"] if args.vararg else [])
    keywords: dict[str, str | None] = {a.arg: a.arg for a in args.kwonlyargs}
    if args.kwarg:
        keywords["__tdiff_any_keyword__"] = None
    try:
        signature = inspect.signature(replacement)
    except (TypeError, ValueError) as exc:
        raise CompileError(f"the replacement has no inspectable signature: {exc}") from None
    try:
        signature.bind(*positional, **keywords)
    except TypeError as exc:
        wanted = ", ".join(positional + [f"{k}=" for k in keywords if not k.startswith("__tdiff")])
        raise CompileError(f"the replacement{signature} cannot take the target's arguments ({wanted}): {exc}") from None
