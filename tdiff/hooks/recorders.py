"""Recording one tensor: the record that describes it, and how its contents reach the dump.

:meth:`Recorder.record` makes a tensor's :class:`~tdiff.store.record.Record` (its step, call,
rank, dtype, shape, place in the model and the annotations of its framework) and picks how its
contents are kept, by where the tensor is and what is being recorded:

- **graph buffer**: inside a CUDA graph's capture, a static buffer the graph refreshes on each
  replay (tdiff.hooks.cuda_graphs);
- **alias**: the very tensor object, unchanged since an earlier record of it: that record's contents;
- **stream to shard** (full mode, a CPU tensor): written to its shard at once, summarised as it passes;
- **host copy** (full mode, a device tensor): copied to pinned host memory, written when it lands;
- **summary** (stats mode): statistics and a fingerprint, computed on the tensor's device.

Each hands the part's writer (the sink) a :class:`~tdiff.store.writer.Pending` item.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from tdiff.hooks.annotations import annotate
from tdiff.hooks.device import Summarizer, host_copy
from tdiff.hooks.layouts import unrecordable
from tdiff.hooks.plan import Where
from tdiff.store.dtypes import dtype_name, quantization_of
from tdiff.store.fingerprint import xxh3_fingerprint
from tdiff.store.record import Record
from tdiff.store.tokens import FRAMEWORK_LAYOUTS
from tdiff.store.writer import Pending

if TYPE_CHECKING:
    from tdiff.hooks.capture import Capture


class _Seen:
    """A stored record of a tensor object, for the records of that object that may follow."""

    __slots__ = ("tensor", "version", "pending", "fingerprint")

    def __init__(self, tensor, version, pending, fingerprint):
        self.tensor, self.version = tensor, version   # weak reference, _version
        self.pending = pending            # the record's item: an alias takes its contents from it
        self.fingerprint = fingerprint    # XXH3 of the bytes stored or summarised


class Recorder:
    """Records the tensors of one capture in this process."""

    def __init__(self, capture: Capture):
        self._capture = capture
        self.counts = {"module": 0, "explicit": 0}   # tensors recorded, of module calls and explicit dumps
        self.summaries = Summarizer()   # the statistics of stats mode and of snapshots, launched in batches
        self._aliases: dict[int, _Seen] = {}

    def new_step(self) -> None:
        """Records never alias across steps; the summaries launched go to the host."""
        self._aliases.clear()
        self.summaries.flush()

    def after_fork_in_child(self) -> None:
        self._aliases.clear()
        self.summaries = Summarizer()

    def launch_summaries(self) -> None:
        """Launch the summaries queued so far, eager or inside the CUDA graph this thread captures
        (called once a module call's inputs, or its outputs, are all recorded: before a later
        kernel can change them)."""
        self.summaries.launch()
        graph = self._capture.graphs.capturing()
        if graph is not None:
            graph.launch()

    def record(self, tensor: torch.Tensor, name: str, sub: str, role: str, call: int,
               where: Where, explicit_attrs: dict | None = None, op: dict | None = None,
               bound: str | None = None, unrecorded: dict[str, str] | None = None) -> int | None:
        """Record ``tensor``; returns its record's seq (None: not recordable, the dump says so)."""
        capture = self._capture
        unfit = unrecordable(tensor)
        if unfit is not None:
            if not any(note.startswith(unfit) for note in capture.notes):   # once a kind
                capture.note(f"{unfit}: not recorded (the first: {name})")
            return None
        self.counts["explicit" if role == "explicit" else "module"] += 1
        device = tensor.device
        module_path, module, parent, depth, annotator, counter, layer, layout = where
        graph = capture.graphs.capturing()
        thread = capture.running.thread()
        seq = capture.running.next_seq()
        original = tensor
        if tensor.requires_grad:
            tensor = tensor.detach()
        if thread.batch_size and tensor.dim() and tensor.shape[0] == thread.batch_size:
            row = capture.options.batch_row
            tensor = tensor[row:row + 1]
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
            rank=capture.running.rank(), dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape),
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
        if layout is not None and layout != FRAMEWORK_LAYOUTS.get(record.attrs.get("framework", "")):
            record.attrs = {**record.attrs, "layout": layout}   # what its framework's layout would not say
        if capture.ops is not None:
            capture.ops.held(original, seq)
        if graph is not None:
            graph.record(record, counter, tensor)  # into the graph's static buffers, harvested on replay
        elif seen is not None:
            capture.writer.submit(Pending(record=record, original=seen.pending))   # an alias
        elif capture.options.mode == "full" and device.type == "cpu":
            self._stream_to_shard(record, tensor, original)
        elif capture.options.mode == "full":
            self._host_copy(record, tensor)
        else:
            self._summary(record, tensor, original, device.type == "cpu")
        return seq

    def _stream_to_shard(self, record: Record, tensor: torch.Tensor, original: torch.Tensor) -> None:
        """Written to its shard now, summarised as it passes: no copy, and the writer's torch ops
        would compete with the model's threads for the cores."""
        pending = self._capture.writer.stream(record, tensor)
        if pending is not None:
            self._remember(original, pending, record.fingerprint)

    def _host_copy(self, record: Record, tensor: torch.Tensor) -> None:
        """A device tensor: copied to pinned host memory, written once the copy lands."""
        summary = self.summaries.snapshot_summary(tensor)  # statistics from the GPU, if it holds it
        host, ready = host_copy(tensor)
        data = host.view(tensor.dtype).reshape(tensor.shape)
        self._capture.writer.submit(Pending(record=record, data=data, ready=ready, nbytes=host.numel(),
                                            summary=summary))

    def _summary(self, record: Record, tensor: torch.Tensor, original: torch.Tensor, on_host: bool) -> None:
        """Stats mode: statistics and a fingerprint, computed on the tensor's device."""
        summary = self.summaries.summarize(tensor)
        pending = Pending(record=record, summary=summary)
        self._capture.writer.submit(pending)
        if on_host:  # a host summary is complete at once: no wait
            self._remember(original, pending, summary.fingerprint)

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


_device_names: dict[torch.device, str] = {}


def _device_name(device: torch.device) -> str:
    name = _device_names.get(device)
    if name is None:
        name = _device_names[device] = str(device)
    return name
