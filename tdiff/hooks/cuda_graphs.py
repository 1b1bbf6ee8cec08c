"""CUDA graphs: record what a captured graph computes, on every replay.

While a graph is being captured a hook may not synchronise or copy to the host (that
invalidates the capture, ``cudaErrorStreamCaptureInvalidated``), and on replay no Python runs at
all. So during the capture of a ``torch.cuda.CUDAGraph`` each recorded tensor is copied
device-to-device into a static buffer that the graph itself captures (past the budget, or in
stats mode, its statistics and fingerprint are computed into a static slot instead, by the fused
kernels of stats mode, compiled before the capture). In stats mode a module call's inputs, or its
outputs, are copied where eager forwards summarise them (a copy node each), and the copies summarised
in groups on a side stream of the graph, off the model's path (a replay waits for each node on its
path in turn, and a summary's latency is several copies'). After each
replay the buffers are copied to the host on the replay's stream, ahead of anything the next
replay writes, and become the records of one step: the names, calls and bytes the eager forward
gives. A graph of statistics only (stats mode) hands the writer its whole statistics table per
replay, journaled as one line that readers expand into the records (tdiff.store.graph_replays):
no Python runs per record at a replay.

    g = torch.cuda.CUDAGraph()
    with tdiff.warmup():             # warm-up forwards: not recorded, not steps
        model(static_x)
    with torch.cuda.graph(g):        # the captured forward: not a step (nothing is computed yet)
        static_y = model(static_x)
    tdiff.graph_rows(3)              # the next replay's real rows (the batch is padded to 8)
    g.replay()                       # one step: the records of model(static_x[:3])

Graphs are seen through ``torch.cuda.CUDAGraph.capture_begin``/``capture_end``/``replay``
(``torch.cuda.graph`` and ``make_graphed_callables`` use them); an engine that replays a graph
another way calls :func:`tdiff.graph_replayed` after the replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref

import torch

from tdiff.bootstrap.imports import when_imported
from tdiff.errors import TdiffError
from tdiff.hooks.active import active_capture
from tdiff.hooks.running import ThreadState
from tdiff.hooks.frameworks import GRAPH_RUNNERS
from tdiff.hooks.device import SummaryGroup, _Batch, _DeviceSummary, _kernels, _packed_summary, completion_event
from tdiff.store.dtypes import from_bytes_view, to_bytes_view
from tdiff.store.graph_replays import GraphReplay, GraphTemplate
from tdiff.store.record import Record
from tdiff.store.writer import Pending

_SLOTS_PER_TABLE = 256      # statistics slots allocated together while a graph is captured
_ATTRIBUTE = "_tdiff_recording"   # where a graph keeps what its capture recorded

class _ThreadGraphs(threading.local):
    """This thread's graph state. Defaults on the class: a missing attribute of a thread-local
    costs an exception each time, and every module call asks."""

    recording: GraphRecording | None = None   # the graph this thread captures
    warmups = 0                               # warmup() depth


_thread = _ThreadGraphs()


@dataclasses.dataclass
class _Entry:
    record: Record              # its step and seq set at each replay, call relative
    counter: str                # the call counter it was counted under (module path or dump name)
    static: torch.Tensor | None = None        # its bytes, copied here by the graph (full mode)
    slot: tuple | None = None                 # (table, row) of its statistics (stats, or past budget)
    alias: int | None = None                  # index of an earlier entry of the same tensor


class GraphRecording:
    """What one graph's capture recorded, and the static device memory its replays write."""

    def __init__(self, recorder: GraphRecorder, side: torch.cuda.Stream | None = None):
        self.recorder = recorder
        self._side = side   # where stats mode's copies are summarised (None: in place)
        self.entries: list[_Entry] = []
        self.calls: dict[str, int] = {}      # call counts of the captured forward, by counter
        self.top_level: set[int] = set()     # ids of the modules it called outermost
        self.rows: int | None = None         # the batch size it was captured for
        self.fallbacks = 0                   # full-mode records kept as statistics past the budget
        self._over_budget = False
        self._tables: list[torch.Tensor] = []
        self._counters: list[torch.Tensor] = []   # the fused kernels' completion counter per slot
        self._used = _SLOTS_PER_TABLE
        self._partials: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._group = SummaryGroup(partials_of=self._partials_of)   # summarised where they are
        self._to_stage: list[tuple] = []          # (tensor, table, counters, row) to copy at the next launch
        self._staged: list[torch.Tensor] = []     # the copies: static buffers its replays write
        self._staged_group = SummaryGroup(partials_of=self._partials_of)   # the copies', on the side stream
        self._seen: dict[int, tuple] = {}
        self.template: GraphTemplate | None = None   # a graph of summaries only: its replays' one line each

    def record(self, record, counter: str, tensor: torch.Tensor) -> None:
        """Called by the capture hook for each tensor while the graph is captured."""
        alias = self._alias(tensor, len(self.entries))
        if alias is not None:
            self.entries.append(_Entry(record, counter, alias=alias))
            return
        recorder = self.recorder
        nbytes = tensor.numel() * tensor.element_size()
        if recorder.mode == "full" and not self._over_budget and \
                recorder.static_bytes + nbytes <= recorder.budget_bytes:
            recorder.static_bytes += nbytes
            # captured into the graph: each replay refreshes the copy
            self.entries.append(_Entry(record, counter, static=to_bytes_view(tensor).clone()))
            return
        if recorder.mode == "full":
            self._over_budget = True
            self.fallbacks += 1
        self.entries.append(_Entry(record, counter, slot=self._summary_slot(tensor)))

    def _summary_slot(self, tensor: torch.Tensor) -> tuple:
        device = tensor.device
        if self._used == _SLOTS_PER_TABLE or self._tables[-1].device != device:
            self._tables.append(torch.empty(_SLOTS_PER_TABLE, 7, dtype=torch.float64, device=device))
            # zeroed once the capture ends (finish), not by a node of the graph: kernels of another
            # stream forked inside the capture would not be ordered after it
            self._counters.append(torch.empty(_SLOTS_PER_TABLE, 1, dtype=torch.int32, device=device))
            self._used = 0
        table, row = self._tables[-1], self._used
        self._used += 1
        kernels = _kernels()
        numel = tensor.numel()
        if (kernels is None or not kernels.group_kernel_compiled(tensor.device, tensor.dtype)
                or not kernels.fused_summary_supported(tensor) or numel > kernels.GROUP * kernels.GROUPED_MAX_ELEMENTS):
            # torch ops: no kernel is compiled or loaded in the middle of a capture
            self._group.launch()
            table[row].copy_(_packed_summary(tensor))
        elif numel > kernels.GROUPED_MAX_ELEMENTS:
            self._group.launch()
            kernels.group_summary_into([tensor], table, self._counters[-1], row, self._partials_of(tensor))
        elif self._stages(tensor):
            self._to_stage.append((tensor, table, self._counters[-1], row))
        else:
            self._group.add(tensor, table, self._counters[-1], row)
        return table, row

    def _stages(self, tensor: torch.Tensor) -> bool:
        """Whether a stats-mode tensor is copied and summarised off the model's path: within the
        graph budget (stats mode's static buffers are these copies), on the device of the side
        stream made before the capture."""
        recorder = self.recorder
        nbytes = tensor.numel() * tensor.element_size()
        if recorder.mode != "stats" or recorder.static_bytes + nbytes > recorder.budget_bytes \
                or self._side is None or tensor.device != self._side.device:
            return False
        recorder.static_bytes += nbytes
        return True

    def launch(self) -> None:
        """Launch the summaries queued so far (where eager forwards launch theirs): those of tensors
        summarised where they are, and the copies of the others, whose summaries go on the side
        stream in groups of up to GROUP tensors of one dtype, launched as groups fill."""
        self._group.launch()
        if not self._to_stage:
            return
        queued, self._to_stage = self._to_stage, []
        tensors = [entry[0] for entry in queued]
        # a copy node per tensor: torch's elementwise copy spreads over the GPU, where _foreach_copy_
        # gives each 64K elements one block (its copies alone made a 32-token replay 2.5x, H100)
        copies = [torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor) for tensor in tensors]
        self._staged += copies
        side = self._side
        side.wait_stream(torch.cuda.current_stream(tensors[0].device))   # after the copies (no node)
        with torch.cuda.stream(side):
            for copy, (_, table, counters, row) in zip(copies, queued):
                self._staged_group.add(copy, table, counters, row)

    def close(self) -> None:
        """Before the capture ends, on its stream: the last summaries launched, and the side stream
        joined back into the capture (a capture ends only with every forked stream joined)."""
        self.launch()
        side = self._side
        if self._staged:   # the side stream joined the capture
            with torch.cuda.stream(side):
                self._staged_group.launch()
            torch.cuda.current_stream(side.device).wait_stream(side)

    def _partials_of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph's own partials for the fused kernels on the capturing stream: a replay may run
        on any stream, beside eager launches that use theirs (and the kernels of two streams forked
        inside the capture may overlap)."""
        key = (torch.cuda.current_stream(tensor.device).cuda_stream, tensor.dtype)
        found = self._partials.get(key)
        if found is None:
            found = self._partials[key] = _kernels().new_partials(tensor.device, tensor.dtype)
        return found

    def _alias(self, tensor: torch.Tensor, index: int) -> int | None:
        """The entry of this very tensor recorded earlier in the graph, unchanged since."""
        if tensor.is_inference():
            return None
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
            return seen[2]
        self._seen[id(tensor)] = (weakref.ref(tensor), tensor._version, index)
        return None

    def finish(self, completed: bool) -> None:
        """The capture ended (``completed``: the graph can be replayed)."""
        self._seen.clear()
        if completed and self.entries and all(entry.static is None for entry in self.entries):
            self.template = self._template()
        if completed and self._counters:
            # the fused kernels count their blocks from zero and leave each counter at zero again
            for counters in self._counters:
                counters.zero_()
            for device in {counters.device for counters in self._counters if counters.is_cuda}:
                torch.cuda.current_stream(device).synchronize()   # before a replay on any stream

    def _template(self) -> GraphTemplate:
        tables = {id(table): index * _SLOTS_PER_TABLE for index, table in enumerate(self._tables)}
        counters: dict[str, int] = {}
        records: list[Record] = []
        entries: list[tuple[int, int | None, int | None]] = []
        for index, entry in enumerate(self.entries):
            record = entry.record.copy()
            record.seq, record.step = index, 0
            records.append(record)
            counter = counters.setdefault(entry.counter, len(counters))
            if entry.slot is None:
                entries.append((counter, None, entry.alias))
            else:
                table, row = entry.slot
                entries.append((counter, tables[id(table)] + row, None))
        return GraphTemplate(records, list(counters), entries)

    def table_copy(self) -> torch.Tensor:
        """The statistics tables copied, on the current stream, into one pinned host tensor."""
        host = torch.empty(len(self._tables) * _SLOTS_PER_TABLE, 7, dtype=torch.float64, pin_memory=True)
        for index, table in enumerate(self._tables):
            host[index * _SLOTS_PER_TABLE:(index + 1) * _SLOTS_PER_TABLE].copy_(table, non_blocking=True)
        return host


class GraphRecorder:
    """One capture's CUDA-graph state: the static-buffer budget, the rows of the next replay."""

    def __init__(self, capture, budget_bytes: int):
        self.capture = capture
        self.mode = capture.options.mode
        self.budget_bytes = budget_bytes
        self.static_bytes = 0        # of all graphs captured so far
        self.graphs = 0
        self.next_rows: int | None = None
        # stats mode's staged summaries', per device and capturing thread: a stream joins one capture at a time
        self.side_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}

    # ---- asked by the capture hook ----
    @staticmethod
    def capturing() -> GraphRecording | None:
        """The recording of the graph this thread is capturing, None outside graph capture."""
        return _thread.recording

    def unrecorded(self) -> bool:
        """Whether module calls now run unrecorded: a warm-up, or a stream capture that did not go
        through torch.cuda.CUDAGraph (no graph to hang buffers on: record nothing, break nothing)."""
        if _thread.warmups:
            return True
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            self.capture.note("a CUDA stream capture outside torch.cuda.CUDAGraph ran: the modules "
                              "it captured are not recorded")
            return True
        return False

    # ---- graph lifecycle ----
    def prepare(self) -> None:
        """Before a graph capture starts: send the pending summaries to the host and let the
        writer finish what it holds, so that no tdiff thread makes a CUDA call during the capture
        (in the default global capture mode, an event wait in any thread invalidates it)."""
        self.capture.flush_summaries()
        kernels = _kernels()
        if kernels is not None and self.mode == "stats":  # full mode's past the budget take torch ops
            key = _side_key()
            try:
                kernels.compile_group_kernels(key[0])
                if key not in self.side_streams:   # no stream is made inside a capture
                    self.side_streams[key] = torch.cuda.Stream(key[0])
            except Exception as exc:  # noqa: BLE001 - the program's graph capture goes on, summarised by torch ops
                self.capture.note(f"the fused summary kernel could not be compiled ({type(exc).__name__}: {exc}): "
                                  "summaries inside CUDA graphs are computed with torch ops")
        writer = self.capture.part.opened
        if writer is not None:
            writer.drain()

    def begin(self) -> None:
        # stats mode with the kernels compiled: prepare() made it
        _thread.recording = GraphRecording(self, self.side_streams.get(_side_key()) if self.side_streams else None)

    def end(self, graph, completed: bool) -> None:
        recording = _thread.__dict__.pop("recording", None)
        if recording is None:
            return
        recording.finish(completed)
        self.graphs += 1
        setattr(graph, _ATTRIBUTE, recording)  # the buffers live as long as the graph
        if recording.fallbacks:
            self.capture.note(
                f"CUDA graph {self.graphs}: {recording.fallbacks} of {len(recording.entries)} tensors "
                f"are past the --graph-budget of {self.budget_bytes} bytes of static buffers and are "
                "recorded as statistics and fingerprints only on each replay")

    def replayed(self, graph, rows: int | None = None) -> None:
        """Turn what the graph's last replay wrote into the records of one step."""
        rows, self.next_rows = (rows if rows is not None else self.next_rows), None
        recording = getattr(graph, _ATTRIBUTE, None)
        capture = self.capture
        if recording is None:
            capture.note("a CUDA graph captured while no capture was active was replayed: its "
                         "replays are not recorded")
            return
        if not recording.entries and not recording.top_level:
            return  # nothing of it ran through module calls (torch.compile's own graphs)
        if torch.cuda.is_current_stream_capturing():
            capture.note("a CUDA graph was replayed inside another graph's capture: that replay "
                         "is not recorded")
            return
        if rows is not None and recording.rows is not None and rows > recording.rows:
            raise TdiffError(f"tdiff.graph_rows({rows}): the graph was captured for {recording.rows} rows")
        thread, bases = _replay_step(capture, recording)
        capture.forward_replayed()
        if not capture.selection.wants_step(thread.step) or capture.part.failed:
            return
        _emit(capture, recording, thread, bases, rows if rows != recording.rows else None)


