"""Comparing many pairs on several threads, the results in the pairs' order, and a large pair's
pieces on the threads the pairs leave idle.

Loading, the fingerprint check and the metrics of one pair run on one thread; pairs run on up to
``jobs`` threads at once. numpy's passes, reading the mapped pages and the XXH3 check of a loaded
tensor (tdiff.store.xxh3) release the GIL, so threads overlap them.

What a run returns does not depend on ``jobs``: results come back in the pairs' order, a pair's
error is raised where a one-thread run would have raised it (the earliest failing pair; the pairs
after it are abandoned), and pairs of one group (records of one stored tensor, whose verdict is
measured once and remembered) run one after another on one thread, so each group is measured once.
Memory: a group holds its pair's tensors only while it runs, and groups start only while the
bytes of those running (``weight_of``) stay within ``memory`` (one group alone always may), so
memory stays that of the largest pair plus ``memory``'s headroom, whatever ``jobs`` is.

A pair's own work can be split too (:func:`spread`: its two loads, the pieces of its metrics): the
pieces run on the calling thread and on helper threads, as many as ``jobs`` less the pairs running
at that moment (a pair waiting for memory runs nothing), so no more than ``jobs`` threads compute
at once. The largest pairs, which run nearly alone, thus use every thread; in a run of small
pairs nothing is split.

Torch runs on one thread meanwhile: the jobs are the parallelism. Its intra-op threads split each
256 K-element chunk of the metrics, too little work to pay for waking them: on this project's
2-core machine under load, a planted pair took 6 to 11 s with torch's 2 threads against 1.2 to
1.6 s with one (docs/PERFORMANCE.md, issue 32).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class _Budget:
    """Bytes that running groups may hold at once; a group larger than all of it runs alone."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self._changed = threading.Condition()

    def take(self, nbytes: int) -> int:
        nbytes = min(nbytes, self.limit)
        with self._changed:
            self._changed.wait_for(lambda: self.held + nbytes <= self.limit)
            self.held += nbytes
        return nbytes

    def give_back(self, nbytes: int) -> None:
        with self._changed:
            self.held -= nbytes
            self._changed.notify_all()


class _Failed:
    """A pair's error, kept until the pairs before it have been handed out."""

    def __init__(self, error: Exception):
        self.error = error


class _Groups(Generic[Item]):
    def __init__(self, items: Sequence[Item], group_of: Callable[[Item], Hashable | None]):
        self.members: list[list[int]] = []   # item indices of each group, groups by their first item
        self.of_item: list[tuple[int, int]] = []   # (group, position in it) of each item
        by_key: dict[Hashable, int] = {}
        for index, item in enumerate(items):
            key = group_of(item)
            group = by_key.get(key) if key is not None else None
            if group is None:
                group = len(self.members)
                self.members.append([])
                if key is not None:
                    by_key[key] = group
            self.of_item.append((group, len(self.members[group])))
            self.members[group].append(index)


def map_in_order(work: Callable[[Item], Result], items: Sequence[Item], *, jobs: int,
                 group_of: Callable[[Item], Hashable | None] = lambda item: None,
                 weight_of: Callable[[Item], int] = lambda item: 0, memory: int = 0,
                 progress: Callable[[int, int], None] | None = None) -> list[Result]:
    """``[work(item) for item in items]`` on up to ``jobs`` threads, as said above; ``progress(done,
    total)`` is called on the calling thread as results are handed out, in order."""
    results, error = map_until_error(work, items, jobs=jobs, group_of=group_of, weight_of=weight_of,
                                     memory=memory, progress=progress)
    if error is not None:
        raise error
    return results


