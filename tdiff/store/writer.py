"""The background writer: one per capturing process.

A host tensor (full mode) is written by the hook itself, through :meth:`DumpWriter.stream`, into
a shard left open for such tensors, its statistics and fingerprint made in the same pass: the
page cache holds its bytes as they were, with no host copy and nothing left to write after the
forward. Hooks hand the writer thread the records, and for device tensors pinned copies still in
flight plus a CUDA event (and statistics the GPU computed for large ones), a handful at a time;
the writer thread completes what the hook left out (fingerprints, statistics on the calling thread
alone) and fills size-capped shards; shard writer threads write several shards at once, rename each
into place and append their records to the manifest journal in shard order, each only once its
shard, and the streamed shard its records name, is in place.
Pinned copies are written as they are and handed back to torch's pinned-memory cache once their
shard is written: no second host copy.

Host memory held by pending tensors is capped. At the cap :meth:`DumpWriter.submit` waits for
the writer: nothing is dropped. If writing fails (disk full, directory gone) the writer says so
once on stderr, drops what it holds, lets the model run on, and ends the manifest as failed.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
from concurrent.futures import Future
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from pathlib import Path

import torch

from tdiff.store.graph_replays import GraphReplay, GraphTemplate
from tdiff.store.fingerprint import ONE_THREAD_CHUNK, fingerprint_algorithm, host_summary, stats_dict, xxh3_fingerprint
from tdiff.store.manifest import DATA_DIR, ManifestJournal
from tdiff.store.record import Record
from tdiff.store.storage import HeaderFull, ShardStream, storage_for
from tdiff.store.tokens import DeferredTokens, TokenBatch

# shards written at once: page-cache writes of separate files overlap where there are cores to spare
DEFAULT_SHARD_WRITERS = max(1, min(4, (os.cpu_count() or 1) // 4))
_RECORDS_PER_FLUSH = 4096  # how many data-less records (stats mode) wait before they are journaled
# Items reach the writer thread in handfuls: waking it for each record made it take the GIL from
# the model's thread once a record (a stats-mode capture's forward took twice as long for it)
_HANDFUL_ITEMS = 256
# a handful goes once it holds 1 MiB of host copies: large copies start on their way to disk at once,
# as before handfuls (with 16 MiB, full mode's 8 x 512 GPU forward reached the disk 2-9% later in 4
# runs of 4, most likely for that)
_HANDFUL_BYTES = 1 << 20
# forwards whose token metadata may wait in a handful with no record to take it along: what stop()
# describes at most before it returns
_HANDFUL_TOKENS = 16
# streamed shards ended (each an open file) before a hook asks the writer thread to flush them
_ENDED_STREAMS_BEFORE_FLUSH = 16


class Summary(Protocol):
    def resolve(self, record: Record) -> tuple[dict, str]:
        """The record's statistics and fingerprint."""
        ...


@dataclass(slots=True)
class Pending:
    """A captured tensor on its way to disk."""

    record: Record
    data: torch.Tensor | None = None        # pinned host copy of a device tensor (full mode)
    ready: torch.cuda.Event | None = None   # CUDA event that completes ``data``
    summary: Summary | None = None          # stats mode; in full mode, statistics the GPU computed
                                            # (neither: the record is complete, its tensor streamed)
    nbytes: int = 0                         # host bytes this item holds until its shard is written
    original: Pending | None = None         # an alias: the item of the record it aliases, written before it


_Item = Pending | GraphReplay | TokenBatch | DeferredTokens   # what a handful holds, in submission order
_FLUSH = object()
_STOP = object()


class _Settle(threading.Event):
    """settle(): set once everything before it is journaled, and the journal says so."""

    def __init__(self, notes: Sequence[str]):
        super().__init__()
        self.notes = list(notes)