def _side_key() -> tuple[torch.device, int]:
    """The capturing device and thread, whose side stream stats mode's staged summaries use."""
    return torch.device("cuda", torch.cuda.current_device()), threading.get_ident()


def _replay_step(capture, recording: GraphRecording) -> tuple[ThreadState, dict[str, int]]:
    """A replay is one forward pass of the replaying thread: its step advances as it would for an
    eager forward of the same outermost modules, and its calls count on from those already made
    in the step."""
    thread = capture.running.thread()
    if not thread.manual_steps and recording.top_level & thread.top_level_done:
        capture.advance_step(manual=False)
    return thread, thread.count_replay(recording.calls, recording.top_level)


def _emit(capture, recording: GraphRecording, thread: ThreadState, bases: dict, rows: int | None) -> None:
    """Copy the static buffers to pinned host memory on the current (replay) stream, so the next
    replay, queued after on that stream, cannot overwrite them before the copies are done."""
    if rows is not None and any(e.slot is not None and _is_batch(e.record.shape, recording.rows)
                                for e in recording.entries):
        capture.note("statistics recorded inside a CUDA graph cover all the rows the graph was "
                     "captured for, not only the rows tdiff.graph_rows() gave")
    template = recording.template
    if template is not None:   # one item for the whole replay: no Python per record
        table = recording.table_copy()
        ready = completion_event()
        ready.record()
        capture.writer.submit(GraphReplay(template, capture.running.next_seqs(len(template.records)), thread.step,
                                          thread.label, [bases[c] for c in template.counters], table, ready))
        return
    stats_batches = {}
    for table in recording._tables:
        batch = stats_batches[id(table)] = _Batch()
        batch.issue(table, torch.empty(table.shape, dtype=table.dtype, pin_memory=True))
    copies: list[Pending] = []
    seqs: list[int] = []
    for entry in recording.entries:
        seq = capture.running.next_seq()
        seqs.append(seq)
        source = recording.entries[entry.alias] if entry.alias is not None else entry
        record = entry.record.copy()
        record.seq, record.step, record.call, record.thread = \
            seq, thread.step, bases[entry.counter] + record.call, thread.label
        if source.slot is None:
            record.shape = _trimmed(record.shape, rows, recording.rows)
        if entry.alias is not None:
            record.alias_of = seqs[entry.alias]
            copies.append(Pending(record=record, original=copies[entry.alias]))
        elif entry.static is not None:
            nbytes = entry.static.numel() * record.numel // entry.record.numel if entry.record.numel else 0
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            host.copy_(entry.static[:nbytes], non_blocking=True)
            copies.append(Pending(record=record, data=from_bytes_view(host, record.dtype, record.shape),
                                  nbytes=nbytes))
        else:
            table, row = entry.slot
            copies.append(Pending(record=record, summary=_DeviceSummary(stats_batches[id(table)], row)))
    ready = completion_event()
    ready.record()
    for item in copies:
        if item.data is not None:
            item.ready = ready
        capture.writer.submit(item)


