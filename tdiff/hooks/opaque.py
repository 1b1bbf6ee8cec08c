"""The arguments of a module call that capture does not record as tensors, so that bisect never
says "its inputs match" of a call that read them (docs/BISECT.md).

Capture records the tensors in a call's arguments, walking tuples, lists, mappings and dataclasses
(tdiff.hooks.naming). What that walk passes over is one of:

- a **setting**: None, a bool, a number, text, an enum, a dtype or device, a function or class
  (code, not data). Not listed: settings are the module's configuration, the same on every call,
  and listing them would put "not compared" on every module that takes ``eps`` or ``layer_id``.
- an **object that may carry tensors**: SGLang's ForwardBatch (with the KV cache it points at,
  skipped on purpose: tdiff.hooks.naming), a cache (transformers' DynamicCache), a module passed
  as an argument, a numpy array, any object of the user's own. Listed, by argument name.
- a container nested deeper than capture walks. Listed.

Capture stores the list on the call's output records (``attrs.unrecorded``, docs/FORMAT.md):
``{argument: why}``, the argument named as the forward's signature names it where it was passed
by position.
"""

from __future__ import annotations

import enum
import numbers
import types

import torch

from tdiff.hooks.naming import CALL_VALUES

_SETTINGS = (type(None), bool, numbers.Number, str, bytes, enum.Enum, torch.dtype, torch.device, torch.layout,
             torch.memory_format, slice, range, type, types.FunctionType, types.BuiltinFunctionType)
_NOT_WALKED = (torch.Tensor, *_SETTINGS)   # what most arguments are: recorded, or a setting


def unrecorded_arguments(args: tuple, kwargs: dict, parameters: list[str]) -> dict[str, str] | None:
    """``{argument: why}`` for the arguments of a call, or parts of them, that capture does not
    record and that may carry tensors; None when there is none. ``parameters``: the names the
    positional arguments bind to (tdiff.hooks.naming.positional_parameters)."""
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not isinstance(arg, _NOT_WALKED):
            _add(found, arg, parameters[i] if i < len(parameters) else str(i))
    for key, arg in kwargs.items():
        if not isinstance(arg, _NOT_WALKED):
            _add(found, arg, key)
    return found or None


def _add(found: dict[str, str], value: object, name: str) -> None:
    for sub, part, passed in CALL_VALUES.passed_over(value, name):
        if isinstance(part, _SETTINGS):
            continue
        found[sub] = (f"nested deeper than tdiff records ({CALL_VALUES.max_depth} levels)" if passed == "too deep"
                      else f"an object tdiff does not record: {type(part).__name__}")
