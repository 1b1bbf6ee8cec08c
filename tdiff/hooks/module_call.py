"""The module-call path: the process-wide hook on ``torch.nn.Module.__call__``, and one module
call run under a capture as its call site's plan says (tdiff.hooks.plan): its step, its count,
its inputs recorded before it runs and its outputs after, its ops traced (``--ops``).

One hook wraps ``torch.nn.Module.__call__`` for the whole process, so every module called
through ``__call__`` is seen with its positional and keyword arguments (torch's global pre-hooks
do not see keyword arguments). Inputs are recorded before the module runs, outputs after, so
bisect can tell "inputs matched, output did not".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tdiff.errors import TdiffError
from tdiff.hooks.active import active_capture
from tdiff.hooks.naming import flatten_call_inputs, flatten_tensors, positional_parameters, tensor_name
from tdiff.hooks.opaque import unrecorded_arguments
from tdiff.hooks.ops import OpTracer
from tdiff.hooks.plan import Where, declared_layout
from tdiff.hooks.running import UNKNOWN_LAYOUT, Frame, ThreadState, count_call

if TYPE_CHECKING:
    from tdiff.hooks.capture import Capture
    from tdiff.hooks.cuda_graphs import GraphRecording

_original_call: Callable[..., Any] | None = None


def recorded_call(capture: Capture, thread: ThreadState, module, invoke, args: tuple, kwargs: dict):
    """Run one module call (``invoke``) of ``thread``, recording it as its plan says. Every module
    call of the program comes here: a call that records nothing does as little as it can."""
    stack = thread.stack
    capture.stack_room.make_room(len(stack) + 1)
    parent = stack[-1] if stack else None
    if parent is not None and parent.compiled:
        return invoke(*args, **kwargs)  # inside compiled code (or its eager fallbacks): not recorded
    plan = capture.plans.plan(module, parent)
    compiled = plan.optimized or getattr(module, "_compiled_call_impl", None) is not None
    if plan.quiet and not compiled and parent is not None and capture.graft is None:
        # most calls of a capture with a narrow selection (and all with none): nothing to count,
        # check or record, only a frame that names where the modules it calls are called from
        stack.append(Frame(module, plan.path, plan.annotator, plan.layer, parent=parent))
        try:
            return invoke(*args, **kwargs)
        finally:
            stack.pop()
    if plan.graph_module and _compiler_graph(module):
        capture.note("torch.compile: compiled code ran; the modules it runs are not recorded "
                     "(capture without torch.compile to record them)")
        return invoke(*args, **kwargs)
    graph = capture.graphs.capturing()  # a CUDA graph's capture: its replays are the steps
    if graph is None and capture.graphs.unrecorded():
        return invoke(*args, **kwargs)
    if parent is None:
        _outermost(capture, thread, module, graph, args, kwargs)
    path = plan.path
    call = count_call(graph.calls if graph is not None else thread.calls, path)
    if capture.graft is not None:
        args, kwargs = capture.graft.inputs(path, thread.step, call, capture.running.rank(), args, kwargs)
    recording = (plan.wanted and (graph is not None or capture.selection.wants_step(thread.step))
                 and not capture.part.failed)
    described = plan.wrapped if compiled and plan.wrapped is not None else module
    layout = declared_layout(described, parent) if recording else None
    where = Where(path, described, parent, len(stack), plan.annotator, path, plan.other_layer, layout) \
        if recording or plan.traced else None
    recorder = capture.recorder
    if recording and graph is None:   # (a parameter's host copy cannot run while a graph is captured)
        capture.modules.describe(described, path, capture.running.rank(), capture.writer.part)
    unrecorded = None
    if recording:
        parameters = positional_parameters(module, len(args))
        unrecorded = unrecorded_arguments(args, kwargs, parameters)   # said on its output records
        for sub, tensor in flatten_call_inputs(args, kwargs):
            recorder.record(tensor, plan.name(sub), sub, "input", call, where,
                            bound=plan.bound_name(sub, parameters))
        recorder.launch_summaries()  # the inputs' summaries run before the module can change them
    tracer = None
    if recording and plan.traced and graph is not None:
        capture.note(f"--ops: {tensor_name(path, '')} ran in a CUDA graph: the ops of its replays are not "
                     "dispatched, so none is recorded")
    elif recording and plan.traced and capture.ops is not None:
        tracer = OpTracer(capture, capture.ops, call, where)
        if compiled:
            capture.note(f"--ops: {tensor_name(path, '')} ran eagerly: Dynamo does not compile a frame while "
                         "a dispatch mode is active, so its ops are those of the eager code")
            compiled = False  # it runs eagerly: the modules inside it are recorded as usual
    if compiled:
        capture.note(f"torch.compile: {tensor_name(path, '')} ran compiled: its inputs and outputs are "
                     "recorded, the modules inside it are not (capture without torch.compile to record them)")
    stack.append(Frame(module, path, plan.annotator, plan.layer, compiled, tracer, parent,
                       layout if recording and described is module else UNKNOWN_LAYOUT))
    try:
        if tracer is None:
            output = invoke(*args, **kwargs)
        else:
            with tracer:
                output = invoke(*args, **kwargs)
    finally:
        stack.pop()
    if recording:
        for sub, tensor in flatten_tensors(output):
            recorder.record(tensor, plan.name(sub), sub, "output", call, where, unrecorded=unrecorded)
        recorder.launch_summaries()
    if not stack:
        (graph.top_level if graph is not None else thread.top_level_done).add(id(module))
    return output


def _outermost(capture: Capture, thread: ThreadState, module, graph: GraphRecording | None,
               args: tuple, kwargs: dict) -> None:
    """An outermost call starts: maybe the next step (the next forward pass), its tokens, the
    batch whose row ``--batch-row`` keeps."""
    if graph is None and not thread.manual_steps and id(module) in thread.top_level_done:
        capture.advance_step(manual=False)
    capture.running.outermost_call()
    if graph is None:
        capture.token_recorder.of_forward(module, args, kwargs)
    row = capture.options.batch_row
    if row is not None:
        thread.batch_size = _batch_size(args, kwargs)
        if thread.batch_size and row >= thread.batch_size:
            raise TdiffError(f"--batch-row {row} is outside the batch of {thread.batch_size}")
    if graph is not None and graph.rows is None:
        graph.rows = _batch_size(args, kwargs)


_COMPILER_RUNTIME = tuple(f"{os.sep}torch{os.sep}{part}{os.sep}" for part in ("_dynamo", "_functorch", "_inductor"))


def _compiler_graph(module) -> bool:
    """Whether the module is a graph that torch.compile made and its runtime is calling (an
    ``aot_eager`` backend's forward graph, say): another program than the model's modules."""
    fx = sys.modules.get("torch.fx")
    if fx is None or not isinstance(module, fx.GraphModule):
        return False
    frame = sys._getframe(3)  # past this function, recorded_call and Capture._outside_ops
    for _ in range(8):
        if frame is None:
            return False
        if any(part in frame.f_code.co_filename for part in _COMPILER_RUNTIME):
            return True
        frame = frame.f_back
    return False


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    """The leading dimension of an outermost call's first tensor input (its batch), when > 1."""
    first = next(flatten_call_inputs(args, kwargs), None)
    if first is None or first[1].dim() == 0 or first[1].shape[0] < 2:
        return None
    return first[1].shape[0]


# ---- the process-wide hook ----
def _tdiff_module_call(self, *args, **kwargs):
    if torch.compiler.is_compiling():
        # torch.compile traces this call: stay out of the compiled program, which then is exactly
        # the one an uncaptured run compiles (and never reads capture state, no guards on it)
        return _original_call(self, *args, **kwargs)
    capture = active_capture()
    if capture is None:
        return _original_call(self, *args, **kwargs)
    return capture.module_call(self, _original_call.__get__(self), args, kwargs)


def install_call_hook() -> None:
    global _original_call
    if _original_call is None:
        _original_call = torch.nn.Module.__call__
        torch.nn.Module.__call__ = _tdiff_module_call  # type: ignore[method-assign]  # the capture hook
