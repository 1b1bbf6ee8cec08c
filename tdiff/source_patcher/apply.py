"""Apply patches to live functions and restore them.

    with apply_patches(load_patch_file("fixes.yaml").patches):
        run_model()        # patched; modules imported inside the block are patched as they load

A patch applies when its target's module is imported (an import hook), or at once when it
already is. Edits are applied to the target's source text and compiled in the function's own
globals; the new code is swapped into the existing function object (``__code__``, and the
defaults when the signature changed), so references taken earlier (bound methods, ``from m import
f``) see the change. Patches of one module are all prepared before any is swapped in: a patch that
cannot apply raises :class:`PatchError` and leaves that module untouched. Restoring puts back the
original code and defaults; the function object is the same throughout.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import linecache
import os
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tdiff.bootstrap.imports import when_imported
from tdiff.source_patcher.codegen import (CompileError, build, check_replacement_signature, edited_node,
                                          trampoline_node)
from tdiff.source_patcher.edits import EditError, apply_edits
from tdiff.source_patcher.errors import PatchError, TargetNotInstalled
from tdiff.source_patcher.source import TargetSource, definition, module_source, split_target
from tdiff.source_patcher.spec import PatchSpec

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


@dataclass
class _Swap:
    """One patch swapped into one function."""

    patch: PatchSpec
    function: types.FunctionType
    saved: tuple                     # (__code__, __defaults__, __kwdefaults__) before this patch
    text: str | None                 # the function's source text after it (None: replaced wholesale)
    code: types.CodeType
    preambles: tuple[str, ...] = ()  # the preambles of this and earlier edits of the function, in order
    defaults: tuple | None = None    # (__defaults__, __kwdefaults__) when the signature changed
    filename: str = ""

    def apply(self) -> None:
        self.function.__code__ = self.code
        if self.defaults is not None:
            self.function.__defaults__, self.function.__kwdefaults__ = self.defaults
        _swapped.setdefault(id(self.function), []).append(self)

    def undo(self) -> None:
        stack = _swapped.get(id(self.function), [])
        if not stack or stack[-1] is not self:
            later = stack[-1].patch.name if stack else "?"
            raise RuntimeError(f"cannot restore patch {self.patch.name!r}: patch {later!r} was applied to "
                               f"{self.patch.target} after it and is still active")
        stack.pop()
        if not stack:
            del _swapped[id(self.function)]
        self.function.__code__, self.function.__defaults__, self.function.__kwdefaults__ = self.saved
        linecache.cache.pop(self.filename, None)


@dataclass
class _Activation:
    """An ``activate`` patch: a function that made a change and returned how to undo it."""

    patch: PatchSpec
    enable: Callable
    disable: Callable | None = None

    def apply(self) -> None:
        try:
            disable = self.enable()
        except Exception as exc:  # reported as this patch's failure
            raise PatchError(self.patch.name, self.patch.target,
                             f"{self.patch.activate} failed: {type(exc).__name__}: {exc}") from exc
        if not callable(disable):
            raise PatchError(self.patch.name, self.patch.target,
                             f"{self.patch.activate} must return a function that undoes it, not {disable!r}")
        self.disable = disable

    def undo(self) -> None:
        if self.disable is not None:  # None until apply() succeeded
            self.disable()


# id(function) -> the patches swapped into it, oldest first (patches on one function stack up)
_swapped: dict[int, list[_Swap]] = {}


@dataclass
class ActivePatches:
    """Patches armed for their modules; :meth:`restore` (or leaving the ``with`` block) undoes them."""

    patches: list[PatchSpec]
    on_applied: Callable[[PatchSpec], None] | None = None
    on_error: Callable[[BaseException], None] | None = None   # for import-time failures; default: raise
    applied: list = field(default_factory=list)
    skipped: list[PatchError] = field(default_factory=list)   # optional patches whose package is absent
    active: bool = False

    def start(self) -> Self:
        groups: dict[str, list[PatchSpec]] = {}
        for patch in self.patches:
            try:
                module, _ = split_target(patch.name, patch.target)
            except TargetNotInstalled as exc:
                if not patch.optional:
                    raise
                self.skipped.append(exc)
                continue
            groups.setdefault(module, []).append(patch)
        self.active = True
        try:
            for module, patches in groups.items():
                when_imported(module, lambda loaded, patches=patches: self._on_import(loaded, patches))
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self) -> None:
        self.active = False
        while self.applied:
            self.applied[-1].undo()
            self.applied.pop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _on_import(self, module: types.ModuleType, patches: list[PatchSpec]) -> None:
        if not self.active:
            return  # restored before this module was imported
        try:
            self._apply_module(module, patches)
        except Exception as exc:  # handed to on_error, which decides
            if self.on_error is None:
                raise
            self.on_error(exc)

    def _apply_module(self, module: types.ModuleType, patches: list[PatchSpec]) -> None:
        texts: dict[int, tuple[str | None, tuple[str, ...]]] = {}
        prepared = [self._prepare(module, patch, texts) for patch in patches]
        done = []
        try:
            for item in prepared:
                item.apply()
                done.append(item)
        except BaseException:
            for item in reversed(done):
                item.undo()
            raise
        self.applied.extend(done)
        if self.on_applied is not None:
            for item in done:
                self.on_applied(item.patch)

    def _prepare(self, module: types.ModuleType, patch: PatchSpec, texts: dict):
        if patch.activate is not None:
            return _Activation(patch, resolve_reference(patch, patch.activate))
        _, qualname = split_target(patch.name, patch.target)
        path, text = module_source(patch.name, patch.target, module.__name__)
        source = definition(patch.name, patch.target, module.__name__, qualname, path, text)
        function = resolve_function(patch, module, source)
        if patch.pin is not None and patch.pin != source.sha256:
            raise PatchError(patch.name, patch.target, pin_mismatch(patch.pin, source))
        stack = _swapped.get(id(function), [])
        if id(function) in texts:
            current, preambles = texts[id(function)]
        else:
            current, preambles = (stack[-1].text, stack[-1].preambles) if stack else (source.text, ())
        filename = f"<tdiff patch {patch.name}: {patch.target}>"
        try:
            if patch.edits:
                if current is None:
                    raise PatchError(patch.name, patch.target, "an earlier patch replaced this function "
                                                               "wholesale; edits cannot apply on top of it")
                new_text = apply_edits(current, patch.edits, first_line=source.def_line)
                # an earlier patch's preamble stays: the text it edited still needs its names
                preambles += (patch.preamble,) if patch.preamble else ()
                node, changed = edited_node(source, new_text, "\n".join(preambles) or None)
                shown = new_text
            else:
                assert patch.replace_with is not None, "activation patches are not swapped in here"
                replacement = resolve_reference(patch, patch.replace_with)
                check_replacement_signature(source.node, replacement)
                node, changed, new_text = trampoline_node(source, patch.replace_with), False, None
                preambles = ()
                shown = _unparse(node)
            compiled = build(node, function.__code__.co_freevars, signature_changed=changed,
                             future_flags=source.future_flags, filename=filename, globals_=function.__globals__)
        except (EditError, CompileError) as exc:
            raise PatchError(patch.name, patch.target, str(exc)) from None
        texts[id(function)] = (new_text, preambles)
        linecache.cache[filename] = (len(shown), None, shown.splitlines(True), filename)
        original = function.__code__
        code = compiled.code.replace(co_name=original.co_name)
        if sys.version_info >= (3, 11):
            code = code.replace(co_qualname=original.co_qualname)
        defaults = (compiled.function.__defaults__, compiled.function.__kwdefaults__) if changed else None
        return _Swap(patch, function, (original, function.__defaults__, function.__kwdefaults__), new_text,
                     code, preambles, defaults, filename)


def apply_patches(patches: Iterable[PatchSpec], *, on_applied: Callable[[PatchSpec], None] | None = None,
                  on_error: Callable[[BaseException], None] | None = None) -> ActivePatches:
    """Arm ``patches`` now: each applies at once if its module is imported, else when it is.

    A patch that cannot apply raises :class:`PatchError`, from this call or from the import of its
    module; with ``on_error``, import-time failures are handed to it instead."""
    return ActivePatches(list(patches), on_applied=on_applied, on_error=on_error).start()


def pin_mismatch(pin: str, source: TargetSource) -> str:
    return (f"pin mismatch: the source of {source.qualname} at {source.location} has sha256 "
            f"{source.sha256}, the patch was pinned to {pin}; the target changed: review the patch, then update its pin")


def resolve_function(patch: PatchSpec, module: types.ModuleType, source: TargetSource) -> types.FunctionType:
    """The live function defined at ``source`` (through staticmethod/classmethod and __wrapped__)."""
    obj: object = module
    for part in source.qualname.split("."):
        namespace = getattr(obj, "__dict__", {})
        if part not in namespace:
            raise PatchError(patch.name, patch.target, f"{part!r} is not an attribute of {getattr(obj, '__name__', obj)} at run time")
        obj = namespace[part]
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    function = inspect.unwrap(obj) if callable(obj) else obj
    if not isinstance(function, types.FunctionType):
        raise PatchError(patch.name, patch.target, f"it is a {type(function).__name__}, not a Python function")
    stack = _swapped.get(id(function))
    code = stack[0].saved[0] if stack else function.__code__
    same_file = os.path.realpath(code.co_filename) == os.path.realpath(source.path)
    if not same_file or not source.first_line <= code.co_firstlineno <= source.def_line:
        raise PatchError(patch.name, patch.target, f"at run time it is not the function defined at {source.location} "
                                                   f"(it comes from {code.co_filename}:{code.co_firstlineno}: "
                                                   "replaced, or wrapped without __wrapped__)")
    return function


def resolve_reference(patch: PatchSpec, reference: str):
    """``package.module:function`` -> the function (importing the module)."""
    module_name, attribute = reference.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise PatchError(patch.name, patch.target, f"cannot import {module_name} for {reference}: {exc}") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PatchError(patch.name, patch.target, f"{reference}: {module_name} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PatchError(patch.name, patch.target, f"{reference} is not callable")
    return obj


def _unparse(node) -> str:
    return ast.unparse(node) + "\n"
