"""Comparing one dump pair with several processes, on torch.distributed (torchrun, any number of nodes).

Started as ``torchrun --nnodes K --nproc-per-node M -m tdiff compare A B``, every process opens
both dumps (their manifests: the tensors stay on the shared filesystem) and pairs them the same
way; the pairs are split by the rank that recorded them (dump ranks dealt round-robin over the
processes), each process loads and measures its own share only, and the verdicts are gathered in
the pairs' order, so every process holds the report a single process would have made. Only the
first process (global rank 0) writes anything: the others' output goes to /dev/null.

The processes talk over gloo (CPU): what travels is the verdicts, never a tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

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


def map_over_processes(work: Callable[[Sequence[int]], tuple[list[Result], Exception | None]],
                       items: Sequence[Item], *, owner_key: Callable[[Item], Hashable],
                       world: tuple[int, int], notes: Callable[[], list[str]] = list,
                       take_note: Callable[[str], None] = lambda note: None) -> list[Result]:
    """``work(indices)`` run by each process on its share of ``items`` (the items of one owner key
    all go to one process; keys dealt round-robin in sorted order), the results of all gathered in
    the items' order on every process. ``work`` returns its results up to the first item that
    failed, and that error (tdiff.compare.parallel.map_until_error): the error of the earliest
    failing item over all processes is raised on every process, as a one-process run raises it.
    ``notes()`` (what the work wrote down beside its results: replica warnings) of every process
    is handed to ``take_note`` on every process."""
    import torch.distributed as dist

    rank, size = world
    keys = sorted({owner_key(item) for item in items}, key=repr)
    process_of = {key: position % size for position, key in enumerate(keys)}
    mine = [index for index, item in enumerate(items) if process_of[owner_key(item)] == rank]
    results, error = work(mine)
    outcome = (mine, results, error, notes())
    with _process_group():
        gathered: list = [None] * size
        dist.all_gather_object(gathered, outcome)
    for *_, written in gathered:
        for note in written:
            take_note(note)
    return _merged(gathered, len(items))


def _merged(gathered: list, total: int) -> list:
    results: list = [None] * total
    failures: list[tuple[int, BaseException]] = []
    for indices, done, error, _ in gathered:
        for index, result in zip(indices, done):
            results[index] = result
        if error is not None:
            failures.append((indices[len(done)], error))
    if failures:
        first = min(failures, key=lambda failure: failure[0])
        raise first[1]
    return results