def _is_batch(shape: tuple, rows: int | None) -> bool:
    return rows is not None and len(shape) > 0 and shape[0] == rows


def _trimmed(shape: tuple, rows: int | None, captured_rows: int | None) -> tuple:
    """The record's shape once a padded batch is cut to its real rows."""
    if rows is None or not _is_batch(shape, captured_rows):
        return shape
    return (rows, *shape[1:])


# ---- the public calls ----
@contextlib.contextmanager
def warmup():
    """Forwards run inside are not recorded and are not steps (a CUDA graph's warm-up runs).

    A graph captured inside is still recorded. A no-op when no capture is active."""
    _thread.warmups += 1
    try:
        yield
    finally:
        _thread.warmups -= 1


def graph_rows(rows: int) -> None:
    """The real rows of the next CUDA graph replay, for an engine that pads its batch up to the
    size a graph was captured for: that replay's records whose leading dimension is the captured
    batch size keep only their first ``rows`` rows. A no-op when no capture is active."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise TdiffError(f"tdiff.graph_rows() takes a positive number of rows, not {rows!r}")
    capture = active_capture()
    if capture is not None:
        capture.graphs.next_rows = rows


def graph_replayed(graph, rows: int | None = None) -> None:
    """Record the replay of ``graph`` that was just queued on the current stream, for engines
    that replay a ``torch.cuda.CUDAGraph`` without its Python ``replay`` method (which tdiff
    hooks). ``rows``: as :func:`graph_rows`. A no-op when no capture is active."""
    capture = active_capture()
    if capture is not None:
        capture.graphs.replayed(graph, rows)


# ---- the process-wide hooks on torch.cuda.CUDAGraph ----
_originals: dict = {}


def install_graph_hooks() -> None:
    if _originals or not hasattr(torch.cuda, "CUDAGraph"):
        return
    cls = torch.cuda.CUDAGraph
    _originals.update(capture_begin=cls.capture_begin, capture_end=cls.capture_end, replay=cls.replay)

    def capture_begin(self, *args, **kwargs):
        capture = active_capture()
        if capture is not None:
            capture.graphs.prepare()
        _originals["capture_begin"](self, *args, **kwargs)
        if capture is not None:
            capture.graphs.begin()

    def capture_end(self, *args, **kwargs):
        completed = False
        try:
            try:
                if _thread.recording is not None:   # even if capture stopped meanwhile: its side stream must join
                    _thread.recording.close()
            finally:   # the capture ends whatever closing the recording raised
                _originals["capture_end"](self, *args, **kwargs)
            completed = True
        finally:
            capture = active_capture()
            if capture is not None:
                capture.graphs.end(self, completed)
            else:
                _thread.__dict__.pop("recording", None)

    def replay(self, *args, **kwargs):
        _originals["replay"](self, *args, **kwargs)
        capture = active_capture()
        if capture is not None:
            capture.graphs.replayed(self)

    cls.capture_begin, cls.capture_end, cls.replay = capture_begin, capture_end, replay  # type: ignore[method-assign]
    for module, hook in GRAPH_RUNNERS:   # engines that replay graphs another way
        when_imported(module, hook)
