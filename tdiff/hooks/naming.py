"""Stable names: module paths from the outermost model, sub-names for tensors in nested values.

Examples:
    >>> list(flatten_tensors((h, {"cos": c, "sin": s})))
    [('0', h), ('1.cos', c), ('1.sin', s)]
    >>> tensor_name("model.layers.0.self_attn", "0")
    'model.layers.0.self_attn[0]'
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator

import torch

from tdiff.hooks.layouts import strided_parts
from tdiff.vocab.nested import Nested, leaf_name
from tdiff.vocab.paths import ROOT_LABEL

# Per-call context objects that hold many tensors every layer receives again (SGLang's
# ForwardBatch): flattening them would record the same metadata at every module. Adapters record
# what they need from them once per step instead.
SKIPPED_TYPES = {"ForwardBatch"}

# How capture and graft walk the values of module calls and explicit dumps.
CALL_VALUES = Nested(torch.Tensor, max_depth=6, skip=SKIPPED_TYPES)


def flatten_tensors(value, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (sub-name, tensor) for every tensor in a nested value, in a stable order; a nested,
    sparse or wrapper tensor as the strided tensors it is made of (tdiff.hooks.layouts)."""
    if isinstance(value, torch.Tensor):  # most values are one tensor: no walk (capture runs this per call)
        yield from strided_parts(prefix, value)
    else:
        for sub, tensor in CALL_VALUES.leaves(value, prefix):
            yield from strided_parts(sub, tensor)


_POSITIONS = tuple(str(i) for i in range(16))


def flatten_call_inputs(args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Positional arguments are named by position, keyword arguments by keyword."""
    for i, arg in enumerate(args):
        yield from flatten_tensors(arg, _POSITIONS[i] if i < len(_POSITIONS) else str(i))
    for key, arg in kwargs.items():
        yield from flatten_tensors(arg, key)


def positional_parameters(module, count: int) -> list[str]:
    """The names of the first ``count`` parameters of ``module``'s forward that a positional
    argument binds to (stopping at ``*args``); [] where its signature cannot be read."""
    names = _positional_names.get(type(module))
    if names is None:
        try:   # the class's forward: capture may wrap the instance's (model=) in a (*args, **kwargs)
            signature = inspect.signature(type(module).forward)
        except (TypeError, ValueError, AttributeError):
            signature = None
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = []
        for parameter in list(signature.parameters.values())[1:] if signature is not None else ():   # after self
            if parameter.kind not in kinds:
                break
            names.append(parameter.name)
        _positional_names[type(module)] = names
    return names[:count]


_positional_names: dict[type, list[str]] = {}


def replace_call_inputs(args: tuple, kwargs: dict, new: Callable[[str, torch.Tensor], torch.Tensor]):
    """(args, kwargs) with each input tensor replaced by ``new(sub_name, tensor)``, named as
    :func:`flatten_call_inputs` names them."""
    return (tuple(CALL_VALUES.replace(arg, new, str(i)) for i, arg in enumerate(args)),
            {key: CALL_VALUES.replace(arg, new, key) for key, arg in kwargs.items()})


def tensor_name(module_path: str, sub: str) -> str:
    return leaf_name(module_path or ROOT_LABEL, sub)


def join_path(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent and child else parent or child


class ModulePaths:
    """Module -> path from the outermost model, learnt from ``named_modules`` of the first model
    seen calling it (or given up front)."""

    def __init__(self):
        self._paths: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def name_tree(self, root: torch.nn.Module, prefix: str = "") -> None:
        for name, module in root.named_modules(remove_duplicate=True):
            if module not in self._paths:
                self._paths[module] = join_path(prefix, name)

    def path_of(self, module: torch.nn.Module, parent: tuple[torch.nn.Module, str] | None) -> str:
        path = self._paths.get(module)
        if path is not None:
            return path
        if parent is None:
            self.name_tree(module)  # a new outermost model
        else:
            parent_module, parent_path = parent
            self.name_tree(parent_module, parent_path)  # submodules added after it was named
            if module not in self._paths:
                # a module that no parent owns (created on the fly): name it by its class
                self._paths[module] = join_path(parent_path, type(module).__name__)
        return self._paths[module]
