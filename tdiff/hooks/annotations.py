"""Record annotations: metadata a framework attaches to the records of its modules (``attrs``).

Every module record carries ``attrs["framework"]``, the top-level package its class comes from
(``transformers``, ``megatron``, ``sglang``, ``torch``), so that alignment can pick an adapter
from the model's classes (HF and SGLang share class names such as ``Qwen2DecoderLayer``).

An annotator adds what only the running process knows, such as tensor-parallel ranks and how a
tensor is sharded. Annotators are registered per framework, as a callable or as a lazily
imported ``"module:function"`` so that capture never imports a framework the program does not
use (those of megatron-core and SGLang are built in: tdiff/hooks/frameworks/)::

    register("myframework", "myframework.tdiff_support:annotate")

    def annotate(module, path, role, sub, tensor) -> dict | None: ...

``path`` is the module's path from the outermost model, ``role`` is ``input`` or ``output``,
``sub`` the tensor's place in the call's arguments or result (``"0"``, ``"hidden_states"``). The
returned keys are merged into the record's ``attrs``.
"""

from __future__ import annotations

import importlib
import sys
import weakref
from collections.abc import Callable

from tdiff.hooks.frameworks import ANNOTATORS

Annotator = Callable[..., "dict | None"]

_registered: dict[str, Annotator | str] = dict(ANNOTATORS)
_resolved: dict[str, Annotator | None] = {}
_frameworks: dict[type, str] = {}
_registrations = 0


def register(framework: str, annotator: Annotator | str) -> None:
    """Use ``annotator`` for the records of modules whose class comes from ``framework``, from
    their next call on (also inside a running capture)."""
    global _registrations
    _registered[framework] = annotator
    _resolved.pop(framework, None)
    _registrations += 1


def registrations() -> int:
    """How many times :func:`register` ran: a capture works out its calls' annotators again when
    this changes."""
    return _registrations


def framework_of(module_type: type) -> str:
    framework = _frameworks.get(module_type)
    if framework is None:
        framework = _frameworks[module_type] = (module_type.__module__ or "").split(".")[0]
    return framework


def annotator_for(framework: str) -> Annotator | None:
    if framework in _resolved:
        return _resolved[framework]
    target = _registered.get(framework)
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # noqa: BLE001 - an annotator must never break the captured program
            print(f"tdiff: annotator {module_name}:{attr} unavailable ({exc}); "
                  f"{framework} records carry no parallel metadata", file=sys.stderr)
            target = None
    _resolved[framework] = target
    return target


def annotating_framework(module, parent: str | None) -> str | None:
    """The framework whose annotator describes a call: the module's own when it has one, else
    the enclosing call's (a torch.nn.RMSNorm inside a Megatron layer is annotated by Megatron)."""
    own = framework_of(type(module))
    return own if annotator_for(own) is not None else parent


MAX_STATE_NAMES = 32
_state_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def state_names(module) -> list[str]:
    """The parameters and buffers a module's call may read (its own and its submodules'), which
    capture does not record: bisect lists them as inputs it did not compare. At most
    MAX_STATE_NAMES, then "N more"."""
    names = _state_names.get(module)
    if names is None:
        found = [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_buffers()]
        names = found[:MAX_STATE_NAMES] + ([f"{len(found) - MAX_STATE_NAMES} more"] if len(found) > MAX_STATE_NAMES
                                           else [])
        _state_names[module] = names
    return names


def annotate(module, path: str, role: str, sub: str, tensor, annotating: str | None) -> dict:
    """The attrs of one module record: the framework its class comes from, plus what the
    annotating framework's annotator adds."""
    framework = framework_of(type(module))
    attrs: dict = {"framework": framework}
    if role == "output":
        state = state_names(module)
        if state:
            attrs["state"] = state
    if not annotating:
        return attrs
    annotator = annotator_for(annotating)
    if annotator is not None:
        try:
            extra = annotator(module, path, role, sub, tensor)
        except Exception as exc:  # noqa: BLE001 - never break the captured program
            print(f"tdiff: the {annotating} annotator failed ({type(exc).__name__}: {exc}); "
                  f"{annotating} records from here on carry no parallel metadata", file=sys.stderr)
            _resolved[annotating] = None
            extra = None
        if extra:
            attrs.update(extra)
    return attrs
