"""What a hook does with a tensor where it lives: copy it out (full mode) or summarise it in
place (stats mode), without stalling the GPU.

- Full mode: a GPU tensor is snapshotted on its own stream (a device-side copy into bounded
  staging memory), then copied into pinned host memory on a side stream, overlapping the forward
  pass; the writer waits for the copy's event.
- Stats mode: a GPU tensor is summarised by one fused kernel (statistics and mix64 digest, see
  tdiff.store.device_summary) into a slot of a device-side table; slots go to the host in batches,
  one copy and one event per batch instead of per tensor.
"""

from __future__ import annotations

import collections
import os
import threading

import torch

from tdiff.store.dtypes import dtype_name, to_bytes_view
from tdiff.store.fingerprint import digest_format, host_summary, mix64_fingerprint_tensor, stats_dict, \
    tensor_stats
from tdiff.vocab.parse import parse_size

_BATCH = 512  # summaries copied to the host together
_DEVICE_STATS_MIN_ELEMENTS = 1 << 20  # full mode: smaller tensors' statistics are computed on the host


def completion_event() -> torch.cuda.Event:
    """An event that a tdiff thread waits for (the writer, for a copy to the host): a blocking one,
    so that the waiting thread sleeps instead of spinning a core until the GPU gets there (a
    stats-mode graph replay's table waited ~1.4 ms of CPU each on the H100 host)."""
    return torch.cuda.Event(blocking=True)


class Summary:
    """Statistics and fingerprint of one tensor; ``resolve`` may wait for the device."""

    def __init__(self, stats: list[float] | torch.Tensor, fingerprint: str):
        self._stats, self.fingerprint = stats, fingerprint   # a host summary's, known at once

    def resolve(self, record) -> tuple[dict, str]:
        return stats_dict(self._stats), self.fingerprint


class _DeviceSummary(Summary):
    def __init__(self, batch: _Batch, index: int):
        self._batch, self._index = batch, index

    def resolve(self, record) -> tuple[dict, str]:
        stats, digests = self._batch.wait()
        fingerprint = digest_format("mix64", digests[self._index], record.dtype, record.shape)
        return stats_dict(stats[self._index]), fingerprint


