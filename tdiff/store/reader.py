"""Reading a dump: its header, every process's records in execution order, tensors on demand.

Examples:
    >>> dump = open_dump("dumps/a")
    >>> record = dump.records[0]
    >>> dump.load(record).shape         # read from its shard, one tensor at a time
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from tdiff.store.dtypes import from_bytes_view, stored_nbytes, to_bytes_view
from tdiff.store.files import check_inside, check_regular, read_regular
from tdiff.store.fingerprint import fingerprint_algorithm, xxh3_fingerprint
from tdiff.store.manifest import DATA_DIR, DUMP_FILE, MANIFEST_DIR, Part, check_format, describe_exit, read_part
from tdiff.store.record import Record
from tdiff.store import sglang_dumper
from tdiff.store.storage import storage_for_file
from tdiff.store.tokens import TokenBatch
from tdiff.errors import DumpError


# Formats read in place besides tdiff's own (info["format"] -> how to load one record's tensor):
# their directories are indexed into records like a dump's manifests.
_FOREIGN_LOADERS = {sglang_dumper.FORMAT: sglang_dumper.load_tensor}


class RankTally:
    """How many items, and their bytes, by the rank that recorded them; added to from several
    threads (compare's --jobs)."""

    def __init__(self) -> None:
        self._counts: dict[int, tuple[int, int]] = {}
        self._adding = threading.Lock()

    def add(self, rank: int, nbytes: int = 0) -> None:
        with self._adding:
            count, total = self._counts.get(rank, (0, 0))
            self._counts[rank] = (count + 1, total + nbytes)

    def snapshot(self) -> dict[int, tuple[int, int]]:
        """rank -> (items, bytes) so far."""
        with self._adding:
            return dict(self._counts)


class Dump:
    """A dump directory opened for reading. Tensors are loaded lazily, one at a time."""

    def __init__(self, path: Path, info: dict, parts: list[Part], records: list[Record],
                 problems: list[str], ops: list[Record] | None = None):
        self.path = path
        self.info = info
        self.parts = parts
        self.records = records   # module inputs and outputs, explicit dumps: what is compared
        self.ops = ops or []     # op records (capture --ops), in execution order; bisect descends into them
        self.problems = problems
        self._shards: dict = {}  # file name -> its opened shard
        # the tensors this process loaded and their bytes: under torchrun each process says what it read
        self.reads = RankTally()

    def is_same_dump(self, other: Dump) -> bool:
        """Whether ``other`` is this dump's directory opened again (a match by construction)."""
        try:
            return os.path.samefile(self.path, other.path)
        except OSError:
            return False

    @property
    def complete(self) -> bool:
        return not self.problems

    def check_shards(self) -> None:
        """Open every shard a record points at: a truncated or damaged shard is refused before
        any verdict, also by commands that judge by fingerprints alone (bisect's stats pass)."""
        for file in sorted({r.file for r in [*self.records, *self.ops] if r.file is not None}):
            self._shard(file)

    @property
    def notes(self) -> list[str]:
        """What capture said about how it recorded (CUDA graphs, torch.compile), once each."""
        return list(dict.fromkeys(note for part in self.parts for note in part.notes))

    def token_batches(self) -> dict[tuple[int, int], TokenBatch]:
        """The token metadata of every forward, by (step, rank); where one forward was described
        twice (captured automatically, then given by ``tdiff.tokens``), the last one written.
        Empty for dumps without token metadata (format version 1, SGLang's dumper)."""
        batches: dict[tuple[int, int], TokenBatch] = {}
        for part in self.parts:
            for batch in part.tokens:
                batches[(batch.step, batch.rank)] = batch
        return batches

    @property
    def side(self) -> str:
        return str(self.info.get("side") or self.path.name)

    def load(self, record: Record) -> torch.Tensor:
        foreign = _FOREIGN_LOADERS.get(self.info.get("format", ""))
        if foreign is not None:
            tensor = foreign(self.path, record)
            self.reads.add(record.rank, tensor.numel() * tensor.element_size())
            return tensor
        if record.file is None:
            raise DumpError(f"{self.path}: {record.name} was captured in stats mode and has no data; "
                            "capture it with --mode full")
        shard = self._shard(record.file)
        stored = shard.get(record.key, nbytes=stored_nbytes(record.dtype, record.shape))
        tensor = from_bytes_view(to_bytes_view(stored), record.dtype, record.shape)
        # a bit flipped on disk must never pass as a match: check the bytes against the record
        if fingerprint_algorithm(record.fingerprint) == "xxh3" and xxh3_fingerprint(tensor) != record.fingerprint:
            raise DumpError(f"{self.path / DATA_DIR / record.file}: tensor {record.key} ({record.name}) "
                            "does not match its fingerprint: the shard is corrupted")
        self.reads.add(record.rank, stored.numel())
        return tensor

    def _shard(self, file: str):
        """The shard, its header read once (a shard holds no open file or memory map between
        reads, so memory stays that of the tensors being compared)."""
        shard = self._shards.get(file)
        if shard is None:
            path = self.path / DATA_DIR / file
            check_inside(path, self.path, "tensor file")
            check_regular(path, "tensor file")
            shard = self._shards[file] = storage_for_file(path).open(path)
        return shard


def open_dump(path: str | Path, *, allow_incomplete: bool = False) -> Dump:
    """Open and validate a dump. Raises :class:`DumpError` for anything a user must fix."""
    path = Path(path)
    try:
        return _open_dump(path, allow_incomplete)
    except OSError as exc:  # a directory of the dump that cannot be listed (permissions, I/O)
        raise DumpError(f"{exc.filename or path}: cannot read the dump ({exc.strerror or exc})") from None


def _open_dump(path: Path, allow_incomplete: bool) -> Dump:
    if not path.exists():
        raise DumpError(f"{path}: no such dump directory")
    if not path.is_dir():
        raise DumpError(f"{path}: not a dump (a dump is a directory written by `tdiff capture`)")
    header_path = path / DUMP_FILE
    if not header_path.exists():
        dumper_dir = sglang_dumper.find_dumper_dir(path)
        if dumper_dir is None:
            raise DumpError(f"{path}: not a tdiff dump (no {DUMP_FILE}) nor SGLang dumper output (no "
                            "*.pt files); capture one with `tdiff capture`")
        return _checked(Dump(dumper_dir, *sglang_dumper.index_dumper_dir(dumper_dir)), allow_incomplete)
    check_inside(header_path, path, "dump header")
    try:
        info = json.loads(read_regular(header_path, "dump header").decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise DumpError(f"{header_path}: not valid JSON (corrupted dump header)") from None
    check_format(info, str(header_path))

    manifest_dir = path / MANIFEST_DIR
    # listed, not globbed: a glob would take a directory it cannot read for an empty one
    manifest_paths = sorted(p for p in manifest_dir.iterdir() if p.suffix == ".jsonl") if manifest_dir.is_dir() else []
    for inner, what in [(manifest_dir, "manifest directory"), (path / DATA_DIR, "data directory"),
                        *((p, "manifest") for p in manifest_paths)]:
        if os.path.lexists(inner):
            check_inside(inner, path, what)
    parts = [read_part(p) for p in manifest_paths]
    parts.sort(key=lambda part: (part.rank, _started(part)))
    problems = [part.problem for part in parts if part.problem]
    exit_code = info.get("exit_code")
    if exit_code not in (None, 0):
        ending = describe_exit(exit_code) if isinstance(exit_code, int) else f"exited with code {exit_code}"
        problems.append(f"the captured command {ending}")

    records = [record for part in parts for record in sorted(part.records, key=lambda r: r.seq)]
    present = {p.name for p in (path / DATA_DIR).iterdir()} if (path / DATA_DIR).is_dir() else set()
    missing = sorted({r.file for r in records if r.file is not None and r.file not in present})
    if missing:
        problems.append(f"{len(missing)} tensor file(s) missing, first {DATA_DIR}/{missing[0]}")
        records = [r for r in records if r.file is None or r.file in present]
    ops = [r for r in records if r.role == "op"]
    records = [r for r in records if r.role != "op"]

    dump = _checked(Dump(path, info, parts, records, problems, ops), allow_incomplete)
    dump.check_shards()  # (an SGLang dumper directory's files were each read when it was indexed)
    return dump


def _checked(dump: Dump, allow_incomplete: bool) -> Dump:
    """Refuse an incomplete dump unless allowed, and an empty one always."""
    path, records, problems = dump.path, dump.records, dump.problems
    if not records and problems:
        raise DumpError(f"{path}: dump has no tensors: {problems[0]}")
    if problems and not allow_incomplete:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise DumpError(f"{path}: dump is incomplete: {problems[0]}{more}; "
                        "pass --allow-incomplete to use what is there")
    if not records:
        raise DumpError(f"{path}: dump has no tensors; check the capture's --select/--layers and that "
                        "the command ran a model")
    return dump


def _started(part: Part) -> float:
    started = part.header.get("started")
    return started if isinstance(started, (int, float)) and not isinstance(started, bool) else 0.0
