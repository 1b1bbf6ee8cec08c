"""Which dump directory a Python capture (``tdiff.capture``) may write into.

The processes of one run each write a part of the dump: a program's ranks (torchrun), its
``multiprocessing`` workers, the processes it starts while it captures. They share a run id
(:func:`run_of_process`) and join the dump; the first of them to come locks it
(tdiff.store.ownership). Any other capture of the directory is refused while a run holds it, and
a new run replaces an earlier run's dump only when told (``force=True``), as ``tdiff capture``
does. (The processes that ``tdiff capture`` starts never claim: the command holds the lock.)
"""

from __future__ import annotations

import multiprocessing
import os
import shlex
import socket
import sys
from pathlib import Path

from tdiff.store.ownership import DumpLock, Holder, check_is_dump, new_run_id, prepare_folder, refuse_held

RUN_ENV = "TDIFF_RUN"   # the run id a capturing process hands the processes it starts
_ELSEWHERE = "choose another directory"


def run_of_process() -> str | None:
    """The run this process belongs to, None when it is a run of its own: the id its capturing
    parent handed it, else torchrun's job (its rendezvous id; ``none``, the default, names no job:
    then the agent that started the ranks, their parent), else the ``multiprocessing`` parent
    that started it (spawned ranks and workers of one program)."""
    run = os.environ.get(RUN_ENV)
    if run:
        return run
    host = socket.gethostname()
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic is not None:
        return f"torchelastic:{elastic}" if elastic != "none" else f"torchelastic:{host}:{os.getppid()}"
    parent = multiprocessing.parent_process()
    if parent is not None:
        return f"multiprocessing:{host}:{parent.pid}"
    return None


class Claim:
    """This process's right to write a part into a dump directory, until :meth:`release`."""

    def __init__(self, root: Path, *, force: bool):
        run = run_of_process()
        check_is_dump(root, _ELSEWHERE)
        with DumpLock.deciding(root) as lock:
            if isinstance(lock, Holder):
                if run is None or lock.run != run:
                    raise refuse_held(root, lock, _ELSEWHERE)
                run = lock.run
                self._lock: DumpLock | None = None   # the run's first process holds it
            else:
                try:
                    last = lock.last_holder()
                    if run is None or last is None or last.run != run:   # a new run: not one that paused
                        prepare_folder(root, force=force, force_hint="force=True", elsewhere=_ELSEWHERE)
                        run = run or new_run_id()
                    lock.announce(run, shlex.join([os.path.basename(sys.executable), *sys.argv]))
                except BaseException:
                    lock.release()
                    raise
                self._lock = lock
        self._previous_run = os.environ.get(RUN_ENV)
        os.environ[RUN_ENV] = run   # the processes it starts while it captures join the run

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._previous_run is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = self._previous_run
