"""Capture: record the inputs and outputs of every module call, in execution order.

    with tdiff.capture("dumps/a", side="a", layers="0-3"):
        model(input_ids)
        tdiff.dump("logprobs", torch.log_softmax(logits, -1))

:class:`Capture` owns one process's capture into one dump directory and its parts: the running
state (tdiff.hooks.running), the process's part of the dump (tdiff.hooks.part), the plans of its
call sites (tdiff.hooks.plan), its recorders (tdiff.hooks.recorders), its token metadata
(tdiff.hooks.tokens) and its CUDA graphs (tdiff.hooks.cuda_graphs); the module-call path is
tdiff.hooks.module_call. ``model=`` also wraps ``model.forward``, for engines (SGLang) that call
the root's ``forward`` directly.

Steps: a step advances when a module that already ran at the top level in this step runs at the
top level again (the next forward pass); once code calls :func:`step`, only that advances it.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tdiff.capture_options import DEFAULTS, CaptureOptions
from tdiff.errors import TdiffError
from tdiff.hooks.active import active_capture, set_active
from tdiff.hooks.claim import Claim
from tdiff.hooks.cuda_graphs import GraphRecorder, install_graph_hooks
from tdiff.hooks.module_call import install_call_hook, recorded_call
from tdiff.hooks.modules import ModuleDescriber
from tdiff.hooks.naming import flatten_tensors, tensor_name
from tdiff.hooks.ops import OpRecorder
from tdiff.hooks.part import ProcessPart, Sink
from tdiff.hooks.plan import CallPlans, Where
from tdiff.hooks.recorders import Recorder
from tdiff.hooks.running import RunningState, count_call
from tdiff.hooks.selection import Selection
from tdiff.hooks.stack_room import StackRoom
from tdiff.hooks.tokens import TokenRecorder, row_tokens
from tdiff.store.manifest import MANIFEST_DIR, create_dump, new_part_id
from tdiff.store.tokens import LAYOUTS
from tdiff.store.writer import DumpWriter
from tdiff.version import __version__

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11



class Capture:
    """One process's capture into one dump directory. Use :func:`capture` to make one."""

    def __init__(self, out_dir, options: CaptureOptions = DEFAULTS, *, model=None,
                 graft: dict | None = None, launched: bool = False):
        self.root = Path(out_dir)
        self.options = options
        self.side = options.side_of(self.root)
        self.selection = Selection(list(options.select), list(options.exclude), options.layer_set(),
                                   options.step_set())
        self.model = model
        # the module filters given, as the caller wrote them: said at the end when they match no module
        self._filters = " and ".join(f"{option}={value!r}" for option, value in
                                     (("select", list(options.select)), ("layers", options.layers)) if value)
        self.launched = launched    # started by a command runner that holds the dump (tdiff.launch)
        self._claim: Claim | None = None
        self.part = ProcessPart(self._new_writer)   # this process's manifest and shards
        self.running = RunningState()   # each thread's step, calls and module stack; the records' order
        self.ops = OpRecorder(options.ops) if options.ops else None   # --ops
        self.plans = CallPlans(self.selection, self.ops)   # what to do with each call site's calls
        self.recorder = Recorder(self)   # records each tensor
        self.token_recorder = TokenRecorder(self)   # each forward's token metadata
        self._forward_restore: Callable[[], None] | None = None
        self.graphs = GraphRecorder(self, options.graph_budget_bytes)   # CUDA graph capture and replays (its hooks')
        # capture's frames do not count against the program's recursion limit
        self.stack_room = StackRoom()
        self.notes: list[str] = []   # what the dump must say about how it was recorded
        self.modules = ModuleDescriber(self.root, options.params, self.note)   # each recorded module's settings (and --params)
        self.graft = None
        if graft is not None:  # bisect --graft: feed one call another run's inputs (tdiff.hooks.graft)
            from tdiff.hooks.graft import InputGraft

            self.graft = InputGraft(**graft)

    # ---- lifecycle ----
    def start(self) -> Self:
        active = active_capture()
        if active is not None:
            raise TdiffError(f"a capture into {active.root} is already active in this process")
        claim = None if self.launched else Claim(self.root, force=self.options.force)
        try:
            create_dump(self.root, {"side": self.side, "mode": self.options.mode, "storage": self.options.storage,
                                    "tdiff": __version__})
            if not os.access(self.root / MANIFEST_DIR, os.W_OK | os.X_OK):
                raise TdiffError(f"cannot write into dump directory {self.root}: permission denied")
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        self._claim = claim
        if self.model is not None:
            self.plans.name_tree(self.model)
            self._wrap_forward(self.model)
        install_call_hook()
        install_graph_hooks()
        set_active(self)
        return self

    def stop(self, error: str | None = None) -> None:
        """End the capture; ``error`` says why the captured code failed (the dump is then incomplete)."""
        if active_capture() is self:
            set_active(None)
        if self._forward_restore is not None:
            self._forward_restore()
            self._forward_restore = None
        if not self.part.closed:
            self.token_recorder.write_pending()  # no forward followed: they describe this step
        self.recorder.summaries.flush()
        counts = self.recorder.counts
        if self._filters and not counts["module"] and not self.launched:   # (tdiff capture says it itself)
            unmatched = f"{self._filters} matched no module; recorded {counts['explicit']} explicit dump(s)"
            self.note(unmatched)
            warnings.warn(f"tdiff.capture({str(self.root)!r}): {unmatched}", stacklevel=3)
        self.modules.finish()
        self.part.close(error, self.notes)
        self.stack_room.give_back()
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def terminated(self, reason: str) -> None:
        """SIGTERM: the part ends as failed (what the process computed may be cut short), except
        between model calls where nothing was recorded (no part), or in a forked child (a pool's
        idle worker, which its pool ends so: its part is settled, all it recorded there)."""
        if self.running.busy() or (self.part.opened is not None and not self.part.forked):
            self.stop(reason)
        elif active_capture() is self:
            set_active(None)

    def __enter__(self) -> Self:
        return self.start()

    @property
    def writer(self) -> Sink:
        """The sink of this process's part (its DumpWriter), opened at its first use."""
        return self.part.writer

    def __exit__(self, exc_type, exc, traceback) -> None:
        succeeded = exc_type is None or (exc_type is SystemExit and exc.code in (None, 0))
        self.stop(None if succeeded else f"the captured code raised {exc_type.__name__}")

    def _new_writer(self) -> DumpWriter:
        options = self.options
        header = {"side": self.side, "mode": options.mode, "argv": sys.argv[:16],
                  "torch": torch.__version__, "tdiff": __version__, "versions": dict(_versions())}
        try:
            return DumpWriter(self.root, new_part_id(), header, storage=options.storage,
                              max_pending_bytes=options.max_pending_bytes, shard_bytes=options.shard_bytes)
        except OSError as exc:
            raise TdiffError(f"cannot write into dump directory {self.root}: {exc.strerror}") from None

    def flush_summaries(self) -> None:
        """Send the statistics launched on a device so far to the host (before a CUDA graph's capture)."""
        self.recorder.summaries.flush()

    def note(self, message: str) -> None:
        """Say once, on stderr and in the dump's manifest, something a reader of the dump must know."""
        if message not in self.notes:
            self.notes.append(message)
            print(f"tdiff: {message}", file=sys.stderr, flush=True)

    def after_fork_in_child(self) -> None:
        """A forked child continues the capture into a manifest part of its own (tdiff.hooks.part)."""
        self.part.after_fork_in_child()
        self.running.after_fork_in_child()
        self.token_recorder.pending = None   # the parent's next forward's
        self.recorder.after_fork_in_child()
        self.modules.after_fork_in_child()

    # ---- steps ----
    def advance_step(self, *, manual: bool) -> None:
        """The calling thread's next step."""
        self.running.thread().advance(manual=manual)
        self.recorder.new_step()
        if self.ops is not None:
            self.ops.clear()
        self.part.flush()

    # ---- module calls ----
    def _outside_ops(self, work, *args):
        """Run ``work`` with the op tracer of the enclosing traced forward (capture --ops) paused:
        a child module's ops are its own, and capture's own recording runs ops that are not the
        model's."""
        stack = self.running.thread().stack
        tracing = stack[-1].tracer if stack else None
        if tracing is None:
            return work(*args)
        tracing.paused += 1
        try:
            return work(*args)
        finally:
            tracing.paused -= 1

    def module_call(self, module, invoke, args, kwargs):
        # _outside_ops and _settle_if_outermost, inlined: this runs at every module call
        thread = self.running.thread()
        stack = thread.stack
        tracing = stack[-1].tracer if stack else None
        if tracing is None:
            output = recorded_call(self, thread, module, invoke, args, kwargs)
        else:
            tracing.paused += 1
            try:
                output = recorded_call(self, thread, module, invoke, args, kwargs)
            finally:
                tracing.paused -= 1
        if not stack and self.part.forked:
            self.recorder.summaries.flush()
            self.part.settle(self.notes)
        return output

    def _settle_if_outermost(self) -> None:
        """In a forked child, once an outermost call or a dump outside one returns, what it
        recorded goes to disk (tdiff.hooks.part)."""
        if self.part.forked and not self.running.thread().stack:
            self.recorder.summaries.flush()
            self.part.settle(self.notes)

    # ---- token metadata ----
    def tokens(self, **given) -> None:
        """``tdiff.tokens`` (tdiff.hooks.tokens.TokenRecorder.given)."""
        self._outside_ops(self.token_recorder.given, given)

    def forward_replayed(self) -> None:
        """A CUDA graph's replay ran a forward: the tokens given for it describe its step (no
        model call reads them from the replayed batch)."""
        self.token_recorder.write_pending()

    # ---- explicit dumps and op records ----
    def dump(self, name: str, value, positions=None, seq_ids=None, layout=None) -> None:
        if layout not in (None, *LAYOUTS):
            raise TdiffError(f"tdiff.dump({name!r}): layout={layout!r}: use one of {', '.join(LAYOUTS)}")
        self._outside_ops(self._dump, name, value, positions, seq_ids, layout)
        self._settle_if_outermost()

    def _dump(self, name: str, value, positions=None, seq_ids=None, layout=None) -> None:
        thread = self.running.thread()
        stack = thread.stack
        parent = stack[-1] if stack else None
        graph = self.graphs.capturing()
        if graph is None and self.graphs.unrecorded():
            return
        call = count_call(graph.calls if graph is not None else thread.calls, name)
        if not ((graph is not None or self.selection.wants_step(thread.step))
                and self.selection.wants(name, explicit=True) and not self.part.failed):
            return
        if not thread.top_level_done:
            self.token_recorder.write_pending()   # no model ran in this step: they describe it
        where = Where(parent.path if parent else "", None, parent, len(stack), None, name, None)
        for sub, tensor in flatten_tensors(value):
            attrs = {}
            if positions is not None:
                attrs["tokens"] = row_tokens(tuple(tensor.shape), positions, seq_ids).to_json()
            if layout is not None:
                attrs["layout"] = layout
            self.recorder.record(tensor, tensor_name(name, sub), sub, "explicit", call, where, attrs)
        self.recorder.launch_summaries()

    def record_op(self, tensor: torch.Tensor, name: str, sub: str, call: int, where: Where,
                  op: dict) -> int | None:
        """An op's output inside a traced forward (tdiff.hooks.ops); returns its record's seq."""
        if self.part.failed:
            return None
        seq = self.recorder.record(tensor, name, sub, "op", call, where, op=op)
        self.recorder.launch_summaries()  # before a later op can write the tensor (an in-place op)
        return seq

    # ---- engines that call model.forward() directly ----
    def _wrap_forward(self, model) -> None:
        had_instance_forward = "forward" in vars(model)
        original = model.forward

        def forward(*args, **kwargs):
            stack = self.running.thread().stack
            if active_capture() is not self or (stack and stack[-1].module is model):
                return original(*args, **kwargs)  # already inside model.__call__
            return self.module_call(model, original, args, kwargs)

        model.forward = forward

        def restore():
            if had_instance_forward:
                model.forward = original
            else:
                del model.forward

        self._forward_restore = restore


@functools.cache
def _versions() -> dict[str, str]:
    """Installed versions of the frameworks whose numerics a report must name: looked up once a
    process (importlib.metadata scans the installed distributions, ~10 ms every capture's start).
    Read-only: callers copy it."""
    versions = {"torch": torch.__version__, "tdiff": __version__}
    for package in ("transformers", "megatron-core", "sglang", "triton"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions
