"""Capture: record the inputs and outputs of every module call, in execution order.

    with tdiff.capture("dumps/a", side="a", layers="0-3"):
        model(input_ids)
        tdiff.dump("logprobs", torch.log_softmax(logits, -1))

One hook wraps ``torch.nn.Module.__call__`` for the whole process, so every module called
through ``__call__`` is seen with its positional and keyword arguments (torch's global pre-hooks
do not see keyword arguments). Inputs are recorded before the module runs, outputs after, so
bisect can tell "inputs matched, output did not". ``model=`` also wraps ``model.forward``, for
engines (SGLang) that call the root's ``forward`` directly.

Steps: a step advances when a module that already ran at the top level in this step runs at the
top level again (the next forward pass); once code calls :func:`step`, only that advances it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from importlib import metadata
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tdiff.store.dtypes import dtype_name, quantization_of
from tdiff.store.fingerprint import xxh3_fingerprint
from tdiff.store.manifest import MANIFEST_DIR, create_dump, new_part_id
from tdiff.store.record import Record
from tdiff.store.storage import STORAGES
from tdiff.store.tokens import FRAMEWORK_LAYOUTS, LAYOUTS, TokenBatch
from tdiff.store.writer import DEFAULT_MAX_PENDING, DEFAULT_SHARD_BYTES, DumpWriter, Pending

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11
from tdiff.errors import TdiffError
from tdiff.hooks.active import active_capture, set_active
from tdiff.hooks.annotations import annotate, annotating_framework, framework_of, registrations
from tdiff.hooks.claim import Claim
from tdiff.hooks.cuda_graphs import DEFAULT_GRAPH_BUDGET, GraphRecorder, install_graph_hooks
from tdiff.hooks.device import Summarizer, host_copy
from tdiff.hooks.layouts import unrecordable
from tdiff.hooks.modules import ModuleDescriber
from tdiff.hooks.naming import ModulePaths, flatten_call_inputs, flatten_tensors, positional_parameters, tensor_name
from tdiff.hooks.opaque import unrecorded_arguments
from tdiff.hooks.ops import OpRecorder, OpTracer
from tdiff.hooks.part import ProcessPart
from tdiff.hooks.running import Frame, RunningState, count_call
from tdiff.hooks.selection import Selection
from tdiff.hooks.stack_room import StackRoom
from tdiff.hooks.tokens import describe_tokens, row_tokens, token_source
from tdiff.vocab.parse import parse_ranges
from tdiff.version import __version__
from tdiff.vocab.paths import call_layer, layer_of

MODES = ("full", "stats")

_original_call: Callable[..., Any] | None = None


class _Site:
    """What every call of one module made from one place shares (its path, decoder layer, whether
    the selection wants it, who describes its records): worked out on its first call, since the
    hook runs for hundreds of module calls a forward."""

    __slots__ = ("module", "path", "layer", "other_layer", "wanted", "wrapped", "annotator", "registrations",
                 "graph_module", "_names")

    def __init__(self, module, forget, path, layer, other_layer, wanted, wrapped, annotator, graph_module):
        # weak: a site must not keep a module alive; ``forget`` drops the site with its module
        self.module = weakref.ref(module, forget)
        self.path, self.layer, self.other_layer, self.wanted = path, layer, other_layer, wanted
        self.wrapped = wrapped   # the model a torch.compile wrapper wraps (it describes the records), or None
        self.annotator = annotator
        self.registrations = registrations()   # annotators registered when it was worked out
        self.graph_module = graph_module   # a torch.fx GraphModule: maybe torch.compile's own graph
        self._names: dict[str, str] = {}   # sub -> tensor name

    def name(self, sub: str) -> str:
        """The name of this module's tensor ``sub`` (an input or an output: the name is the same)."""
        name = self._names.get(sub)
        if name is None:
            name = self._names[sub] = tensor_name(self.path, sub)
        return name


class _Seen:
    """A stored record of a tensor object, for the records of that object that may follow."""

    __slots__ = ("tensor", "version", "pending", "fingerprint")

    def __init__(self, tensor, version, pending, fingerprint):
        self.tensor, self.version = tensor, version   # weak reference, _version
        self.pending = pending            # the record's item: an alias takes its contents from it
        self.fingerprint = fingerprint    # XXH3 of the bytes stored or summarised


