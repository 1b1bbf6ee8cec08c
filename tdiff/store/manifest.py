"""The dump's manifests: one JSON-lines journal per writing process, plus the dump's own header.

Layout of a dump directory (docs/FORMAT.md has the full description):

    tdiff-dump.json              the dump: format version, side, mode, the command and its exit code
    manifests/<part>.jsonl       one per process: a header line, record lines (a CUDA graph's replays in
                                 stats mode: graph and replay lines), an end line
    data/<part>.sNNNNN.<ext>     tensor shards of that process (safetensors or h5)

A part's records are appended only after the shard holding their bytes has been renamed into
place, so every record on disk points at complete data. A part without its end line belongs to a
process that died (or is still running): the dump is incomplete. A forked child's part (which
often ends through ``os._exit``, with no end line) says with a "settled" line each time all it has
recorded is on disk, and with a "resumed" line that it records again: a part whose last line is
a "settled" one ended there.
"""

from __future__ import annotations

import json
import os
import re
import threading
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from tdiff.store.files import bounded_lines, write_all
from tdiff.store.graph_replays import GraphLines
from tdiff.store.record import Record
from tdiff.store.tokens import TokenBatch
from tdiff.errors import DumpError

FORMAT = "tdiff-dump"
FORMAT_VERSION = 5   # 2: "tokens" lines (token metadata per forward); 3: records of role "op" (capture --ops);
                     # 4: "settled" lines (a forked child's part); 5: "graph" and "replay" lines (a CUDA
                     # graph's replays in stats mode); older dumps still read
DUMP_FILE = "tdiff-dump.json"
STORAGES = ("safetensors", "h5")   # tensor shard formats (tdiff.store.storage)
MANIFEST_DIR = "manifests"
DATA_DIR = "data"


def new_part_id() -> str:
    host = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:24] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def atomic_write_json(path: Path, data: dict, *, replace: bool = True) -> bool:
    """Write JSON through a temporary name. With replace=False an existing file is kept.

    Returns whether this call's content is now at ``path``.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        if replace:
            os.replace(tmp, path)
            return True
        os.link(tmp, path)  # atomic, and fails when another process created it first
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)  # also when writing failed half-way (a full disk)


def check_format(data: object, where: str) -> dict:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DumpError(f"{where}: not a tdiff dump header")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise DumpError(f"{where}: the format version is missing or not an integer")
    if version > FORMAT_VERSION:
        raise DumpError(
            f"{where}: dump format version {version} is newer than this tdiff reads "
            f"({FORMAT_VERSION}); upgrade tdiff")
    return data


def create_dump(root: Path, info: dict) -> None:
    """Make ``root`` a dump directory (idempotent; concurrent writers agree on one header)."""
    try:
        (root / MANIFEST_DIR).mkdir(parents=True, exist_ok=True)
        (root / DATA_DIR).mkdir(exist_ok=True)
        header = {"format": FORMAT, "version": FORMAT_VERSION, "created": time.time(), **info}
        atomic_write_json(root / DUMP_FILE, header, replace=False)
    except OSError as exc:
        raise DumpError(f"cannot create dump directory {root}: {exc.strerror}") from None


def describe_exit(returncode: int) -> str:
    """How a command ended, as the dump's exit_code records it (negative: killed by a signal)."""
    return f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"


def update_dump_info(root: Path, **info) -> None:
    path = root / DUMP_FILE
    try:
        data = json.loads(path.read_text())
        data.update(info)
        atomic_write_json(path, data)
    except OSError as exc:
        raise DumpError(f"{path}: cannot record {', '.join(info)} ({exc.strerror or exc}); "
                        "the dump's header is unchanged") from None