class _Batch:
    """Slots of the device table on their way to pinned host memory."""

    def __init__(self):
        self._host: torch.Tensor | None = None
        self._event = None
        self._issued = threading.Event()
        self._values: tuple[list, list] | None = None

    def issue(self, table_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
        """Copy the rows into their place in the table's pinned mirror, which they hold until
        :meth:`wait` has read them."""
        self._host = host_rows
        self._host.copy_(table_rows, non_blocking=True)
        self._event = completion_event()
        self._event.record()
        self._issued.set()

    def wait(self) -> tuple[list, list]:
        """Per slot: the six statistics, and the digests; converted once for the whole batch."""
        if self._values is None:
            self._issued.wait()
            self._event.synchronize()
            self._values = (self._host[:, :6].tolist(), self._host.view(torch.int64)[:, 6].tolist())
        return self._values


class SummaryGroup:
    """Small GPU tensors of one dtype queued for one launch of the fused group kernel, which writes
    their summaries into consecutive slots of one table. Stats mode queues alike in eager forwards
    (:class:`Summarizer`) and inside a CUDA graph's capture (tdiff.hooks.cuda_graphs): the group is
    launched when it is full, when a tensor of another dtype or for another table comes, before a
    summary that takes a launch of its own (the slots stay consecutive), and by the capture once a
    module call's inputs, or its outputs, are all queued (before a later kernel can change them).
    A tensor whose slot does not follow the group's last also starts a new group.

    ``partials_of``: the kernel's partials for a group, given its first tensor, at its launch
    (None: the kernels' own, per stream)."""

    def __init__(self, partials_of=None):
        self._partials_of = partials_of
        self._tensors: list[torch.Tensor] = []
        self._table = self._counters = None
        self._first = 0   # the first tensor's slot

    def add(self, tensor: torch.Tensor, table: torch.Tensor, counters: torch.Tensor, slot: int) -> None:
        tensors = self._tensors
        if tensors and (tensors[0].dtype != tensor.dtype or len(tensors) == _kernels().GROUP
                        or table is not self._table or slot != self._first + len(tensors)):
            self.launch()
        if not self._tensors:
            self._table, self._counters, self._first = table, counters, slot
        self._tensors.append(tensor)

    def launch(self) -> None:
        tensors = self._tensors
        if tensors:
            partials = self._partials_of(tensors[0]) if self._partials_of is not None else None
            _kernels().group_summary_into(tensors, self._table, self._counters, self._first, partials)
            self._tensors = []


class Summarizer:
    """Stats mode: summaries of CPU tensors at once, of GPU tensors through the device table.

    Small GPU tensors of one dtype are summarised together, up to
    :data:`tdiff.store.device_summary.GROUP` in one launch: :meth:`summarize` queues them and
    :meth:`launch` (called by capture once a module call's inputs, or its outputs, are all
    queued: before any later kernel can change them) launches the queue."""

    def __init__(self):
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._counters: dict[torch.device, torch.Tensor] = {}
        self._mirrors: dict[torch.device, torch.Tensor] = {}  # pinned host copies of the tables
        self._issued: list[_Batch] = []  # this round's batches through the table, oldest first
        self._batch: _Batch | None = None
        self._start = self._used = 0
        self._device: torch.device | None = None
        self._group = SummaryGroup()

    def summarize(self, tensor: torch.Tensor) -> Summary:
        device = tensor.device  # read once: each read builds a torch.device (this runs per record)
        kind = device.type
        if kind == "cpu":
            return Summary(*host_summary(tensor))
        if kind != "cuda":
            packed = _packed_summary(tensor).cpu()
            return _resolved(packed, tensor)
        if self._device is not None and device != self._device:
            self.flush()
        table = self._table(device)
        if self._batch is None:
            self._batch, self._start, self._device = _Batch(), self._used, device
        slot = self._used
        kernels = _kernels()
        if kernels is not None and kernels.fused_summary_supported(tensor):
            if tensor.numel() <= kernels.GROUPED_MAX_ELEMENTS:
                self._group.add(tensor, table, self._counters[device], slot)
            else:
                self._group.launch()  # a group's slots are consecutive
                kernels.fused_summary_into(tensor, table[slot], self._counters[device][slot])
        else:
            self._group.launch()
            table[slot].copy_(_packed_summary(tensor))
        summary = _DeviceSummary(self._batch, slot - self._start)
        self._used = used = slot + 1
        if used - self._start >= _BATCH or used == len(table):
            self.flush()
        return summary

    def snapshot_summary(self, tensor: torch.Tensor) -> Summary | None:
        """Full mode: the statistics of a large GPU tensor the fused kernel takes, computed on the
        GPU as the tensor is now and sent to the host at once (the writer then only hashes and
        writes the host copy); None for any other tensor (the writer computes its statistics from
        the host copy, beside the model, instead of a launch and a copy on the model's thread)."""
        kernels = _kernels()
        if (tensor.device.type != "cuda" or tensor.numel() < _DEVICE_STATS_MIN_ELEMENTS or kernels is None
                or not kernels.fused_summary_supported(tensor)):
            return None
        summary = self.summarize(tensor)
        self.flush()
        return summary

    def launch(self) -> None:
        """Launch the summaries queued so far."""
        self._group.launch()

    def flush(self) -> None:
        """Send the summaries computed so far to the host (at the end of each step, say)."""
        if self._batch is None:
            return
        self.launch()
        rows = slice(self._start, self._used)
        self._batch.issue(self._tables[self._device][rows], self._mirrors[self._device][rows])
        self._issued.append(self._batch)
        self._batch = None
        if self._used == len(self._tables[self._device]):
            # the next round reuses the slots: the device table in stream order after the copies
            # above, the pinned mirror only once every batch of this round has been read from it
            for batch in self._issued:
                batch.wait()
            self._issued = []
            self._used = 0

    def _table(self, device: torch.device) -> torch.Tensor:
        if device not in self._tables:
            self._tables[device] = torch.empty(4 * _BATCH, 7, dtype=torch.float64, device=device)
            # one completion counter per slot: kernels on different streams never share one
            self._counters[device] = torch.zeros(4 * _BATCH, 1, dtype=torch.int32, device=device)
            self._mirrors[device] = torch.empty(4 * _BATCH, 7, dtype=torch.float64, pin_memory=True)
        return self._tables[device]


def _resolved(packed: torch.Tensor, tensor: torch.Tensor) -> Summary:
    digest = int(packed[6:].view(torch.int64)[0])
    return Summary(packed[:6], digest_format("mix64", digest, dtype_name(tensor.dtype), tensor.shape))


_kernel_module: list = []  # tdiff.store.device_summary once imported, or None without Triton


def _kernels():
    """The fused kernels' module, or None where Triton is missing (torch ops give the same values,
    more slowly)."""
    if not _kernel_module:
        try:
            from tdiff.store import device_summary
        except ImportError:
            device_summary = None
        _kernel_module.append(device_summary)
    return _kernel_module[0]


def _packed_summary(tensor: torch.Tensor) -> torch.Tensor:
    """[6 statistics, the mix64 digest's bits] as float64 on the tensor's device (torch ops)."""
    return torch.cat([tensor_stats(tensor), mix64_fingerprint_tensor(tensor).view(1).view(torch.float64)])


STAGING_ENV = "TDIFF_MAX_DEVICE_STAGING"
DEFAULT_MAX_DEVICE_STAGING = 512 << 20


class _Staging:
    """One device's snapshots on their way to the host, and the bytes they hold there."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.in_flight: collections.deque = collections.deque()  # (event, nbytes), oldest first
        self.held = 0
        self.lock = threading.Lock()  # several threads may record on one device

    def make_room(self, nbytes: int, limit: int) -> None:
        """Forget finished copies; wait for the oldest ones while ``nbytes`` more would pass ``limit``."""
        while self.in_flight and (self.held + nbytes > limit or self.in_flight[0][0].query()):
            done, size = self.in_flight.popleft()
            done.synchronize()
            self.held -= size


_staging: dict[torch.device, _Staging] = {}
_limit_cache: tuple[str | None, int] = (None, DEFAULT_MAX_DEVICE_STAGING)


def max_device_staging() -> int:
    """Device memory full-mode snapshots may hold (bytes): $TDIFF_MAX_DEVICE_STAGING ("256MiB",
    "0"...), 512 MiB by default."""
    global _limit_cache
    text = os.environ.get(STAGING_ENV)
    if text != _limit_cache[0]:
        _limit_cache = (text, DEFAULT_MAX_DEVICE_STAGING if text is None else parse_size(text, STAGING_ENV))
    return _limit_cache[1]


def host_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of the bytes of a tensor that is not on the CPU (a CPU tensor is written to its
    shard at once: :meth:`tdiff.store.writer.DumpWriter.stream`) as they are now, and the CUDA
    event that completes it (None: complete).

    A CUDA tensor is snapshotted on its own stream, before anything queued after this call can
    write it (``out.add_(residual)`` right after the module returns): a device-side copy into
    staging memory, then an asynchronous copy to pinned host memory on a side stream, which
    overlaps the forward. Staging is bounded (:func:`max_device_staging`): at the bound this waits
    for earlier host copies to finish; a tensor larger than the bound is copied to the host
    directly on its own stream, which then waits for that copy. The copy goes through the raw
    bytes, so dtypes without copy kernels (bits, int1...) work too.
    """
    if tensor.device.type == "cuda" and tensor.numel():
        return _snapshot_to_host(tensor)
    return to_bytes_view(tensor).cpu(), None


def _snapshot_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    nbytes = tensor.numel() * tensor.element_size()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    current = torch.cuda.current_stream(tensor.device)
    limit = max_device_staging()
    ready = completion_event()
    if nbytes > limit:
        host.copy_(to_bytes_view(tensor), non_blocking=True)
        ready.record(current)
        return host, ready
    staging = _staging.get(tensor.device)
    if staging is None:
        staging = _staging.setdefault(tensor.device, _Staging(tensor.device))
    with staging.lock:
        staging.make_room(nbytes, limit)
        snapshot = to_bytes_view(tensor)  # strided: already a fresh copy, made on the current stream
        if tensor.is_contiguous():
            snapshot = snapshot.clone()  # queued on the current stream: ordered before later writes
        staging.stream.wait_stream(current)
        with torch.cuda.stream(staging.stream):
            host.copy_(snapshot, non_blocking=True)
            ready.record(staging.stream)
        # the allocator must not hand the snapshot's memory out before the host copy ends
        snapshot.record_stream(staging.stream)
        staging.in_flight.append((ready, nbytes))
        staging.held += nbytes
    return host, ready