class Capture:
    """One process's capture into one dump directory. Use :func:`capture` to make one."""

    def __init__(self, out_dir, *, side: str | None = None, select=(), exclude=(), layers=None,
                 steps=None, mode: str = "full", storage: str = "safetensors", model=None,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, batch_row: int | None = None,
                 graft: dict | None = None, graph_budget_bytes: int = DEFAULT_GRAPH_BUDGET, ops=(),
                 force: bool = False, launched: bool = False, params: bool = False):
        if mode not in MODES:
            raise TdiffError(f"--mode {mode!r}: use one of {', '.join(MODES)}")
        if storage not in STORAGES:
            raise TdiffError(f"--format {storage!r}: use one of {', '.join(STORAGES)}")
        self.root = Path(out_dir)
        self.side = side or self.root.name
        self.mode = mode
        self.storage = storage
        self.selection = Selection(list(select), list(exclude), _ranges(layers, "--layers"),
                                   _ranges(steps, "--steps"))
        self.model = model
        # the module filters given, as the caller wrote them: said at the end when they match no module
        self._filters = " and ".join(f"{option}={value!r}" for option, value in
                                     (("select", list(select)), ("layers", layers)) if value)
        self._recorded = {"module": 0, "explicit": 0}
        self.force = force          # replace an earlier run's dump in out_dir
        self.launched = launched    # started by a command runner that holds the dump (tdiff.launch)
        self._claim: Claim | None = None
        self.max_pending_bytes = max_pending_bytes
        self.shard_bytes = shard_bytes
        if batch_row is not None and batch_row < 0:
            raise TdiffError(f"--batch-row must not be negative, not {batch_row}")
        self.batch_row = batch_row
        self.part = ProcessPart(self._new_writer)   # this process's manifest and shards
        self.running = RunningState()   # each thread's step, calls and module stack; the records' order
        self._paths = ModulePaths()
        self._sites: dict[tuple, _Site] = {}   # (id(module), where it was called from) -> its site
        self._aliases: dict[int, _Seen] = {}
        self._rank: int | None = None
        self._rank_known = False   # torch.distributed gave it: it cannot change any more
        self._summaries = Summarizer()
        self._forward_restore: Callable[[], None] | None = None
        self._graphs = GraphRecorder(self, graph_budget_bytes)   # CUDA graph capture and replays
        self._stack_room = StackRoom()   # capture's frames do not count against the program's recursion limit
        self.notes: list[str] = []   # what the dump must say about how it was recorded
        self._ops = OpRecorder([ops] if isinstance(ops, str) else ops) if ops else None
        self._pending_tokens: TokenBatch | None = None   # tdiff.tokens() given before its forward ran
        self._tokens_step: int | None = None       # the last step whose tokens were recorded
        self._modules = ModuleDescriber(self.root, params, self.note)   # each recorded module's settings (and --params)
        self._graft = None
        if graft is not None:  # bisect --graft: feed one call another run's inputs (tdiff.hooks.graft)
            from tdiff.hooks.graft import InputGraft

            self._graft = InputGraft(**graft)

    # ---- lifecycle ----
    def start(self) -> Self:
        active = active_capture()
        if active is not None:
            raise TdiffError(f"a capture into {active.root} is already active in this process")
        claim = None if self.launched else Claim(self.root, force=self.force)
        try:
            create_dump(self.root, {"side": self.side, "mode": self.mode, "storage": self.storage,
                                    "tdiff": __version__})
            if not os.access(self.root / MANIFEST_DIR, os.W_OK | os.X_OK):
                raise TdiffError(f"cannot write into dump directory {self.root}: permission denied")
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        self._claim = claim
        if self.model is not None:
            self._paths.name_tree(self.model)
            self._wrap_forward(self.model)
        _install_call_hook()
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
        if self._pending_tokens is not None and not self.part.closed:
            self._write_tokens(self._pending_tokens)  # no forward followed: they describe this step
        self._summaries.flush()
        if self._filters and not self._recorded["module"] and not self.launched:   # (tdiff capture says it itself)
            unmatched = (f"{self._filters} matched no module; recorded {self._recorded['explicit']} explicit "
                         "dump(s)")
            self.note(unmatched)
            warnings.warn(f"tdiff.capture({str(self.root)!r}): {unmatched}", stacklevel=3)
        self.part.close(error, self.notes)
        self._stack_room.give_back()
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
    def writer(self) -> DumpWriter:
        return self.part.writer

    def __exit__(self, exc_type, exc, traceback) -> None:
        succeeded = exc_type is None or (exc_type is SystemExit and exc.code in (None, 0))
        self.stop(None if succeeded else f"the captured code raised {exc_type.__name__}")

    def _new_writer(self) -> DumpWriter:
        header = {"side": self.side, "mode": self.mode, "argv": sys.argv[:16],
                  "torch": torch.__version__, "tdiff": __version__, "versions": dict(_versions())}
        try:
            return DumpWriter(self.root, new_part_id(), header, storage=self.storage,
                              max_pending_bytes=self.max_pending_bytes,
                              shard_bytes=self.shard_bytes)
        except OSError as exc:
            raise TdiffError(f"cannot write into dump directory {self.root}: {exc.strerror}") from None

    def note(self, message: str) -> None:
        """Say once, on stderr and in the dump's manifest, something a reader of the dump must know."""
        if message not in self.notes:
            self.notes.append(message)
            print(f"tdiff: {message}", file=sys.stderr, flush=True)

    def after_fork_in_child(self) -> None:
        """A forked child continues the capture into a manifest part of its own (tdiff.hooks.part)."""
        self.part.after_fork_in_child()
        self.running.after_fork_in_child()
        self._pending_tokens = None   # the parent's next forward's
        self._aliases.clear()
        self._summaries = Summarizer()

    # ---- steps ----
    def advance_step(self, *, manual: bool) -> None:
        """The calling thread's next step."""
        self.running.thread().advance(manual=manual)
        self._aliases.clear()
        if self._ops is not None:
            self._ops.clear()
        self._summaries.flush()
        self.part.flush()

    # ---- module calls ----
    @property
    def _stack(self) -> list[Frame]:
        return self.running.thread().stack

    def _outside_ops(self, work, *args):
        """Run ``work`` with the op tracer of the enclosing traced forward (capture --ops) paused:
        a child module's ops are its own, and capture's own recording runs ops that are not the
        model's."""
        stack = self._stack
        tracing = stack[-1].tracer if stack else None
        if tracing is None:
            return work(*args)
        tracing.paused += 1
        try:
            return work(*args)
        finally:
            tracing.paused -= 1

    def module_call(self, module, invoke, args, kwargs):
        output = self._outside_ops(self._module_call, module, invoke, args, kwargs)
        self._settle_if_outermost()
        return output

    def _settle_if_outermost(self) -> None:
        """In a forked child, once an outermost call or a dump outside one returns, what it
        recorded goes to disk (tdiff.hooks.part)."""
        if self.part.forked and not self._stack:
            self._summaries.flush()
            self.part.settle(self.notes)

    def _module_call(self, module, invoke, args, kwargs):
        thread = self.running.thread()
        stack = thread.stack
        self._stack_room.make_room(len(stack) + 1)
        parent = stack[-1] if stack else None
        if parent is not None and parent.compiled:
            return invoke(*args, **kwargs)  # inside compiled code (or its eager fallbacks): not recorded
        site = self._site(module, parent)
        if site.graph_module and _compiler_graph(module):
            self.note("torch.compile: compiled code ran; the modules it runs are not recorded "
                      "(capture without torch.compile to record them)")
            return invoke(*args, **kwargs)
        graph = self._graphs.capturing()  # a CUDA graph's capture: its replays are the steps
        if graph is None and self._graphs.unrecorded():
            return invoke(*args, **kwargs)
        if parent is None:
            if graph is None and not thread.manual_steps and id(module) in thread.top_level_done:
                self.advance_step(manual=False)
            if not self._rank_known:
                self._rank = None  # torch.distributed may have started since the last outermost call
            if graph is None:
                self._tokens_of_forward(module, args, kwargs)
            if self.batch_row is not None:
                thread.batch_size = _batch_size(args, kwargs)
                if thread.batch_size and self.batch_row >= thread.batch_size:
                    raise TdiffError(f"--batch-row {self.batch_row} is outside the batch of {thread.batch_size}")
            if graph is not None and graph.rows is None:
                graph.rows = _batch_size(args, kwargs)
        path = site.path
        call = count_call(graph.calls if graph is not None else thread.calls, path)
        if self._graft is not None:
            args, kwargs = self._graft.inputs(path, thread.step, call, self._current_rank(), args, kwargs)
        recording = (site.wanted and (graph is not None or self.selection.wants_step(thread.step))
                     and not self.part.failed)
        compiled = _compiled(module)
        described = site.wrapped if compiled and site.wrapped is not None else module
        where = (path, described, parent, len(stack), site.annotator, path, site.other_layer)
        if recording and graph is None:   # (a parameter's host copy cannot run while a graph is captured)
            self._modules.describe(described, path, self._current_rank(), self.writer.part)
        if recording:
            parameters = positional_parameters(module, len(args))
            unrecorded = unrecorded_arguments(args, kwargs, parameters)   # said on its output records
            for sub, tensor in flatten_call_inputs(args, kwargs):
                self._record(tensor, site.name(sub), sub, "input", call, where,
                             bound=_bound_name(site, sub, parameters))
            self._summaries.launch()  # the inputs' summaries run before the module can change them
        tracer = None
        if recording and self._ops is not None and self._ops.wants(path) and graph is not None:
            self.note(f"--ops: {tensor_name(path, '')} ran in a CUDA graph: the ops of its replays are not "
                      "dispatched, so none is recorded")
        elif recording and self._ops is not None and self._ops.wants(path):
            tracer = OpTracer(self, self._ops, call, where)
            if compiled:
                self.note(f"--ops: {tensor_name(path, '')} ran eagerly: Dynamo does not compile a frame while "
                          "a dispatch mode is active, so its ops are those of the eager code")
                compiled = False  # it runs eagerly: the modules inside it are recorded as usual
        if compiled:
            self.note(f"torch.compile: {tensor_name(path, '')} ran compiled: its inputs and outputs are "
                      "recorded, the modules inside it are not (capture without torch.compile to record them)")
        stack.append(Frame(module, path, call, site.annotator, site.layer, compiled, tracer,
                           declared_layout(module, parent)))
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
                self._record(tensor, site.name(sub), sub, "output", call, where, unrecorded=unrecorded)
            self._summaries.launch()
        if not stack:
            (graph.top_level if graph is not None else thread.top_level_done).add(id(module))
        return output

    def _site(self, module, parent: Frame | None) -> _Site:
        """The site of this call: looked up, or worked out on the module's first call from here."""
        key = (id(module), parent.path, parent.layer, parent.annotator) if parent else (id(module),)
        site = self._sites.get(key)
        if site is not None and site.module() is module and site.registrations == registrations():
            return site
        path = self._paths.path_of(module, (parent.module, parent.path) if parent else None)
        layer, other_layer = self._layer_of_call(path, parent)
        # a torch.compile wrapper's records are described (class, framework) by the model it wraps
        wrapped = getattr(module, "_orig_mod", None)
        fx = sys.modules.get("torch.fx")
        sites = self._sites

        def forget(_: weakref.ref) -> None:
            sites.pop(key, None)

        site = sites[key] = _Site(
            module, forget, path, layer, other_layer, self.selection.wants(path, layer=other_layer), wrapped,
            # a framework's annotator also describes the plain torch modules inside its models
            annotating_framework(module if wrapped is None else wrapped, parent.annotator if parent else None),
            fx is not None and isinstance(module, fx.GraphModule))
        return site

    # ---- token metadata ----
    def tokens(self, **given) -> None:
        """``tdiff.tokens``: inside a model call they describe the forward running; else the next
        outermost call's, or the current step's when an explicit dump or the capture's end comes
        first in a step no model ran in (values computed without a model). Checked at once."""
        self._outside_ops(self._tokens, given)

    def _tokens(self, given: dict) -> None:
        batch = describe_tokens(step=self.running.thread().step, rank=0, **given)
        if self._stack:
            self._write_tokens(batch)
        else:
            self._pending_tokens = batch

    def forward_replayed(self) -> None:
        """A CUDA graph's replay ran a forward: the tokens given for it describe its step (no
        model call reads them from the replayed batch)."""
        if self._pending_tokens is not None:
            self._write_tokens(self._pending_tokens)

    def _tokens_of_forward(self, module, args: tuple, kwargs: dict) -> None:
        """At an outermost call: the tokens given for it, else what its framework's source reads
        from the call (once per step)."""
        batch, self._pending_tokens = self._pending_tokens, None
        step = self.running.thread().step
        if batch is None and self._tokens_step != step:
            framework = type(getattr(module, "_orig_mod", module)).__module__.partition(".")[0]
            source = token_source(framework)
            given = source(module, args, kwargs) if source is not None else None
            if given is not None:
                batch = describe_tokens(step=step, rank=0, source=framework, **given)
        if batch is not None:
            self._write_tokens(batch)

    def _write_tokens(self, batch: TokenBatch) -> None:
        self._pending_tokens = None
        if self.batch_row is not None:
            self.note("--batch-row: token metadata is not recorded (rows are cut from the batch)")
            return
        step = self.running.thread().step
        if not self.selection.wants_step(step) or self.part.failed:
            return
        self._tokens_step = step
        self.writer.submit_tokens(dataclasses.replace(batch, step=step, rank=self._current_rank()))

    def dump(self, name: str, value, positions=None, seq_ids=None, layout=None) -> None:
        if layout not in (None, *LAYOUTS):
            raise TdiffError(f"tdiff.dump({name!r}): layout={layout!r}: use one of {', '.join(LAYOUTS)}")
        self._outside_ops(self._dump, name, value, positions, seq_ids, layout)
        self._settle_if_outermost()

    def _dump(self, name: str, value, positions=None, seq_ids=None, layout=None) -> None:
        thread = self.running.thread()
        stack = thread.stack
        parent = stack[-1] if stack else None
        graph = self._graphs.capturing()
        if graph is None and self._graphs.unrecorded():
            return
        call = count_call(graph.calls if graph is not None else thread.calls, name)
        if not ((graph is not None or self.selection.wants_step(thread.step))
                and self.selection.wants(name, explicit=True) and not self.part.failed):
            return
        if self._pending_tokens is not None and not thread.top_level_done:
            self._write_tokens(self._pending_tokens)   # no model ran in this step: they describe it
        where = (parent.path if parent else "", None, parent, len(stack), None, name, None)
        for sub, tensor in flatten_tensors(value):
            attrs = {}
            if positions is not None:
                attrs["tokens"] = row_tokens(tuple(tensor.shape), positions, seq_ids).to_json()
            if layout is not None:
                attrs["layout"] = layout
            self._record(tensor, tensor_name(name, sub), sub, "explicit", call, where, attrs)
        self._summaries.launch()

    @staticmethod
    def _layer_of_call(path: str, parent: Frame | None) -> tuple[int | None, int | None]:
        """The decoder layer this call belongs to, and that layer again where the module path
        says another (a module shared by layers: recorded as ``Record.layer``), else None."""
        layer = call_layer(path, parent.path, parent.layer) if parent else call_layer(path, None, None)
        return layer, layer if layer != layer_of(path) else None

    # ---- recording one tensor ----
    def record_op(self, tensor: torch.Tensor, name: str, sub: str, call: int, where: tuple,
                  op: dict) -> int | None:
        """An op's output inside a traced forward (tdiff.hooks.ops); returns its record's seq."""
        if self.part.failed:
            return None
        seq = self._record(tensor, name, sub, "op", call, where, op=op)
        self._summaries.launch()  # before a later op can write the tensor (an in-place op)
        return seq

    def _record(self, tensor: torch.Tensor, name: str, sub: str, role: str, call: int,
                where: tuple, explicit_attrs: dict | None = None, op: dict | None = None,
                bound: str | None = None, unrecorded: dict[str, str] | None = None) -> int | None:
        unfit = unrecordable(tensor)
        if unfit is not None:
            if not any(note.startswith(unfit) for note in self.notes):   # once a kind
                self.note(f"{unfit}: not recorded (the first: {name})")
            return None
        self._recorded["explicit" if role == "explicit" else "module"] += 1
        device = tensor.device
        module_path, module, parent, depth, annotator, counter, layer = where
        graph = self._graphs.capturing()
        thread = self.running.thread()
        seq = self.running.next_seq()
        original = tensor
        if tensor.requires_grad:
            tensor = tensor.detach()
        if thread.batch_size and tensor.dim() and tensor.shape[0] == thread.batch_size:
            tensor = tensor[self.batch_row:self.batch_row + 1]
        quantization = None
        if tensor.is_quantized:
            quantization = quantization_of(tensor)
            tensor = tensor.int_repr()
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()
        seen = self._alias_of(original, tensor) if graph is None else None
        alias_of = seen.pending.record.seq if seen is not None else None
        record = Record(
            seq=seq, name=name, module=module_path, role=role, step=thread.step, call=call, thread=thread.label,
            rank=self._current_rank(), dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape),
            sub=sub, module_class=type(module).__name__ if module is not None else None,
            parent=parent.path if parent else None, depth=depth, layer=layer, device=_device_name(device),
            alias_of=alias_of, op=op,
            attrs=(annotate(module, module_path, role, sub, tensor, annotator) if op is None else {})
            if module is not None else explicit_attrs or {})
        if quantization is not None:
            record.attrs = {**record.attrs, "quantization": quantization}
        if bound is not None:
            record.attrs = {**record.attrs, "bound": bound}
        if unrecorded is not None:
            record.attrs = {**record.attrs, "unrecorded": unrecorded}
        layout = declared_layout(module, parent) if module is not None and op is None and role != "explicit" else None
        if layout is not None and layout != FRAMEWORK_LAYOUTS.get(record.attrs.get("framework", "")):
            record.attrs = {**record.attrs, "layout": layout}   # what its framework's layout would not say
        if self._ops is not None:
            self._ops.held(original, seq)
        if graph is not None:
            graph.record(record, counter, tensor)  # into the graph's static buffers, harvested on replay
        elif seen is not None:
            self.writer.submit(Pending(record=record, original=seen.pending))
        elif self.mode == "full" and device.type == "cpu":
            # written to its shard now, summarised as it passes: no copy, and the writer's torch ops
            # would compete with the model's threads for the cores
            pending = self.writer.stream(record, tensor)
            if pending is not None:
                self._remember(original, pending, record.fingerprint)
        elif self.mode == "full":
            summary = self._summaries.snapshot_summary(tensor)  # statistics from the GPU, if it holds it
            host, ready = host_copy(tensor)
            data = host.view(tensor.dtype).reshape(tensor.shape)
            self.writer.submit(Pending(record=record, data=data, ready=ready, nbytes=host.numel(), summary=summary))
        else:
            summary = self._summaries.summarize(tensor)
            pending = Pending(record=record, summary=summary)
            self.writer.submit(pending)
            if device.type == "cpu":  # a host summary is complete at once: no wait
                self._remember(original, pending, summary.resolve(record)[1])
        return seq

    def _alias_of(self, original: torch.Tensor, tensor: torch.Tensor) -> _Seen | None:
        """An earlier record of this very tensor object whose stored bytes are still its bytes
        (``tensor`` is ``original`` as it is recorded).

        Identity and autograd's version counter only nominate the earlier record: a write through
        ``.data``, a numpy or DLPack view or a raw pointer (Triton) leaves the version as it was,
        so the bytes are checked too: their XXH3 fingerprint against that of the bytes stored or
        summarised then."""
        seen = self._aliases.get(id(original))
        if seen is None or seen.tensor() is not original or seen.version != original._version:
            return None
        # XXH3-128 reads each byte once, at memory speed (a byte-by-byte comparison is slower)
        if seen.fingerprint != xxh3_fingerprint(tensor):
            return None
        return seen

    def _remember(self, original: torch.Tensor, pending: Pending, fingerprint: str) -> None:
        """Note a submitted record of a CPU tensor whose bytes had the XXH3 ``fingerprint``, for later
        records of the same tensor object: an alias names the item it aliases, never only a seq, so
        the writer needs no table of every record (which grew with every step) and an alias another
        thread found across a step's end still resolves.
        Inference tensors carry no version counter, and a CUDA tensor's bytes could only be checked
        by one more device digest per record (its host copy or summary is still on its way when the
        next record comes): those are always stored again."""
        if original.is_inference():
            return
        key = id(original)
        aliases = self._aliases

        def forget(_: weakref.ref) -> None:
            aliases.pop(key, None)

        aliases[key] = _Seen(weakref.ref(original, forget), original._version, pending, fingerprint)

    def _current_rank(self) -> int:
        """torch.distributed's rank once it is initialised (then fixed), before that $RANK.

        Looked up once per outermost call, not per tensor."""
        if self._rank is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                self._rank, self._rank_known = dist.get_rank(), True
            else:
                self._rank = int(os.environ.get("RANK", "0"))
        return self._rank

    # ---- engines that call model.forward() directly ----
    def _wrap_forward(self, model) -> None:
        had_instance_forward = "forward" in vars(model)
        original = model.forward

        def forward(*args, **kwargs):
            stack = self._stack
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


