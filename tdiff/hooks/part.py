"""This process's part of a dump: its manifest and shards, written by one
:class:`~tdiff.store.writer.DumpWriter` (its :class:`Sink`), and what a fork does to it.

A part is opened at the process's first record, so a process that records nothing leaves none
(a data loader's worker, a forkserver), unless its capture ends in failure: a part then says so.
A forked child (a data loader's or a pool's worker) continues the capture into a part of its own;
it never writes into its parent's part (the parent's writer, its files and threads are left as
the fork found them: the child has no thread of it).

A forked child usually leaves through ``os._exit`` (multiprocessing's fork workers do), which
runs no exit handler, so its part is settled after each of its outermost model calls and each
dump made outside one: every record it submitted is on disk and a "settled" line says so. A part
whose last line is one reads as ended there, without an end line, and the dump says so in its
notes; a part cut short in the middle of a call has records after it, or none, and is incomplete.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from tdiff.hooks.active import active_capture

if TYPE_CHECKING:
    import torch

    from tdiff.store.record import Record
    from tdiff.store.tokens import DeferredTokens, TokenBatch
    from tdiff.store.writer import Pending


class Sink(Protocol):
    """What the recorders hand their typed messages to, and the part's lifecycle: a
    :class:`~tdiff.store.writer.DumpWriter` (tests give a fake one).

    The messages: a record with how its contents come (a :class:`~tdiff.store.writer.Pending`
    item: a host copy, a summary, an alias of an earlier item, a graph replay's buffers), a CPU
    tensor streamed to a shard with its record, a forward's :class:`~tdiff.store.tokens.TokenBatch` (or
    :class:`~tdiff.store.tokens.DeferredTokens`, which the sink works out).
    Once ``failed``, what a sink is handed is dropped and nothing more is recorded."""

    part: str   # the part's id

    @property
    def failed(self) -> bool: ...

    def submit(self, item: Pending) -> None: ...

    def stream(self, record: Record, tensor: torch.Tensor) -> Pending | None:
        """Write the tensor now and submit its record, complete; its item, or None: not written."""
        ...

    def submit_tokens(self, batch: TokenBatch | DeferredTokens) -> None: ...

    def flush(self) -> None:
        """Write out what is held (a step ended)."""
        ...

    def drain(self) -> None:
        """Return once everything submitted is handled (a CUDA graph's capture begins)."""
        ...

    def settle(self, notes: Sequence[str] = ()) -> None:
        """Everything submitted is on disk, and the part says so (a forked child)."""
        ...

    def resume(self) -> None:
        """The part records again after it settled."""
        ...

    def close(self, error: str | None = None, notes: Sequence[str] = ()) -> None: ...


class ProcessPart:
    def __init__(self, open_writer: Callable[[], Sink]):
        self._open_writer = open_writer
        self._writer: Sink | None = None
        self._lock = threading.Lock()   # threads of a forked child may record first together
        self.forked = False             # this process is a forked child of the capture's
        self._closed = False
        self._settled = False           # a forked child's part says all its records are on disk

    @property
    def writer(self) -> Sink:
        """The part's writer, opened on first use."""
        writer = self._writer
        if writer is None:
            if self._closed:
                raise RuntimeError("the capture has ended: its part is closed")
            with self._lock:
                if self._writer is None:
                    self._writer = self._open_writer()
                writer = self._writer
        if self._settled:
            self._settled = False
            writer.resume()
        return writer

    @property
    def opened(self) -> Sink | None:
        return self._writer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        """Writing failed: nothing more is recorded (False while no part is open: one may open)."""
        return self._writer is not None and self._writer.failed

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def settle(self, notes: Sequence[str]) -> None:
        """In a forked child: what it recorded since it last settled is on disk before its code
        goes on, and its manifest says so."""
        if self.forked and self._writer is not None and not self._settled:
            self._writer.settle(notes)
            self._settled = True

    def close(self, error: str | None, notes: Sequence[str]) -> None:
        """End the part; a capture that failed ends one, though it recorded nothing, to say so."""
        if error is not None and self._writer is None and not self._closed:
            self._writer = self._open_writer()
        writer, self._writer = self._writer, None
        self._closed = True
        if writer is not None:
            writer.close(error, notes=notes)

    def after_fork_in_child(self) -> None:
        self._writer = None
        self._lock = threading.Lock()
        self._settled = False
        self.forked = True


def _after_fork_in_child() -> None:
    capture = active_capture()
    if capture is not None:
        capture.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
