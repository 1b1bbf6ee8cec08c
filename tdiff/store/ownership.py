"""Who may write into a dump directory: its lock, and what a new run must not replace there.

A run (one ``tdiff capture`` command, or the processes of one Python program capturing with
``tdiff.capture``) holds an exclusive ``flock`` on ``DUMP/tdiff.lock`` while it writes, and writes
into that file who it is (:class:`Holder`). The processes of the run (its ranks and workers, each
writing a part of its own) join the dump; another capture of the directory is refused while the
lock is held. The kernel drops the lock when its holder dies, so a run that crashed never leaves
the directory locked; the file itself stays (removing it would let two runs lock two files).
Claims of one directory decide one at a time (a moment's ``flock`` on the directory itself), so
a new holder has said who it is before another process reads it.

Before a new run takes a directory over, :func:`prepare_folder` refuses to replace what must not
go without being told (``--force``): records of an earlier run, files that tdiff did not write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path

from tdiff.errors import DumpError, TdiffError
from tdiff.store.manifest import DATA_DIR, DUMP_FILE, MANIFEST_DIR, read_part
from tdiff.store.modules import MODULES_DIR
from tdiff.store.repeats import REPEAT_FILE

LOCK_FILE = "tdiff.lock"


def new_run_id() -> str:
    return uuid.uuid4().hex


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a dump's lock."""

    run: str
    pid: int
    host: str
    command: str
    started: float

    def describe(self) -> str:
        if not self.pid:
            return "a process that has not said who it is"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"`{self.command}` (pid {self.pid} on {self.host}, since {when})"


_held: weakref.WeakSet[DumpLock] = weakref.WeakSet()


class DumpLock:
    """The exclusive lock on a dump directory, held by this process until :meth:`release`."""

    def __init__(self, folder: Path, fd: int):
        self.folder = folder
        self._fd = fd
        _held.add(self)

    @classmethod
    @contextlib.contextmanager
    def deciding(cls, folder: Path) -> Iterator[DumpLock | Holder]:
        """The lock on ``folder`` (created with its parents when missing), or, when another
        process holds it, who that is. Every other claim of ``folder`` waits until the block
        ends, so a new holder says who it is (:meth:`announce`) before anyone reads it."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            deciding = os.open(folder, os.O_RDONLY)
        except OSError as exc:
            raise TdiffError(f"cannot lock dump directory {folder}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(deciding, fcntl.LOCK_EX)   # held for a moment: the time to decide
            try:
                fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec
            except OSError as exc:
                raise TdiffError(f"cannot lock dump directory {folder}: {exc.strerror or exc}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                yield _parse_holder((folder / LOCK_FILE).read_bytes()) or _UNKNOWN
                return
            yield cls(folder, fd)
        finally:
            os.close(deciding)

    def last_holder(self) -> Holder | None:
        """Who held the lock before this process took it (None: nobody ever did)."""
        return _parse_holder(os.pread(self._fd, 65536, 0))

    def announce(self, run: str, command: str) -> None:
        """Say who holds the lock, for the processes it refuses and the run's own that join."""
        holder = {"run": run, "pid": os.getpid(), "host": socket.gethostname(), "command": command,
                  "started": time.time()}
        data = json.dumps(holder).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        # close, never LOCK_UN: a forked child that still has the descriptor open shares the lock,
        # and unlocking would drop it for both
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        _held.discard(self)


def _close_in_forked_child() -> None:
    """A forked child (a DataLoader worker) does not keep its parent's lock alive past the parent's run."""
    for lock in list(_held):
        lock.release()


os.register_at_fork(after_in_child=_close_in_forked_child)


_UNKNOWN = Holder(run="", pid=0, host="", command="", started=0.0)


def _parse_holder(data: bytes) -> Holder | None:
    try:
        fields = json.loads(data)
        return Holder(run=str(fields["run"]), pid=int(fields["pid"]), host=str(fields["host"]),
                      command=str(fields["command"]), started=float(fields["started"]))
    except (ValueError, TypeError, KeyError):
        return None