_device_names: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    name = _device_names.get(device)
    if name is None:
        name = _device_names[device] = str(device)
    return name


def _compiled(module) -> bool:
    """Whether the module runs as torch.compile'd code (``torch.compile(module)`` or
    ``module.compile()``)."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


_COMPILER_RUNTIME = tuple(f"{os.sep}torch{os.sep}{part}{os.sep}" for part in ("_dynamo", "_functorch", "_inductor"))


def _compiler_graph(module) -> bool:
    """Whether the module is a graph that torch.compile made and its runtime is calling (an
    ``aot_eager`` backend's forward graph, say): another program than the model's modules."""
    fx = sys.modules.get("torch.fx")
    if fx is None or not isinstance(module, fx.GraphModule):
        return False
    frame = sys._getframe(3)  # past this function, _module_call and _outside_ops
    for _ in range(8):
        if frame is None:
            return False
        if any(part in frame.f_code.co_filename for part in _COMPILER_RUNTIME):
            return True
        frame = frame.f_back
    return False


def declared_layout(module, parent: Frame | None) -> str | None:
    """"seq-first" or "batch-first": what the module declares the way torch.nn does (its own
    ``batch_first``: nn.Transformer, nn.MultiheadAttention, nn.LSTM; else a direct child's: a
    TransformerEncoderLayer's self_attn), else its framework's layout (Megatron: seq-first;
    transformers: batch-first), else the enclosing call's; None where nothing says."""
    for holder in (module, *module.children()):   # read at every call: a user may declare it later
        batch_first = getattr(holder, "batch_first", None)
        if isinstance(batch_first, bool):
            return "batch-first" if batch_first else "seq-first"
    return FRAMEWORK_LAYOUTS.get(framework_of(type(module))) or (parent.layout if parent is not None else None)


def _bound_name(site, sub: str, parameters: list[str]) -> str | None:
    """The name of a positional input as if passed by keyword (``model[0]`` -> ``model[input_ids]``),
    so that a call with keywords pairs with one by position (Record.pair_key); None for a
    keyword input or one past the named parameters."""
    first, _, rest = sub.partition(".")
    if not first.isdigit() or int(first) >= len(parameters):
        return None
    return site.name(parameters[int(first)] + (f".{rest}" if rest else ""))


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    """The leading dimension of an outermost call's first tensor input (its batch), when > 1."""
    first = next(flatten_call_inputs(args, kwargs), None)
    if first is None or first[1].dim() == 0 or first[1].shape[0] < 2:
        return None
    return first[1].shape[0]


def _ranges(value, what: str):
    if value is None or isinstance(value, frozenset):
        return value
    if isinstance(value, int):
        return frozenset([value])
    if isinstance(value, (list, tuple, set)):
        return frozenset(int(v) for v in value)
    return parse_ranges(value, what)


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


def _install_call_hook() -> None:
    global _original_call
    if _original_call is None:
        _original_call = torch.nn.Module.__call__
        torch.nn.Module.__call__ = _tdiff_module_call  # type: ignore[method-assign]  # the capture hook


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
