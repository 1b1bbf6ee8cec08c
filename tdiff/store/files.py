"""Reading the files of a dump (and the files a user names) with bounds: regular files only, so a
FIFO, a device or a symlink to ``/dev/zero`` is refused instead of hanging or filling memory, a
dump's files only inside its directory, and every read has a size limit.

Examples:
    >>> header = read_regular(path / "tdiff-dump.json", "dump header", limit=MAX_SMALL_FILE)
    >>> for number, line in bounded_lines(path / "manifests/p.jsonl", "manifest"): ...
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from tdiff.errors import DumpError

MAX_SMALL_FILE = 16 << 20      # a dump header, a repeat index, a patch or mapping file
MAX_MANIFEST_LINE = 64 << 20   # one manifest record; real ones are well under a megabyte


def write_all(fd: int, data) -> None:
    """Write all of ``data`` (bytes, or a buffer) at the file descriptor's offset."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def check_regular(path: Path, what: str) -> None:
    """Refuse anything but a regular file (after following symlinks) at ``path``."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DumpError(f"{path}: no such {what}") from None
    except OSError as exc:
        raise DumpError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise DumpError(f"{path}: {what} is not a regular file (it is {_kind(mode)}); "
                        "tdiff reads only regular files")


def check_inside(path: Path, dump: Path, what: str) -> None:
    """Refuse a path of a dump that resolves outside the dump's directory: a symlink out of it
    reads a file its capture never wrote, which could pass as the run's own."""
    real, top = os.path.realpath(path), os.path.realpath(dump)
    if os.path.commonpath([real, top]) != top:
        raise DumpError(f"{path}: {what} is a link to {real}, outside the dump {dump}; tdiff reads only "
                        "files inside the dump (copy the file into it)")


def open_regular(path: Path, what: str) -> BinaryIO:
    """Open a regular file for reading without blocking on a FIFO opened in its place."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise DumpError(f"{path}: no such {what}") from None
    except OSError as exc:
        raise DumpError(f"{path}: cannot read {what} ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DumpError(f"{path}: {what} is not a regular file (it is {_kind(mode)}); "
                        "tdiff reads only regular files")
    return os.fdopen(fd, "rb")


def read_regular(path: Path, what: str, *, limit: int = MAX_SMALL_FILE) -> bytes:
    """A regular file's bytes, refused when it holds more than ``limit``."""
    with open_regular(path, what) as file:
        try:
            data = file.read(limit + 1)
        except OSError as exc:
            raise DumpError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if len(data) > limit:
        raise DumpError(f"{path}: {what} is larger than {limit >> 20} MiB; it is not one tdiff wrote")
    return data


def bounded_lines(path: Path, what: str, *, limit: int = MAX_MANIFEST_LINE) -> Iterator[tuple[int, bytes]]:
    """Numbered lines of a regular file, each with its newline (the last may lack it); a line
    longer than ``limit`` is refused before more of it is read."""
    with open_regular(path, what) as file:
        for number in itertools.count(1):
            try:
                line = file.readline(limit + 1)
            except OSError as exc:
                raise DumpError(f"{path}: cannot read {what} ({exc.strerror})") from None
            if not line:
                return
            if len(line) > limit:
                raise DumpError(f"{path} line {number}: longer than {limit >> 20} MiB; "
                                f"the {what} is corrupted")
            yield number, line


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"