def refuse_held(folder: Path, holder: Holder, elsewhere: str) -> TdiffError:
    return TdiffError(f"{folder} is being written by another capture: {holder.describe()}; "
                      f"wait for it to end or {elsewhere}")


def check_is_dump(folder: Path, elsewhere: str) -> None:
    """Refuse a directory that holds something other than a dump, before anything is put into it.
    A dump another process of the run is making (its folders there, its header not yet) is one."""
    if not folder.is_dir() or (folder / DUMP_FILE).is_file() or (folder / REPEAT_FILE).is_file():
        return
    if any(not _DUMP_ENTRY.fullmatch(entry.name) for entry in folder.iterdir()):
        raise TdiffError(f"{folder} exists and is not a dump; {elsewhere}")


# what capture puts into a dump directory before its header is there (atomic_write_json's temporary name)
_DUMP_ENTRY = re.compile("|".join(re.escape(name) for name in (LOCK_FILE, MANIFEST_DIR, DATA_DIR, MODULES_DIR))
                         + rf"|\.{re.escape(DUMP_FILE)}\.\d+\.[0-9a-f]+\.tmp")


def prepare_folder(folder: Path, *, force: bool, force_hint: str, elsewhere: str) -> None:
    """Empty ``folder`` (whose lock this process holds) for a new run: a dump that holds no
    record, from a failed run, goes at once; one that holds records, or files tdiff did not
    write, only with ``force``. The lock file stays."""
    check_is_dump(folder, elsewhere)
    entries = [p for p in folder.iterdir() if p.name != LOCK_FILE]
    if not entries:
        return
    # a run that failed before recording anything leaves nothing to protect: the retry replaces it
    if not force and holds_records(folder):
        raise TdiffError(f"{folder} already holds a dump; pass {force_hint} to replace it")
    foreign = None if force else file_tdiff_did_not_write(folder)
    if foreign is not None:
        raise TdiffError(f"{folder} holds {foreign.relative_to(folder)}, which tdiff did not write; "
                         f"pass {force_hint} to replace the dump and it, or {elsewhere}")
    if folder.is_symlink():
        raise TdiffError(f"{folder} is a symbolic link; {force_hint} replaces only a dump directory itself: "
                         f"pass the directory it points to ({os.path.realpath(folder)}) instead, or {elsewhere}")
    try:
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    except OSError as exc:
        raise TdiffError(f"cannot remove the dump in {folder} ({exc.strerror or exc}); "
                         f"remove it yourself or {elsewhere}") from None


def holds_records(folder: Path) -> bool:
    """Whether a dump (or a repeat folder's runs) holds any record or tensor data, complete or
    not; a manifest that cannot be read counts as holding some."""
    for manifest in folder.rglob(f"{MANIFEST_DIR}/*.jsonl"):
        try:
            if read_part(manifest).records:
                return True
        except DumpError:
            if manifest.stat().st_size > 0:
                return True
    return any(path.is_file() for data in folder.rglob(DATA_DIR) for path in data.rglob("*"))


_REPEAT_RUN = re.compile(r"run-\d+")


def file_tdiff_did_not_write(folder: Path) -> Path | None:
    """The first path in a dump (or a repeat folder's runs) that capture does not write there: a
    file the command put next to the dump (its log, say), which only --force may remove."""
    for path in folder.rglob("*"):
        parts = path.relative_to(folder).parts
        if _REPEAT_RUN.fullmatch(parts[0]):
            parts = parts[1:]  # a repeat run's dump
        if not parts or parts in ((DUMP_FILE,), (REPEAT_FILE,)) or parts[0] in (DATA_DIR, MODULES_DIR) or (
                len(parts) == 1 and _DUMP_ENTRY.fullmatch(parts[0])):
            continue  # (tensor data counts as records: see holds_records)
        if parts[0] == MANIFEST_DIR and len(parts) == 2 and parts[1].endswith(".jsonl"):
            continue
        return path
    return None