class DumpWriter:
    def __init__(self, root: Path, part: str, header: dict, *, storage: str, max_pending_bytes: int,
                 shard_bytes: int, shard_writers: int | None = None):
        """``storage``, ``max_pending_bytes``, ``shard_bytes``: the capture's options of those names
        (tdiff.capture_options)."""
        self.root = Path(root)
        self.part = part
        self.storage = storage_for(storage)
        self.max_pending_bytes = max_pending_bytes
        self.streamed_shard_limit = max(1, shard_bytes)   # holds no memory: not capped by max_pending_bytes
        self.shard_limit = max(1, min(shard_bytes, max_pending_bytes // 2))   # of copies held for a shard
        self.error: str | None = None
        self.records_written = 0
        self.peak_pending_bytes = 0
        self.waits = 0
        self._journal = ManifestJournal(self.root, part, header)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._handful: list[_Item] = []   # submitted, not yet handed to the writer thread
        self._handful_bytes = 0
        self._handful_tokens = 0
        self._records_since_flush = 0   # a step's flush with none to write wakes no thread
        # several threads may submit; re-entrant: a signal handler (SIGTERM's) may close the writer
        # while its thread is inside submit
        self._handful_lock = threading.RLock()
        self._space = threading.Condition()
        self._pending_bytes = 0
        self._waiting = 0   # threads waiting at the memory cap
        self._shard_numbers = itertools.count()   # shared by the writer thread and streaming hooks
        self._shard_file: str | None = None   # the name of the shard being filled
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._records: list[Record] = []
        self._graph_lines: list[dict] = []   # graph and replay lines since the last shard
        self._graph_records = 0              # the records those replay lines hold
        self._graphs: dict[int, tuple[GraphTemplate, int]] = {}   # id(template) -> it, its number in the part
        self._tokens: list[TokenBatch] = []
        self._shard_writers = _ShardWriters(shard_writers or DEFAULT_SHARD_WRITERS, name=f"tdiff-shards-{part}")
        self._last_shard: Future | None = None  # journals its records after every shard before it
        self._stream_lock = threading.Lock()    # hooks of several threads may stream
        self._stream: ShardStream | None = None   # the shard host tensors are streamed into, while open
        self._ended: list[ShardStream] = []   # streamed shards ended, sealed by the writer thread's next flush
        self._streaming = threading.local()   # .active: this thread is in stream(), maybe holding its lock
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"tdiff-writer-{part}", daemon=True)
        self._thread.start()

    # ---- producer side (the model's thread) ----
    @property
    def failed(self) -> bool:
        return self.error is not None

    def submit(self, item: Pending | GraphReplay) -> None:
        if self.failed:
            return
        if item.nbytes:  # a record without bytes (stats mode, an alias) holds no memory to account
            with self._space:
                if self._pending_bytes and self._pending_bytes + item.nbytes > self.max_pending_bytes:
                    self.waits += 1
                    self._waiting += 1
                    try:
                        self._hand_over(_FLUSH)  # the writer frees memory only from what it was given
                        while (self._pending_bytes and not self.failed
                               and self._pending_bytes + item.nbytes > self.max_pending_bytes):
                            self._space.wait()
                    finally:
                        self._waiting -= 1
                if self.failed:
                    return
                self._pending_bytes += item.nbytes
                self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)
        with self._handful_lock:
            self._handful.append(item)
            self._handful_bytes += item.nbytes
            self._records_since_flush += 1
            # another thread waiting at the cap: what this one holds must reach the disk too, or
            # its bytes, counted as pending, could keep that thread waiting until the step ends
            waiting = self._waiting
            # a graph replay holds a step's records and a pinned table: held back, each replay
            # would take a new pinned block from the driver, the cached ones all still held
            if (not waiting and len(self._handful) < _HANDFUL_ITEMS and self._handful_bytes < _HANDFUL_BYTES
                    and not isinstance(item, GraphReplay)):
                return
            self._queue.put(self._take_handful())
            if waiting:
                self._queue.put(_FLUSH)

    def _take_handful(self) -> list[_Item]:
        """The handful, replaced by an empty one before it is queued: a signal handler that closes
        the writer between the two (on this thread: the lock is re-entrant) must not queue it again."""
        handful, self._handful, self._handful_bytes, self._handful_tokens = self._handful, [], 0, 0
        return handful

    def stream(self, record: Record, tensor: torch.Tensor) -> Pending | None:
        """Write a host tensor's bytes into the streamed shard now, on the calling thread, with its
        statistics and fingerprint made as each chunk passes (:func:`host_summary`), and submit its
        record, complete. Returns its item (for the aliases that may name it); None when it was
        not written: writing has failed (which ends the capture's writing, as any write failure
        does) or the writer is closed."""
        key = f"t{record.seq}"
        self._streaming.active = True
        try:
            with self._stream_lock:
                if self.failed or self._closed:
                    return None
                try:
                    values, fingerprint, file = self._append(key, tensor)
                except Exception as exc:  # noqa: BLE001 - any write failure ends this part, not the model
                    self._give_up_stream()
                    self._fail(f"writing {self.root} failed: {_reason(exc)}")
                    return None
                if self.failed:  # writing failed elsewhere meanwhile: the writer thread left this shard to us
                    self._give_up_stream()
                    return None
        finally:
            self._streaming.active = False
        record.set_contents(stats_dict(values), fingerprint, file, key)
        item = Pending(record=record)
        self.submit(item)
        return item

    def _append(self, key: str, tensor: torch.Tensor) -> tuple[list[float], str, str]:
        """Append to the streamed shard (opened, or ended and another opened, as needed): the
        tensor's statistics, fingerprint and shard file."""
        def write(sink):
            return host_summary(tensor, sink=sink)

        stream = self._stream
        if stream is not None and stream.nbytes + tensor.numel() * tensor.element_size() > self.streamed_shard_limit:
            stream = self._next_stream()
        elif stream is None:
            stream = self._stream = self._new_stream()
        try:
            return (*stream.append(key, tensor, write), stream.path.name)
        except HeaderFull:
            if not len(stream):
                raise
        stream = self._next_stream()   # whose header has twice the room
        return (*stream.append(key, tensor, write), stream.path.name)

    def _new_stream(self) -> ShardStream:
        return self.storage.stream(self.root / DATA_DIR / self._new_shard_name())

    def _next_stream(self) -> ShardStream:
        """End the streamed shard and open another. The one ended is sealed at the writer
        thread's next flush, by a shard writer (an HDF5 shard's seal copies it: not on the
        model's thread); after a few, a flush is asked for, so that open files do not pile up."""
        ended, self._stream = self._stream, None
        if ended is not None:
            self._ended.append(ended)
            if len(self._ended) == _ENDED_STREAMS_BEFORE_FLUSH:
                self._hand_over(_FLUSH)
        self._stream = self._new_stream()
        return self._stream

    def _take_streams(self) -> list[ShardStream]:
        """The streamed shards, ended and open, none left open (the caller holds the stream lock)."""
        streams, self._ended = self._ended, []
        if self._stream is not None:
            streams.append(self._stream)
            self._stream = None
        return streams

    def _give_up_stream(self) -> None:
        """Remove the streamed shards, open and ended (writing failed; the caller holds the
        stream lock)."""
        for stream in self._take_streams():
            stream.discard()

    def _seal_streams(self, streams: list[ShardStream]) -> None:
        """Seal streamed shards; once writing has failed, remove them instead."""
        for stream in streams:
            if self.failed or not len(stream):
                stream.discard()
                continue
            try:
                stream.seal()
            except Exception as exc:  # noqa: BLE001 - any write failure ends this part, not the model
                stream.discard()
                self._fail(f"writing {self.root} failed: {_reason(exc)}")

    def _hand_over(self, message) -> None:
        """Queue ``message`` for the writer thread after every item submitted before it."""
        with self._handful_lock:
            if self._handful:
                self._queue.put(self._take_handful())
            self._queue.put(message)

    def submit_tokens(self, batch: TokenBatch | DeferredTokens) -> None:
        """Journal a forward's token metadata with the next records written (a deferred one worked
        out first, on the writer's thread). It rides in the handful: a forward that records
        nothing wakes no thread for it (each wake took the GIL from the model's thread)."""
        if not self.failed:
            with self._handful_lock:
                self._handful.append(batch)
                self._handful_tokens += 1
                if self._handful_tokens >= _HANDFUL_TOKENS or len(self._handful) >= _HANDFUL_ITEMS:
                    self._queue.put(self._take_handful())

    def flush(self) -> None:
        """Ask the writer to write out what it holds (at the end of a step, say), where a record
        came since the last flush: token metadata alone waits for the next records, the end or a
        settle."""
        with self._handful_lock:
            if not self._records_since_flush:
                return
            self._records_since_flush = 0
            self._hand_over(_FLUSH)

    def drain(self) -> None:
        """Wait until the writer has handled everything submitted so far: until the next submit
        it makes no CUDA call (no event wait, no pinned buffer released), which a CUDA graph
        capture in any thread of the process would fail on."""
        done = threading.Event()
        self._hand_over(done)
        done.wait()

    def settle(self, notes: Sequence[str] = ()) -> None:
        """Write out everything submitted so far, then say in the manifest that the part's records
        are all on disk (with the capture's ``notes``): a process that leaves now through
        ``os._exit`` (a forked worker) leaves a part read as ended there. Waits for the disk."""
        if self.failed or self._closed:
            return
        done = _Settle(notes)
        self._hand_over(_FLUSH)
        self._hand_over(done)
        done.wait()

    def resume(self) -> None:
        """Say in the manifest, before this thread records again, that the part is no longer
        settled (see :meth:`settle`)."""
        if not self.failed:
            try:
                self._journal.resume()
            except OSError as exc:
                self._fail(f"writing {self.root} failed: {_reason(exc)}")

    def close(self, error: str | None = None, notes: Sequence[str] = ()) -> None:
        """Write what is pending and end the manifest, with the capture's ``notes``; ``error`` (why
        the captured program failed) or a write failure ends it as failed, which marks the dump
        incomplete."""
        if getattr(self._streaming, "active", False):
            # a signal handler (SIGTERM's) ends the capture while this thread is in stream(),
            # perhaps holding the streamed shard's lock: that shard cannot be finished
            self._fail("the capture was ended while a tensor was being written")
        else:
            with self._stream_lock:
                self._closed = True   # no tensor is streamed from now on
        self._hand_over(_STOP)
        self._thread.join()
        try:
            self._journal.end(self.records_written, self.error or error, notes)
        except OSError as exc:
            self._report(f"cannot finish the manifest ({exc.strerror}); the dump stays incomplete")

    # ---- the writer thread ----
    def _run(self) -> None:
        _yield_to_the_model()
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._guarded(self._flush_shard)
                self._wait_for_shards()
                self._shard_writers.shutdown()
                return
            if item is _FLUSH:
                self._guarded(self._flush_shard)
            elif isinstance(item, threading.Event):
                self._wait_for_shards()
                if isinstance(item, _Settle) and not self.failed:
                    # no shard writer appends meanwhile: this thread alone hands them work
                    self._guarded(self._journal.settle, self.records_written, item.notes)
                item.set()  # drain(), settle(): everything before it is handled
            else:
                self._store_handful(item)
            del item   # what it holds (a graph replay's pinned table) goes now, not at the next item

    def _describe_tokens(self, deferred: DeferredTokens) -> None:
        """A forward's token metadata, from the copies its token source took: what the source read
        cannot be described ends the part as failed (a dump whose tokens are missing cannot be lined
        up token by token)."""
        try:
            self._tokens.append(deferred.resolve())
        except Exception as exc:  # noqa: BLE001 - a failure here ends this part, not the model
            self._fail(f"the token metadata of step {deferred.step} cannot be described ({_reason(exc)})")

    def _store_handful(self, handful: list[_Item]) -> None:
        for item in handful:
            if isinstance(item, TokenBatch):
                self._tokens.append(item)
            elif isinstance(item, DeferredTokens):
                self._describe_tokens(item)
            elif self.failed:
                self._drop(item)
            else:
                self._guarded(self._store, item)

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - any write failure ends this part, not the model
            self._fail(f"writing {self.root} failed: {_reason(exc)}")

    def _store(self, item: Pending | GraphReplay) -> None:
        if isinstance(item, GraphReplay):
            self._store_replay(item)
            return
        record = item.record
        data = item.data
        if item.ready is not None:
            item.ready.synchronize()
        if item.original is not None:
            original = item.original.record  # complete: it was submitted, so stored, first
            record.set_contents(original.stats, original.fingerprint, original.file, original.key)
        elif data is not None:
            key = f"t{record.seq}"
            if item.summary is not None:  # made as the tensor was copied
                stats, fingerprint = item.summary.resolve(record)
                if fingerprint_algorithm(fingerprint) != "xxh3":  # the GPU's statistics: the bytes hashed here
                    fingerprint = xxh3_fingerprint(data)
            else:
                values, fingerprint = host_summary(data, chunk=ONE_THREAD_CHUNK)  # one pass for both
                stats = stats_dict(values)
            if self._shard_file is None:
                self._shard_file = self._new_shard_name()
            record.set_contents(stats, fingerprint, self._shard_file, key)
            self._shard[key] = data
            self._shard_bytes += item.nbytes
        elif item.summary is not None:
            record.set_contents(*item.summary.resolve(record))
        item.data = None  # the shard holds the data until it is written
        self._records.append(record)
        if self._shard_bytes >= self.shard_limit or len(self._records) + self._graph_records >= _RECORDS_PER_FLUSH:
            self._flush_shard()

    def _store_replay(self, item: GraphReplay) -> None:
        known = self._graphs.get(id(item.template))
        if known is None:   # the template is kept: its id stays its own
            known = self._graphs[id(item.template)] = (item.template, len(self._graphs))
            self._graph_lines.append(item.template.line(known[1]))
        self._graph_lines.append(item.line(known[1]))
        self._graph_records += item.records
        if len(self._records) + self._graph_records >= _RECORDS_PER_FLUSH:
            self._flush_shard()

    def _new_shard_name(self) -> str:
        return f"{self.part}.s{next(self._shard_numbers):05d}.{self.storage.suffix}"

    def _flush_shard(self) -> None:
        """Hand the shard filled so far, the streamed shards (some of the records may name them:
        the shard writer seals them before it journals the records) and the records since the
        last one, to a shard writer. Token metadata alone is journaled here: no shard writer is
        woken for it (none started, where a capture records nothing)."""
        streams: list[ShardStream] = []
        if self._lock_stream():
            streams = self._take_streams()
            self._stream_lock.release()
        if self._shard_file is None and not streams and not self._records and not self._graph_lines:
            tokens, self._tokens = self._tokens, []
            if tokens:
                self._wait_for_shards()   # the manifest keeps the order things were recorded in
                if not self.failed:
                    self._journal.append([], tokens)
            return
        job = (self._shard_file, self._shard, streams, self._records, self._tokens, self._graph_lines,
               self._graph_records, self._shard_bytes, self._last_shard)
        self._shard_file, self._shard, self._records, self._tokens, self._shard_bytes = None, {}, [], [], 0
        self._graph_lines, self._graph_records = [], 0
        self._last_shard = self._shard_writers.submit(self._write_shard, *job)

    def _lock_stream(self) -> bool:
        """Take the stream lock, waiting for it only while writing has not failed: from then on,
        the streamed shards of a thread that holds it (one that a signal handler cut short, or one
        that finds the failure once its tensor is written) are that thread's to give up."""
        while not self._stream_lock.acquire(timeout=0.05):
            if self.failed:
                return False
        return True

    def _write_shard(self, name: str | None, shard: dict, streams: list[ShardStream], records: list[Record],
                     tokens: list[TokenBatch], graph_lines: list[dict], graph_records: int, nbytes: int,
                     previous: Future | None) -> None:
        try:
            self._seal_streams(streams)
            if name is not None and not self.failed:
                self.storage.write(self.root / DATA_DIR / name, shard)
            shard.clear()  # the pinned copies go back to torch's cache
            if previous is not None:
                previous.result()  # the manifest lists records in the order they were recorded
            if not self.failed:
                self._journal.append(records, tokens, graph_lines)
                self.records_written += len(records) + graph_records
        except Exception as exc:  # noqa: BLE001 - any write failure ends this part, not the model
            self._fail(f"writing {self.root} failed: {_reason(exc)}")
        finally:
            self._release(nbytes)

    def _wait_for_shards(self) -> None:
        if self._last_shard is not None:
            self._last_shard.result()

    def _drop(self, item: _Item) -> None:
        """Forget an item that will not be written: its copy may outlive it otherwise (capture keeps
        the item of a tensor that may be recorded again, as long as the tensor lives)."""
        if isinstance(item, Pending):
            item.data = None
        if isinstance(item, (Pending, GraphReplay)):
            self._release(item.nbytes)

    def _release(self, nbytes: int) -> None:
        if nbytes:
            with self._space:
                self._pending_bytes -= nbytes
                self._space.notify_all()

    def _fail(self, reason: str) -> None:
        with self._space:
            first = self.error is None
            if first:
                self.error = reason
            self._space.notify_all()  # a waiting hook sees the failure and returns
        if first:
            self._report(f"{reason}; capture stopped, the dump is marked incomplete")
            with self._handful_lock:  # no later submit hands the held copies over: free them now
                dropped = self._take_handful()
            for item in dropped:
                self._drop(item)

    @staticmethod
    def _report(message: str) -> None:
        print(f"tdiff: {message}", file=sys.stderr, flush=True)


