"""The plan of a call site: what every call of one module made from one place shares, worked out
on its first call, since the module-call hook runs for hundreds of module calls a forward.

A :class:`CallPlan` says what to do with such a call: whether the selection records it, whether
``--ops`` traces its ops, which framework's annotator describes its records, what its tensors are
named, and whether it is a torch.fx graph (maybe torch.compile's own). :class:`CallPlans` keeps the
plans of one capture. A :class:`Where` says where each record of a call is made.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tdiff.hooks.annotations import annotating_framework, framework_of, registrations
from tdiff.hooks.naming import ModulePaths, tensor_name
from tdiff.hooks.running import UNKNOWN_LAYOUT
from tdiff.store.tokens import FRAMEWORK_LAYOUTS
from tdiff.vocab.paths import call_layer, layer_of

if TYPE_CHECKING:
    from tdiff.hooks.ops import OpRecorder
    from tdiff.hooks.running import Frame
    from tdiff.hooks.selection import Selection


class Where(NamedTuple):
    """Where the records of one call (or one explicit dump, or one op) are made."""

    path: str                 # the module's path ("" outside any module call)
    module: Any               # the module that describes the records (None for an explicit dump)
    parent: Any               # the enclosing call's Frame (an op's: its module), or None
    depth: int                # how many module calls enclose the record
    annotator: str | None     # the framework whose annotator describes the records
    counter: str | None       # what the call was counted under: the module path or the dump's name
    layer: int | None         # the decoder layer, where the module path says another (Record.layer)
    layout: str | None = None  # the module's declared layout (declared_layout), worked out once a call;
    #                            None for an explicit dump's and an op's records


class CallPlan:
    """One call site's plan: the calls of one module from one place (the same enclosing path,
    decoder layer and annotator)."""

    __slots__ = ("module", "path", "layer", "other_layer", "wanted", "traced", "wrapped", "annotator",
                 "registrations", "graph_module", "optimized", "quiet", "_names")

    def __init__(self, module, forget: Callable[[weakref.ref], None], path: str, layer: int | None,
                 other_layer: int | None, wanted: bool, traced: bool, wrapped, annotator: str | None,
                 graph_module: bool, counted: bool):
        # weak: a plan must not keep a module alive; ``forget`` drops the plan with its module
        self.module = weakref.ref(module, forget)
        self.path = path
        self.layer = layer               # the decoder layer this call belongs to
        self.other_layer = other_layer   # that layer again where the module path says another, else None
        self.wanted = wanted             # the selection records its calls (in the steps it wants)
        self.traced = traced             # --ops records the ATen ops of its forward
        self.wrapped = wrapped   # the model a torch.compile wrapper wraps (it describes the records), or None
        self.annotator = annotator
        self.registrations = registrations()   # annotators registered when it was worked out
        self.graph_module = graph_module   # a torch.fx GraphModule: maybe torch.compile's own graph
        dynamo = sys.modules.get("torch._dynamo.eval_frame")
        # torch.compile(module)'s wrapper (module.compile() sets _compiled_call_impl instead, at any time)
        self.optimized = dynamo is not None and isinstance(module, dynamo.OptimizedModule)
        # no call of its path is ever recorded (so none is counted) or traced, and it is no fx graph:
        # unless compiled, such a call only says where the modules it calls are called from (module_call)
        self.quiet = not counted and not traced and not graph_module
        self._names: dict[str, str] = {}   # sub -> tensor name

    def name(self, sub: str) -> str:
        """The name of this module's tensor ``sub`` (an input or an output: the name is the same)."""
        name = self._names.get(sub)
        if name is None:
            name = self._names[sub] = tensor_name(self.path, sub)
        return name

    def bound_name(self, sub: str, parameters: list[str]) -> str | None:
        """The name of a positional input as if passed by keyword (``model[0]`` -> ``model[input_ids]``),
        so that a call with keywords pairs with one by position (Record.pair_key); None for a
        keyword input or one past the named parameters."""
        first, _, rest = sub.partition(".")
        if not first.isdigit() or int(first) >= len(parameters):
            return None
        return self.name(parameters[int(first)] + (f".{rest}" if rest else ""))