def map_until_error(work: Callable[[Item], Result], items: Sequence[Item], *, jobs: int,
                    group_of: Callable[[Item], Hashable | None] = lambda item: None,
                    weight_of: Callable[[Item], int] = lambda item: 0, memory: int = 0,
                    progress: Callable[[int, int], None] | None = None
                    ) -> tuple[list[Result], Exception | None]:
    """:func:`map_in_order`'s results up to the first item whose work raised, and that error
    (None when every item was done)."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    with _torch_on_one_thread(), _Helpers.of(jobs) as helpers:
        return _map_until_error(helpers.running(work), items, jobs, group_of, weight_of, memory, progress)


@contextmanager
def lending(jobs: int) -> Iterator[None]:
    """Meanwhile, :func:`spread` on the calling thread shares pieces with up to ``jobs - 1`` other
    threads (work outside :func:`map_in_order`: bisect's look at the modules around its culprit)."""
    with _torch_on_one_thread(), _Helpers.of(jobs) as helpers, helpers.computing():
        yield


def spread(pieces: Sequence[Callable[[], Result]]) -> list[Result]:
    """``[piece() for piece in pieces]``, the pieces shared with the idle threads of the
    :func:`map_in_order` this runs in (on its own, or with no thread idle, one after another);
    the error of the earliest piece that raised is raised, once every piece started has ended."""
    helpers = getattr(_current, "helpers", None)
    if helpers is None or len(pieces) < 2:
        return [piece() for piece in pieces]
    return helpers.spread(pieces)


_current = threading.local()   # the _Helpers of the map_in_order whose work this thread runs


class _Helpers:
    """The threads of one :func:`map_in_order` that run no item: :func:`spread` lends them pieces.
    At most ``jobs`` threads compute at once, items and lent helpers together; an item waiting to
    start calls the helpers back (each ends with the piece it holds), since items come in order
    and the results wait for them."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self._busy = 0      # threads computing: items running, helpers lent
        self._waiting = 0   # items waiting for a thread to be given back
        self._changed = threading.Condition()
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    @contextmanager
    def of(cls, jobs: int) -> Iterator[_Helpers]:
        helpers = cls(jobs)
        try:
            yield helpers
        finally:
            if helpers._pool is not None:
                helpers._pool.shutdown(wait=True)

    def running(self, work: Callable[[Item], Result]) -> Callable[[Item], Result]:
        """``work``, run once a thread is free of lent pieces, its :func:`spread` lent to these helpers."""
        def counted(item: Item) -> Result:
            with self.computing():
                return work(item)
        return counted

    @contextmanager
    def computing(self) -> Iterator[None]:
        """The calling thread counted as computing, once a thread is free of lent pieces; its
        :func:`spread` lends pieces to these helpers meanwhile."""
        with self._changed:
            self._waiting += 1
            self._changed.wait_for(lambda: self._busy < self.jobs)
            self._waiting -= 1
            self._busy += 1
        before = getattr(_current, "helpers", None)
        _current.helpers = self
        try:
            yield
        finally:
            _current.helpers = before
            self._give_back()

    def _give_back(self) -> None:
        with self._changed:
            self._busy -= 1
            self._changed.notify_all()

    def spread(self, pieces: Sequence[Callable[[], Result]]) -> list[Result]:
        with self._changed:
            lent = max(0, min(self.jobs - self._busy, len(pieces) - 1)) if not self._waiting else 0
            self._busy += lent
        outcomes: list = [None] * len(pieces)
        indices = itertools.count()   # next() is atomic under the GIL: each piece is taken once
        stop = threading.Event()      # a piece failed, or the caller was interrupted: start no more

        def take_pieces(called_back: Callable[[], bool]) -> None:
            while not stop.is_set() and not called_back() and (index := next(indices)) < len(pieces):
                try:
                    outcomes[index] = pieces[index]()
                except Exception as exc:  # noqa: BLE001 - raised below, the earliest first
                    outcomes[index] = _Failed(exc)
                    stop.set()

        def helper() -> None:
            before = getattr(_current, "helpers", None)
            _current.helpers = self
            try:
                take_pieces(lambda: self._waiting > 0)
            finally:
                _current.helpers = before
                self._give_back()

        futures = [self._executor().submit(helper) for _ in range(lent)]
        try:
            take_pieces(lambda: False)
        except BaseException:   # an interrupt: the helpers end with the pieces they hold
            stop.set()
            raise
        finally:
            for future in futures:
                future.result()
        for outcome in outcomes:
            if isinstance(outcome, _Failed):
                raise outcome.error
        return outcomes

    def _executor(self) -> ThreadPoolExecutor:
        with self._changed:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="tdiff-piece")
            return self._pool


@contextmanager
def _torch_on_one_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _map_until_error(work, items, jobs, group_of, weight_of, memory, progress):
    total = len(items)
    results: list = []
    if jobs == 1 or total < 2:
        for done, item in enumerate(items, 1):
            try:
                results.append(work(item))
            except Exception as exc:  # noqa: BLE001 - the caller raises it
                return results, exc
            if progress is not None:
                progress(done, total)
        return results, None

    groups = _Groups(items, group_of)
    budget = _Budget(memory)

    def run_group(group: int) -> list:
        done: list = []
        held = budget.take(max(weight_of(items[index]) for index in groups.members[group]))
        try:
            for index in groups.members[group]:
                try:
                    done.append(work(items[index]))
                except Exception as exc:  # noqa: BLE001 - raised on the calling thread, in order
                    done.append(_Failed(exc))
                    break
        finally:
            budget.give_back(held)
        return done

    futures: dict[int, Future] = {}
    submitted = 0
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="tdiff-compare") as pool:
        try:
            for index in range(total):
                group, position = groups.of_item[index]
                while submitted < len(groups.members) and submitted <= group + 2 * jobs:
                    futures[submitted] = pool.submit(run_group, submitted)
                    submitted += 1
                outcome = futures[group].result()[position]
                if position == len(groups.members[group]) - 1:
                    del futures[group]   # its last pair is handed out: let its results go
                if isinstance(outcome, _Failed):
                    return results, outcome.error
                results.append(outcome)
                if progress is not None:
                    progress(index + 1, total)
        finally:
            for future in futures.values():   # after an error or an interrupt: abandon the rest
                future.cancel()
    return results, None