class ManifestJournal:
    """Appends one process's header, records and end line to its manifest part.

    Unbuffered: each append is in the file when it returns (a process leaving through
    ``os._exit`` keeps it), and a forked child, which inherits the file, has no buffer of the
    parent's to flush into it."""

    def __init__(self, root: Path, part: str, header: dict):
        self.path = root / MANIFEST_DIR / f"{part}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._lock = threading.Lock()   # shard writers append in turn; resume() comes from a hook
        self._write({"type": "header", "format": FORMAT, "version": FORMAT_VERSION, "part": part,
                     "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                     **header})

    def _write(self, *lines: dict) -> None:
        data = b"".join(_encode(line) for line in lines)
        with self._lock:
            write_all(self._fd, data)

    def append(self, records: list[Record], tokens: Sequence[TokenBatch] = (), graph_lines: Sequence[dict] = ()) -> None:
        """``graph_lines``: graph and replay lines (tdiff.store.graph_replays), in the order written."""
        lines = [{"type": "tokens", **t.to_json()} for t in tokens]
        lines += graph_lines
        lines += [{"type": "record", **r.to_json()} for r in records]
        if lines:
            self._write(*lines)

    def settle(self, records: int, notes: Sequence[str] = ()) -> None:
        """Say that the part's ``records`` records (all it has) are on disk, with the notes so far."""
        self._write({"type": "settled", "records": records, **({"notes": list(notes)} if notes else {})})

    def resume(self) -> None:
        """Say that the process records again after settling: until it settles again, a part
        that ends here was cut short."""
        self._write({"type": "resumed"})

    def end(self, records: int, error: str | None = None, notes: Sequence[str] = ()) -> None:
        try:
            self._write({"type": "end", "records": records, "status": "failed" if error else "complete",
                         **({"error": error} if error else {}), **({"notes": list(notes)} if notes else {})})
        finally:
            os.close(self._fd)


def _encode(line: dict) -> bytes:
    """One manifest line. orjson writes compact JSON in a tenth of the time json's encoder takes
    (the writer encodes a line per captured tensor: half its work with json). json writes the
    lines orjson would change or refuses: orjson writes NaN and infinities as null (an infinite
    max would read back as "undefined"), and refuses integers past 64 bits and keys that are not
    strings. A line with a null in it goes to json too: null is rare, and checking for it is cheap."""
    try:
        encoded = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:
        encoded = None
    if encoded is None or b"null" in encoded:
        return (json.dumps(line, separators=(",", ":")) + "\n").encode()
    return encoded


@dataclass
class Part:
    """One process's manifest, as read back."""

    name: str
    header: dict
    records: list[Record] = field(default_factory=list)
    problem: str | None = None   # why this part is incomplete, None when it is complete
    notes: list[str] = field(default_factory=list)  # what capture said about how it recorded
    tokens: list[TokenBatch] = field(default_factory=list)  # token metadata, in the order written

    @property
    def rank(self) -> int:
        return min((r.rank for r in self.records), default=0)


_EMPTY = "manifest is empty (the process died before writing its header)"


def read_part(path: Path) -> Part:
    where = f"{path}"
    part = Part(name=path.stem, header={})
    end = None
    settled = None   # the last line, when it is a "settled" line
    graphs = GraphLines(where)
    number = 0
    for number, raw in bounded_lines(path, "manifest"):
        truncated = not raw.endswith(b"\n")  # only the last line can lack its newline
        try:
            # json, not orjson: orjson reads an integer past 64 bits (a request id) as a float
            entry = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            if number == 1 and not raw.strip():
                raise DumpError(f"{where}: {_EMPTY}") from None
            if truncated:
                part.problem = f"manifest {path.name} ends mid-record: its process died while writing"
                break
            what = {UnicodeDecodeError: "not UTF-8 text", RecursionError: "nested too deeply"}.get(
                type(exc), "not valid JSON")
            raise DumpError(f"{where} line {number}: {what} (corrupted manifest)") from None
        if not isinstance(entry, dict):
            raise DumpError(f"{where} line {number}: not a JSON object (corrupted manifest)")
        kind = entry.pop("type", None)
        settled = entry if kind == "settled" else None
        if number == 1:
            if kind != "header":
                raise DumpError(f"{where} line 1: the manifest does not start with its header")
            part.header = check_format(entry, f"{where} line 1")
        elif end is not None:
            raise DumpError(f"{where} line {number}: data after the end line (corrupted manifest)")
        elif kind == "record":
            part.records.append(Record.from_json(entry, f"{where} line {number}"))
        elif kind == "tokens":
            part.tokens.append(TokenBatch.from_json(entry, f"{where} line {number}"))
        elif kind == "graph":
            graphs.graph(entry, number)
        elif kind == "replay":
            part.records += graphs.replay(entry, number)
        elif kind == "end":
            end = entry
        elif kind in ("settled", "resumed"):
            pass
        else:
            raise DumpError(f"{where} line {number}: unknown entry type {kind!r}")
    if number == 0:
        raise DumpError(f"{where}: {_EMPTY}")
    if part.problem is None and end is None and settled is not None and settled.get("records") == len(part.records):
        end = settled
        part.notes.append(f"manifest {path.name} ended without an end line, after a model call or dump that "
                          f"completed, all its {len(part.records)} records written (a forked child that left through "
                          "os._exit, or was ended by a signal between model calls): what the process did "
                          "after that was not recorded")
    elif part.problem is None:
        part.problem = _end_problem(path, end, len(part.records))
    notes = (end or {}).get("notes")
    if isinstance(notes, list):
        part.notes = [str(note) for note in notes] + part.notes
    part.records = [_with_part(r, part.name) for r in part.records]
    return part


def _end_problem(path: Path, end: dict | None, count: int) -> str | None:
    if end is None:
        return f"manifest {path.name} has no end line: its process died or is still running"
    if end.get("status") != "complete":
        return f"manifest {path.name}: capture failed: {end.get('error', 'unknown error')}"
    if end.get("records") != count:
        return f"manifest {path.name} lists {count} records but its end line says {end.get('records')}"
    return None


def _with_part(record: Record, part: str) -> Record:
    record.part = part
    return record