class CallPlans:
    """The plans of one capture's call sites, and the module paths they are named by."""

    def __init__(self, selection: Selection, ops: OpRecorder | None):
        self._selection = selection
        self._ops = ops
        self._paths = ModulePaths()
        self._plans: dict[tuple, CallPlan] = {}   # (id(module), where it was called from) -> its plan

    def name_tree(self, model) -> None:
        """Name the modules of ``model`` by their paths from it (``model=``)."""
        self._paths.name_tree(model)

    def plan(self, module, parent: Frame | None) -> CallPlan:
        """The plan of this call: looked up, or worked out on the module's first call from here."""
        key = (id(module), parent.path, parent.layer, parent.annotator) if parent else (id(module),)
        plan = self._plans.get(key)
        if plan is not None and plan.module() is module and plan.registrations == registrations():
            return plan
        path = self._paths.path_of(module, (parent.module, parent.path) if parent else None)
        layer = call_layer(path, parent.path, parent.layer) if parent else call_layer(path, None, None)
        other_layer = layer if layer != layer_of(path) else None
        # a torch.compile wrapper's records are described (class, framework) by the model it wraps
        wrapped = getattr(module, "_orig_mod", None)
        fx = sys.modules.get("torch.fx")
        plans = self._plans

        def forget(_: weakref.ref) -> None:
            plans.pop(key, None)

        plan = plans[key] = CallPlan(
            module, forget, path, layer, other_layer, self._selection.wants(path, layer=other_layer),
            self._ops is not None and self._ops.wants(path), wrapped,
            # a framework's annotator also describes the plain torch modules inside its models
            annotating_framework(module if wrapped is None else wrapped, parent.annotator if parent else None),
            fx is not None and isinstance(module, fx.GraphModule), self._selection.may_want(path))
        return plan


def declared_layout(module, parent: Frame | None) -> str | None:
    """"seq-first" or "batch-first": what the module declares the way torch.nn does (its own
    ``batch_first``: nn.Transformer, nn.MultiheadAttention, nn.LSTM; else a direct child's: a
    TransformerEncoderLayer's self_attn), else its framework's layout (Megatron: seq-first;
    transformers: batch-first), else the enclosing call's; None where nothing says."""
    batch_first = _batch_first(module)   # read at every call: a user may declare it later
    if batch_first is None:
        for child in module._modules.values():
            batch_first = _batch_first(child) if child is not None else None
            if batch_first is not None:
                break
    if batch_first is not None:
        return "batch-first" if batch_first else "seq-first"
    return FRAMEWORK_LAYOUTS.get(framework_of(type(module))) or (frame_layout(parent) if parent is not None else None)


def frame_layout(frame: Frame) -> str | None:
    """The layout a running call's module declares (:func:`declared_layout`), worked out when a
    record of the call or of a call inside it first asks: a call that records nothing (most of
    them, under a narrow selection) then costs nothing for it."""
    if frame.layout == UNKNOWN_LAYOUT:
        frame.layout = declared_layout(frame.module, frame.parent)
    return frame.layout


def _batch_first(holder) -> bool | None:
    """``holder.batch_first`` where it is a bool. Read where nn.Module keeps a plain attribute (its
    instance dict) and, only where the class defines one or looks attributes up itself (a wrapper's
    ``__getattr__`` that forwards them), through ``getattr``: for a name a module lacks that goes
    through nn.Module.__getattr__ and an exception, ~5 us a module, at every module call."""
    value = holder.__dict__.get("batch_first")
    if value is None:
        cls = type(holder)
        if getattr(cls, "batch_first", None) is not None or cls.__getattr__ is not _MODULE_GETATTR:
            value = getattr(holder, "batch_first", None)
    return value if isinstance(value, bool) else None


_MODULE_GETATTR = torch.nn.Module.__getattr__
