"""The running state of a capture: where each thread of the process is (its step, its call
counters, its stack of module calls) and the process-wide order of records.

One owner, :class:`RunningState`, that the module-call hook, explicit dumps, CUDA-graph replays and
op tracing all ask, so that none of them keeps counters of its own or writes another's.

Threads count on their own: two threads running a model (or a helper thread calling
``tdiff.dump`` while the model runs) interleave differently in every run, so counters shared by
threads gave honest runs different steps and call indexes. Each thread's records carry its
label, and compare pairs them with the records of the same label in the other run.

A thread's label is its name (``threading.current_thread().name``: ``MainThread``,
``Thread-1 (worker)``, ``ThreadPoolExecutor-0_1``...), which the program gives in the same order
in every honest run, unlike the OS's thread ids or the order in which racing threads first record.
Several threads of one name are told apart as ``name#2``, ``name#3``... in the order they first
record: deterministic when they run one after another, not when they race (give such threads
names of their own).
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tdiff.hooks.ops import OpTracer


UNKNOWN_LAYOUT = ""   # a Frame's layout before anything asked for it (tdiff.hooks.plan.frame_layout)


class Frame:
    """One module call running in this thread."""

    __slots__ = ("module", "path", "annotator", "layer", "compiled", "tracer", "parent", "layout")

    def __init__(self, module, path, annotator, layer, compiled=False, tracer=None, parent=None,
                 layout: str | None = UNKNOWN_LAYOUT):
        self.module, self.path = module, path
        self.annotator = annotator   # the framework whose annotator describes this call's records
        self.layer = layer           # the decoder layer this call belongs to (tdiff.vocab.paths.call_layer)
        self.compiled = compiled     # a torch.compile'd module: what it calls runs as compiled code
        self.tracer: OpTracer | None = tracer   # records this call's own ops (capture --ops)
        self.parent: Frame | None = parent      # the enclosing call's
        # "seq-first" / "batch-first" as its module declares, None: nothing says; worked out when
        # first asked (tdiff.hooks.plan.frame_layout): most calls record nothing
        self.layout = layout


class ThreadState:
    """Where one thread is: its step, what ran at its top level in that step, its calls."""

    __slots__ = ("label", "step", "manual_steps", "top_level_done", "calls", "stack", "batch_size")

    def __init__(self, label: str):
        self.label = label
        self.step = 0
        self.manual_steps = False                # tdiff.step() was called: only it advances the step
        self.top_level_done: set[int] = set()    # ids of modules that ran at the top level this step
        self.calls: dict[str, int] = {}          # invocation counters of this step, by module path / name
        self.stack: list[Frame] = []             # the module calls running
        self.batch_size: int | None = None       # of the running outermost call's first input (--batch-row)

    def advance(self, *, manual: bool) -> None:
        self.manual_steps = self.manual_steps or manual
        self.step += 1
        self.top_level_done.clear()
        self.calls.clear()

    def count_replay(self, calls: dict[str, int], top_level: set[int]) -> dict[str, int]:
        """A CUDA graph's replay made the ``calls`` its capture counted and ran the ``top_level``
        modules: they count on from the calls already made in the step. Returns each counter's
        count before the replay."""
        bases = {counter: self.calls.get(counter, 0) for counter in calls}
        for counter, count in calls.items():
            self.calls[counter] = bases[counter] + count
        self.top_level_done |= top_level
        return bases


def count_call(calls: dict[str, int], counter: str) -> int:
    """The index of this call of ``counter`` (a module path or a dump's name) among ``calls``, the
    counters of a thread's step or of a CUDA graph's captured forward."""
    call = calls.get(counter, 0)
    calls[counter] = call + 1
    return call


class RunningState:
    """The threads of one capture in this process, and the order of their records."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._named: dict[str, int] = {}   # thread name -> threads of that name seen
        self._threads: list[ThreadState] = []
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()
        self._rank: int | None = None
        self._rank_known = False   # torch.distributed gave it: it cannot change any more

    def thread(self) -> ThreadState:
        """The calling thread's state (made on its first use)."""
        state = getattr(self._local, "state", None)
        if state is None:
            name = threading.current_thread().name
            with self._lock:
                seen = self._named[name] = self._named.get(name, 0) + 1
                state = self._local.state = ThreadState(name if seen == 1 else f"{name}#{seen}")
                self._threads.append(state)
        return state

    def busy(self) -> bool:
        """Whether a module call is running in any thread."""
        return any(state.stack for state in self._threads)

    def next_seq(self) -> int:
        """The next record's place in the process's execution order."""
        with self._seq_lock:
            return next(self._seq)

    def next_seqs(self, count: int) -> int:
        """The first of ``count`` consecutive places (the records of a CUDA graph's replay)."""
        with self._seq_lock:
            first = next(self._seq)
            self._seq = itertools.count(first + count)
        return first

    def rank(self) -> int:
        """torch.distributed's rank once it is initialised (then fixed), before that $RANK.

        Looked up once per outermost call, not per tensor."""
        if self._rank is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                self._rank, self._rank_known = dist.get_rank(), True
            else:
                self._rank = int(os.environ.get("RANK", "0"))
        return self._rank

    def outermost_call(self) -> None:
        """An outermost module call starts: torch.distributed may have started since the last."""
        if not self._rank_known:
            self._rank = None

    def after_fork_in_child(self) -> None:
        """A forked child has one thread, the one that forked: it counts on from where that
        thread was (the step it forked in), outside any module call (a worker's own loop runs
        there, whose records are the child's). The lock may have been held by a thread that the
        fork left behind."""
        forking = getattr(self._local, "state", None)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._named = {}
        self._threads = []
        if forking is not None:
            self._named[threading.current_thread().name] = 1
            forking.stack = []
            forking.batch_size = None
            self._local.state = forking
            self._threads.append(forking)