class _ShardWriters:
    """A few daemon threads that write shards. Not a ThreadPoolExecutor: a capture often ends in
    an atexit handler, after concurrent.futures has stopped taking work at interpreter shutdown."""

    def __init__(self, count: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._count, self._name = count, name
        self._threads: list[threading.Thread] = []   # started at the first job

    def submit(self, fn, *args) -> Future:
        if not self._threads:
            self._threads = [threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                             for i in range(self._count)]
            for thread in self._threads:
                thread.start()
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()

    def _work(self) -> None:
        _yield_to_the_model()
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            del job   # an idle thread keeps no shard's records alive until its next job
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the waiting writer re-raises it
                future.set_exception(exc)
            del future, fn, args


# signals a program ends or steers its processes with, which its handlers (tdiff capture's SIGTERM
# one too) run on the main thread only: delivered to a writer thread, one does not interrupt the
# main thread's blocking wait (a pool worker idle in its queue's lock), so its handler never runs
_PROGRAM_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                    signal.SIGALRM, signal.SIGCHLD}


def _yield_to_the_model() -> None:
    """Lower this thread's scheduling priority (Linux schedules threads one by one): the model's
    own threads keep the cores, and writing goes on in the time they leave. The program's signals
    are blocked here, so that the kernel delivers them to the program's threads."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _PROGRAM_SIGNALS)
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the writer runs at normal priority


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
