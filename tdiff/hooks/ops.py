"""Op records: every ATen op inside the forward of the modules ``capture(ops=REGEX)`` selects.

    with tdiff.capture("dumps/a", ops=r"^model\\.layers\\.1\\.self_attn$"):
        model(input_ids)

While a selected module's forward runs, a ``TorchDispatchMode`` (as ``torch.utils._debug_mode``
traces) sees each ATen op and records its output as a record of role ``op``: the op's name
(``aten::mul.Tensor``), its index within the call, the innermost Python function outside torch
and tdiff that called it (or the module's forward, for torch's own modules) and its ``file:line``, and its tensor inputs as the ``seq`` of the
records that hold their values (an earlier op's output, the module's input, a child's output;
null for a tensor nothing recorded, such as a parameter). Nothing is copied for an input.

- Ops inside a child module are left to that module: the tracer pauses while a child runs (and
  while capture itself records a tensor, whose own ops are not the model's).
- An in-place op's output is the mutated tensor, recorded after the op (a snapshot); its inputs
  refer to the records of the values before the op.
- Limits: a fused op (SDPA) is one op; a raw Triton launch bypasses the dispatcher; the ops of a
  CUDA-graph replay are not dispatched (no tracer runs while a graph is captured); Dynamo does
  not compile a frame while a dispatch mode is active, so a compiled module runs eagerly when
  traced (the capture says so in a note).
"""

from __future__ import annotations

import os
import sys
import weakref
from itertools import chain
from types import FrameType
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tdiff.hooks.naming import flatten_tensors, tensor_name
from tdiff.vocab.parse import compile_patterns

if TYPE_CHECKING:
    from tdiff.hooks.plan import Where

# frames of these packages are not "the model's code": torch's Python layers (functional,
# Tensor methods, dispatch) and tdiff's own
_LIBRARY_DIRS = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (torch, sys.modules["tdiff"]))


class OpRecorder:
    """What one capture needs for op records: which module paths are traced, and which record
    holds each tensor's current value (for the ``inputs`` of the ops that read it)."""

    def __init__(self, patterns):
        self.patterns = compile_patterns(list(patterns), "--ops")
        self._wanted: dict[str, bool] = {}
        self._holders: dict[int, tuple[weakref.ref, int | None, int]] = {}  # id -> (tensor, version, seq)

    def wants(self, path: str) -> bool:
        wanted = self._wanted.get(path)
        if wanted is None:
            wanted = self._wanted[path] = any(p.search(path) for p in self.patterns)
        return wanted

    def held(self, tensor: torch.Tensor, seq: int, written: bool = False) -> None:
        """Record ``seq`` holds ``tensor``'s value as it is now. ``written``: an op inside a traced
        forward has just written it, and autograd bumps its version once that op returns."""
        key = id(tensor)
        holders = self._holders

        def forget(_: weakref.ref) -> None:
            holders.pop(key, None)

        version = _version(tensor)
        if written and version is not None:
            version += 1
        holders[key] = (weakref.ref(tensor, forget), version, seq)

    def holder(self, tensor: torch.Tensor) -> int | None:
        """The seq of the record holding ``tensor``'s current value, or None."""
        held = self._holders.get(id(tensor))
        if held is None or held[0]() is not tensor or held[1] != _version(tensor):
            return None
        return held[2]

    def clear(self) -> None:
        """A new step: references never cross steps."""
        self._holders.clear()


def _version(tensor: torch.Tensor) -> int | None:
    """Autograd's version counter; None for an inference tensor, which has none (its in-place
    ops inside a traced forward are still seen, and update the holder themselves)."""
    return None if tensor.is_inference() else tensor._version


class OpTracer(TorchDispatchMode):
    """Records the ops of one call of a traced module; ``paused`` while a child module runs."""

    def __init__(self, capture, recorder: OpRecorder, call: int, where: Where):
        super().__init__()
        self.capture, self.recorder, self.call = capture, recorder, call
        path, module = where.path, where.module
        # an op runs inside the module: the module is its parent, one level deeper; its records
        # declare no layout (their tensors are the op's, not the module's inputs or outputs)
        self.where = where._replace(parent=_Enclosing(path), depth=where.depth + 1, counter=None, layout=None)
        self.base = tensor_name(path, "")
        # the module's own forward is where its ops are, also for a torch module (nn.Linear)
        forward = getattr(module, "forward", None)
        self.forward_code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        self.index = 0
        self.paused = 0
        # the module's parameters and buffers by identity: an op input no record holds is named
        self.state = {id(t): name for name, t in chain(module.named_parameters(), module.named_buffers())} \
            if module is not None else {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused or types:  # a child's or capture's own op; a tensor subclass's (DTensor, fake)
            return func(*args, **kwargs)
        holder = self.recorder.holder
        tensors = [t for _, t in flatten_tensors((args, kwargs))]
        inputs = [holder(t) for t in tensors]
        output = func(*args, **kwargs)
        index = self.index
        self.index += 1
        function, source = _caller(self.forward_code)
        op = {"name": func.name(), "index": index, "function": function, "source": source, "inputs": inputs}
        state = [self.state.get(id(t)) for t in tensors]
        if any(state):
            op["state"] = state   # per input, the parameter or buffer of the module it is, else null
        name = f"{self.base}#{index}"
        written = _written(func, args, kwargs)
        for sub, tensor in flatten_tensors(output):
            seq = self.capture.record_op(tensor, tensor_name(name, sub), sub, self.call, self.where, op)
            if seq is not None and id(tensor) in written:
                self.recorder.held(tensor, seq, written=True)
        return output


def _written(func, args: tuple, kwargs: dict) -> set[int]:
    """The ids of the tensors an in-place or ``out=`` op writes."""
    schema = func._schema
    if not schema.is_mutable:
        return set()
    written: set[int] = set()
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name, args[position] if position < len(args) else None)
        written.update(id(t) for _, t in flatten_tensors(value))
    return written


class _Enclosing:
    """The traced module's call, as an op record's ``parent`` names it."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path


def _caller(forward_code) -> tuple[str, str]:
    """The innermost Python frame outside torch and tdiff, or the traced module's forward (which
    torch's own modules have inside torch): its function and ``file:line``."""
    frame: FrameType | None = sys._getframe(2)
    while (frame is not None and frame.f_code is not forward_code
           and frame.f_code.co_filename.startswith(_LIBRARY_DIRS)):
        frame = frame.f_back
    if frame is None:
        return "", ""
    return frame.f_code.co_name, f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
