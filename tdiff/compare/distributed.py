"""Comparing one dump pair with several processes, on torch.distributed (torchrun, any number of nodes).

Started as ``torchrun --nnodes K --nproc-per-node M -m tdiff compare A B``, every process opens
both dumps (their manifests: the tensors stay on the shared filesystem) and pairs them the same
way; the pairs are split by the rank that recorded them (dump ranks dealt round-robin over the
processes), each process loads and measures its own share only, and the verdicts are gathered in
the pairs' order, so every process holds the report a single process would have made. Only the
first process (global rank 0) writes anything: the others' output goes to /dev/null.

The processes talk over gloo (CPU): what travels is the verdicts, never a tensor. With them each
process sends what it counted of its own work (:class:`ProcessShare`: the pairs or events its
comparator compared and the tensors its dumps loaded, by the rank that recorded them), which the
first process prints on stderr: the one account of who read what, since the report itself is the
single-process one byte for byte.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from tdiff.store.reader import RankTally

Item = TypeVar("Item")
Result = TypeVar("Result")


def torchrun_world() -> tuple[int, int] | None:
    """(this process's rank, the number of processes) when torchrun started several, else None."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    # torchrun's own variable, not only WORLD_SIZE: a shell inside a training job's launcher may
    # export those, and a compare run there alone would wait for processes that never come
    if world < 2 or "TORCHELASTIC_RUN_ID" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    return rank, world


def silence_other_ranks() -> None:
    """Under torchrun, send every process's output but global rank 0's to /dev/null: one verdict,
    table or JSON is printed, not one per process."""
    world = torchrun_world()
    if world is None or world[0] == 0:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


@contextmanager
def _process_group() -> Iterator[None]:
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


Tally = dict[int, tuple[int, int]]   # rank -> (items, bytes): tdiff.store.reader.RankTally's snapshot


@dataclass(frozen=True)
class Counting:
    """Where a process's work is counted: ``compared`` counts each pair or event its comparator
    compared (``unit``), ``read`` the tensors each dump loaded."""

    unit: str
    compared: RankTally
    read: Sequence[RankTally]

    def counted(self) -> tuple[Tally, Tally]:
        reads: Tally = {}
        for tally in self.read:
            for rank, (count, nbytes) in tally.snapshot().items():
                before = reads.get(rank, (0, 0))
                reads[rank] = (before[0] + count, before[1] + nbytes)
        return self.compared.snapshot(), reads


@dataclass(frozen=True)
class ProcessShare:
    """What one process did of a run under torchrun, as it counted it: the dump ranks dealt to it,
    the pairs or events it compared and the tensors it loaded (each by the rank that recorded
    them), and how long its share took."""

    process: int
    processes: int
    host: str
    dealt: tuple[Hashable, ...]
    unit: str
    compared: Tally
    read: Tally
    seconds: float

    def describe(self) -> str:
        compared = sum(count for count, _ in self.compared.values())
        tensors = sum(count for count, _ in self.read.values())
        nbytes = sum(total for _, total in self.read.values())
        read = (f"read {tensors:,} tensor(s) of rank(s) {_listed(self.read)} ({nbytes / 1e6:,.1f} MB)"
                if tensors else "read no tensor")
        return (f"tdiff: process {self.process} of {self.processes} ({self.host}) was dealt rank(s) "
                f"{_listed(self.dealt) or 'none'}: compared {compared:,} {self.unit} of rank(s) "
                f"{_listed(self.compared) or 'none'}; {read}; {self.seconds:.2f} s")


def _listed(ranks) -> str:
    return ", ".join(str(rank) for rank in sorted(ranks, key=repr))


def _difference(after: Tally, before: Tally) -> Tally:
    out = {}
    for rank, (count, nbytes) in after.items():
        was = before.get(rank, (0, 0))
        if count > was[0]:
            out[rank] = (count - was[0], nbytes - was[1])
    return out


def map_over_processes(work: Callable[[Sequence[int]], tuple[list[Result], Exception | None]],
                       items: Sequence[Item], *, owner_key: Callable[[Item], Hashable],
                       world: tuple[int, int], counting: Counting, echo: Callable[[str], None] | None = None,
                       notes: Callable[[], list[str]] = list,
                       take_note: Callable[[str], None] = lambda note: None) -> list[Result]:
    """``work(indices)`` run by each process on its share of ``items`` (the items of one owner key
    all go to one process; keys dealt round-robin in sorted order), the results of all gathered in
    the items' order on every process. ``work`` returns its results up to the first item that
    failed, and that error (tdiff.compare.parallel.map_until_error): the error of the earliest
    failing item over all processes is raised on every process, as a one-process run raises it.
    ``notes()`` (what the work wrote down beside its results: replica warnings) of every process
    is handed to ``take_note`` on every process. When no item failed, the first process ``echo``es
    what each process counted of its own work while it ran (``counting``), a line for each."""
    import torch.distributed as dist

    rank, size = world
    keys = sorted({owner_key(item) for item in items}, key=repr)
    process_of = {key: position % size for position, key in enumerate(keys)}
    mine = [index for index, item in enumerate(items) if process_of[owner_key(item)] == rank]
    compared_before, read_before = counting.counted()
    started = time.perf_counter()
    results, error = work(mine)
    seconds = time.perf_counter() - started
    compared, read = counting.counted()
    share = ProcessShare(process=rank, processes=size, host=socket.gethostname(),
                         dealt=tuple(key for key in keys if process_of[key] == rank), unit=counting.unit,
                         compared=_difference(compared, compared_before), read=_difference(read, read_before),
                         seconds=seconds)
    outcome = (mine, results, error, notes(), share)
    with _process_group():
        gathered: list = [None] * size
        dist.all_gather_object(gathered, outcome)
    for _, _, _, written, _ in gathered:
        for note in written:
            take_note(note)
    merged = _merged(gathered, len(items))
    if echo is not None and rank == 0:
        for *_, process_share in gathered:
            echo(process_share.describe())
    return merged


def _merged(gathered: list, total: int) -> list:
    results: list = [None] * total
    failures: list[tuple[int, BaseException]] = []
    for indices, done, error, _, _ in gathered:
        for index, result in zip(indices, done):
            results[index] = result
        if error is not None:
            failures.append((indices[len(done)], error))
    if failures:
        first = min(failures, key=lambda failure: failure[0])
        raise first[1]
    return results
