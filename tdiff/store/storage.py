"""Tensor shard files: safetensors (default) or HDF5.

A shard is written once, to a temporary name, then renamed into place. Every tensor is stored
as its raw bytes: natively typed where the file format knows the dtype (so other tools can open
the shard), as uint8 otherwise (float8_e8m0, complex32, sub-byte types); the record's dtype and
shape rebuild it bit-exactly.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import mmap
import os
import struct
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from tdiff.store.dtypes import dtype_name, to_bytes_view
from tdiff.store.files import open_regular, write_all
from tdiff.store.manifest import STORAGES
from tdiff.errors import DumpError


# The dtype names of the safetensors header (its format specification) that tdiff stores natively;
# any other dtype is stored as its bytes (uint8).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}

# safetensors' dtype names by torch dtype
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class SafetensorsStorage:
    suffix = "safetensors"

    def __init__(self):
        self._last_stream: SafetensorsStream | None = None

    def write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors import TensorSpec, serialize_file

        storable = {key: t if t.dtype in _SAFETENSORS_NAMES and t.is_contiguous() else to_bytes_view(t)
                    for key, t in tensors.items()}
        # Not safetensors.torch.save_file: it asks every tensor for its storage, to refuse tensors
        # that share memory (~180 us a tensor for pinned memory on the GPU machine, a third of a
        # forward's writing there); each of these is a copy of its own, alive until this returns
        # (its dtype names are torch's)
        specs = {key: TensorSpec(dtype=dtype_name(t.dtype), shape=list(t.shape), data_ptr=t.data_ptr(),
                                 data_len=t.numel() * t.element_size())
                 for key, t in storable.items()}
        _write_atomically(path, lambda tmp: serialize_file(specs, str(tmp)))

    def open(self, path: Path):
        return _SafetensorsShard(path, _read_safetensors_index(path))

    def stream(self, path: Path) -> SafetensorsStream:
        """A shard to write tensor by tensor. Its header room is twice what the last one's header
        needed (so a shard that filled its room is followed by one with twice the room), within
        :data:`STREAM_HEADER_ROOM` and :data:`MAX_STREAM_HEADER_ROOM`."""
        room = STREAM_HEADER_ROOM
        if self._last_stream is not None:
            wanted = 2 * self._last_stream.header_wanted
            room = max(STREAM_HEADER_ROOM, min(MAX_STREAM_HEADER_ROOM, wanted + -wanted % _ALIGNMENT))
        self._last_stream = SafetensorsStream(path, room)
        return self._last_stream


T = TypeVar("T")
_ALIGNMENT = 8   # each tensor's bytes start on a multiple of this: mapped, each is aligned for its dtype
STREAM_HEADER_ROOM = 64 << 10   # a streamed shard's header room at least: ~700 tensors' entries
MAX_STREAM_HEADER_ROOM = 16 << 20


class HeaderFull(Exception):
    """The shard's reserved header room cannot list one more tensor: the shard must end first."""

    def __init__(self, path: Path, key: str):
        super().__init__(f"the header room of {path.name} has no space for tensor {key!r}")


class _Stream:
    """A shard file written as tensors come, under a temporary name (every shard is renamed
    into place once complete): the bytes go from the tensor into the page cache, which is their
    snapshot. Not thread-safe: its writer serialises the calls."""

    def __init__(self, path: Path, data_start: int):
        self.path = path
        self.nbytes = 0   # data bytes written
        self._tmp = _temporary_path(path)
        self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._data_start = data_start
        self._allocating = True

    def _append_bytes(self, nbytes: int, write: Callable[[Callable], T], key: str) -> T:
        """``write(sink)`` hands ``sink`` the tensor's ``nbytes`` bytes in order. Cut short (an
        error, an interrupt), the file is taken back to where the tensor began: the shard stays
        whole, and can still be sealed with the tensors before it."""
        begin = self.nbytes
        try:
            self._allocate(self._data_start + begin, nbytes)
            result = write(self._write)
            if self.nbytes - begin != nbytes:
                raise RuntimeError(f"tensor {key!r} gave {self.nbytes - begin} bytes, not {nbytes}")
        except BaseException:
            self.nbytes = begin
            os.ftruncate(self._fd, self._data_start + begin)
            os.lseek(self._fd, self._data_start + begin, os.SEEK_SET)
            raise
        return result

    def _allocate(self, offset: int, nbytes: int) -> None:
        """Allocate the file's blocks for the bytes about to be written, where the file system
        can: ext4 then takes the tensor's pages into one extent at once instead of reserving
        blocks page by page as they are written (full mode's 171 MB a forward: ~30% less time in
        the writes, docs/PERFORMANCE.md section 1). Extends the file as the write would; where
        it fails, the write goes on without (and reports a full disk itself)."""
        if not self._allocating or not nbytes:
            return
        if _fallocate is None or _fallocate(self._fd, 0, offset, nbytes) != 0:
            self._allocating = False

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.nbytes += len(view)
        write_all(self._fd, view)

    def discard(self) -> None:
        """Give the file up (writing failed); never raises: it runs on the way out of a failure."""
        with contextlib.suppress(OSError):
            self._close()
        with contextlib.suppress(OSError):
            self._tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        fd, self._fd = self._fd, -1   # closed once, even when closing fails
        if fd >= 0:
            os.close(fd)


class SafetensorsStream(_Stream):
    """A safetensors shard written tensor by tensor, at the moment each is recorded (full mode's
    capture of host tensors). The header, unknown until the shard ends, goes into room reserved
    at the start of the file and is padded with spaces (as safetensors pads its own); where a
    tensor would start off an 8-byte boundary, the bytes of padding before it are listed under a
    key of their own, ``_pad<offset>``, since safetensors allows no gaps between tensors."""

    def __init__(self, path: Path, header_room: int):
        super().__init__(path, header_room)
        self.header_room = header_room
        self.header_wanted = 8 + 2   # bytes the header needs (length and "{}"), or needed when it filled
        self._entries: list[bytes] = []
        os.lseek(self._fd, header_room, os.SEEK_SET)

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, key: str, tensor: torch.Tensor, write: Callable[[Callable], T]) -> T:
        """Store ``tensor`` (on the host) under ``key``: ``write(sink)`` must hand ``sink`` the
        tensor's bytes (as :func:`tdiff.store.dtypes.to_bytes_view` gives them) in order; its
        result is returned. Raises :class:`HeaderFull` before writing anything when the header
        has no room left for the tensor."""
        nbytes = tensor.numel() * tensor.element_size()
        native = _SAFETENSORS_NAMES.get(tensor.dtype)
        dtype, shape = (native, list(tensor.shape)) if native is not None else ("U8", [nbytes])
        padding = -self.nbytes % _ALIGNMENT
        entries = [self._entry(f"_pad{self.nbytes}", "U8", [padding], self.nbytes)] if padding else []
        entries.append(self._entry(key, dtype, shape, self.nbytes + padding))
        wanted = self.header_wanted + sum(len(entry) + 1 for entry in entries)
        if wanted > self.header_room:
            self.header_wanted = wanted
            raise HeaderFull(self.path, key)
        def padded(sink) -> T:
            if padding:
                sink(bytes(padding))
            return write(sink)

        result = self._append_bytes(padding + nbytes, padded, key)
        self._entries += entries
        self.header_wanted = wanted
        return result

    @staticmethod
    def _entry(key: str, dtype: str, shape: list[int], begin: int) -> bytes:
        nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        return json.dumps({key: {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + nbytes]}},
                          separators=(",", ":")).encode()[1:-1]

    def seal(self) -> None:
        """Write the header into its room and rename the file into place."""
        length = self.header_room - 8
        header = b"{" + b",".join(self._entries) + b"}"
        os.lseek(self._fd, 0, os.SEEK_SET)
        write_all(self._fd, memoryview(struct.pack("<Q", length) + header.ljust(length, b" ")))
        self._close()
        os.replace(self._tmp, self.path)


# The safetensors format: a little-endian u64 header length, a JSON header mapping each key to
# its dtype, shape and [begin, end) byte offsets into the data that follows, then the data.
MAX_SAFETENSORS_HEADER = 100_000_000   # safetensors' own limit


@dataclass(frozen=True)
class _Entry:
    begin: int   # [begin, end) in the data after the header
    end: int


class _SafetensorsShard:
    """A safetensors shard's header, read once; every tensor is a map of its own bytes, which
    lives as long as the tensor. (Opening the shard with safetensors for each read cost a header
    parse per tensor; one map of the whole shard, kept open, would hold every page read so far
    resident; reading into fresh memory costs a copy and its page faults.)"""

    def __init__(self, path: Path, index: tuple[int, dict[str, _Entry]]):
        self._path = path
        self._data_start, self._entries = index

    def get(self, key: str, *, nbytes: int) -> torch.Tensor:
        """The raw bytes (uint8) stored under ``key``, when its header declares the ``nbytes``
        its record expects."""
        entry = self._entries.get(key)
        if entry is None:
            raise DumpError(f"{self._path}: tensor {key!r} is missing from its shard")
        if entry.end - entry.begin != nbytes:
            raise DumpError(f"{self._path}: tensor {key!r} declares {entry.end - entry.begin} bytes, its record "
                            f"says {nbytes}: the shard is corrupted")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        start = self._data_start + entry.begin
        mapped_from = start - start % mmap.ALLOCATIONGRANULARITY
        with open_regular(self._path, "tensor file") as file:
            if os.fstat(file.fileno()).st_size < start + nbytes:
                raise DumpError(f"{self._path}: cannot read tensor {key!r} (the file ends before it); "
                                "the file is truncated or corrupted")
            try:
                mapped = _map_copy_on_write(file.fileno(), start + nbytes - mapped_from, mapped_from)
            except OSError as exc:
                if exc.errno != errno.ENOMEM:
                    raise DumpError(f"{self._path}: cannot map tensor {key!r} ({exc.strerror})") from None
                # past the process's limit of maps (vm.max_map_count, ~65k: a map per tensor held)
                return _read_bytes(file, start, nbytes, f"{self._path}: tensor {key!r}")
        # the tensor keeps the map alive and the map ends with it; copy-on-write, so writable
        return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=start - mapped_from)


def _read_bytes(file, start: int, nbytes: int, what: str) -> torch.Tensor:
    """``nbytes`` of the file from ``start``, read into memory of their own."""
    data = torch.empty(nbytes, dtype=torch.uint8)
    view = data.numpy().data
    done = 0
    while done < nbytes:
        count = os.preadv(file.fileno(), [view[done:]], start + done)
        if count == 0:
            raise DumpError(f"{what}: the file ends before it; the file is truncated or corrupted")
        done += count
    return data


def _map_copy_on_write(fd: int, length: int, offset: int) -> ctypes.Array:
    """A private map of ``length`` bytes of the file at ``offset``, unmapped once the returned
    buffer dies. libc's mmap, not Python's: Python's keeps a duplicate of the file descriptor
    open as long as the map, so a caller holding many loaded tensors ran out of open files."""
    address = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    if address == _MAP_FAILED:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    mapped = (ctypes.c_uint8 * length).from_address(address)
    weakref.finalize(mapped, _libc.munmap, address, length)
    return mapped


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
# Linux's fallocate(2): glibc's posix_fallocate writes zeros where the file system has none
_fallocate = getattr(_libc, "fallocate64", None)
if _fallocate is not None:
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    _fallocate.restype = ctypes.c_int


def _read_safetensors_index(path: Path) -> tuple[int, dict[str, _Entry]]:
    """Where a shard's data starts and its entries, checked as safetensors checks them: every
    entry of a known dtype, its size that of its shape, the entries tiling the data exactly."""
    def corrupted(why: str) -> DumpError:
        return DumpError(f"{path}: cannot open tensor shard ({why}); the file is truncated or corrupted")

    with open_regular(path, "tensor file") as file:
        try:
            size = os.fstat(file.fileno()).st_size
            head = file.read(8)
            if len(head) < 8:
                raise corrupted("no header")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_SAFETENSORS_HEADER, size - 8):
                raise corrupted(f"header of {length} bytes in a file of {size}")
            raw = file.read(length)
        except OSError as exc:
            raise corrupted(exc.strerror or str(exc)) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise corrupted("header is not valid JSON") from None
    if not isinstance(header, dict):
        raise corrupted("header is not a JSON object")
    entries = {}
    for key, value in header.items():
        if key == "__metadata__":
            continue
        entry = _entry(value)
        if entry is None:
            raise corrupted(f"entry {key!r} is malformed")
        entries[key] = entry
    data_size = size - 8 - length
    offset = 0
    for key, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != offset:
            raise corrupted(f"entry {key!r} starts at {entry.begin}, not at {offset}")
        offset = entry.end
    if offset != data_size:
        raise corrupted(f"entries cover {offset} bytes of data, the file holds {data_size}")
    return 8 + length, entries


def _entry(value) -> _Entry | None:
    """One header entry, or None when it is not a well-formed one of a dtype tdiff stores."""
    if not isinstance(value, dict):
        return None
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES or not isinstance(shape, list) \
            or not isinstance(offsets, list):
        return None
    if not all(type(n) is int and n >= 0 for n in [*shape, *offsets]) or len(offsets) != 2:
        return None
    begin, end = offsets
    if end - begin != math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize:
        return None
    return _Entry(begin, end)


class H5Storage:
    suffix = "h5"

    def write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        _write_h5(path, {key: to_bytes_view(t).numpy() for key, t in tensors.items()})

    def open(self, path: Path):
        with _open_h5(path):   # a damaged file is refused when the dump is opened
            return _H5Shard(path)

    def stream(self, path: Path) -> H5Stream:
        return H5Stream(path)


class H5Stream(_Stream):
    """An HDF5 shard written tensor by tensor, as :class:`SafetensorsStream` writes safetensors:
    the bytes are spooled into a plain file as they come, and sealing (the writer thread's, not
    the model's) copies them into datasets.
    Not an HDF5 file held open meanwhile: a forked child (a data loader's worker) that closes its
    inherited copy of one, at exit if not before, flushes HDF5's state into the parent's file."""

    def __init__(self, path: Path):
        super().__init__(path, 0)
        self._entries: list[tuple[str, int, int]] = []   # key, begin, bytes

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, key: str, tensor: torch.Tensor, write: Callable[[Callable], T]) -> T:
        nbytes = tensor.numel() * tensor.element_size()
        begin = self.nbytes
        result = self._append_bytes(nbytes, write, key)
        self._entries.append((key, begin, nbytes))
        return result

    def seal(self) -> None:
        import numpy as np

        spooled = np.memmap(self._tmp, dtype=np.uint8, mode="r") if self.nbytes else np.empty(0, np.uint8)
        _write_h5(self.path, {key: spooled[begin:begin + nbytes] for key, begin, nbytes in self._entries})
        del spooled
        self.discard()   # the spool


def _open_h5(path: Path):
    import h5py

    try:
        return h5py.File(path, "r")
    except Exception as exc:  # noqa: BLE001 - h5py raises many error types for a damaged file
        raise DumpError(f"{path}: cannot open HDF5 shard ({_first_line(exc)}); "
                        "the file is truncated or corrupted") from None


def _write_h5(path: Path, raw: dict) -> None:
    """An HDF5 shard of each key's raw bytes (uint8 numpy arrays)."""
    import h5py

    def write(tmp):
        with h5py.File(tmp, "w") as f:
            for key, data in raw.items():
                f.create_dataset(key, data=data)

    _write_atomically(path, write)


class _H5Shard:
    """An HDF5 shard, opened for each read: no handle is held between reads."""

    def __init__(self, path: Path):
        self._path = path

    def get(self, key: str, *, nbytes: int) -> torch.Tensor:
        """The dataset ``key``, read only when it is stored in this file and declares the
        ``nbytes`` its record expects: a compressed dataset cannot expand beyond its record, and
        no file outside the dump (an external link, external storage, a virtual dataset) is read."""
        if "/" in key:  # a path through groups, any of which could be a link to another file
            raise DumpError(f"{self._path}: tensor key {key!r} is a path; tdiff writes plain keys")
        with _open_h5(self._path) as handle:
            return self._read(handle, key, nbytes)

    def _read(self, handle, key: str, nbytes: int) -> torch.Tensor:
        import h5py

        try:
            link = handle.get(key, getlink=True)
            if link is None:
                raise DumpError(f"{self._path}: tensor {key!r} is missing from its shard")
            if not isinstance(link, h5py.HardLink):
                raise DumpError(f"{self._path}: tensor {key!r} is a {type(link).__name__} to data "
                                "elsewhere; tdiff reads only data stored in the dump's own files")
            dataset = handle[key]
            if not isinstance(dataset, h5py.Dataset):
                raise DumpError(f"{self._path}: {key!r} is not a dataset (corrupted shard)")
            if dataset.is_virtual or dataset.external:
                raise DumpError(f"{self._path}: tensor {key!r} is stored in other files (a "
                                f"{'virtual dataset' if dataset.is_virtual else 'dataset with external storage'}); "
                                "tdiff reads only data stored in the dump's own files")
            declared = _declared_nbytes(dataset)
            if declared != nbytes:
                raise DumpError(f"{self._path}: tensor {key!r} declares {declared} bytes, its record "
                                f"says {nbytes}: the shard is corrupted")
            return torch.from_numpy(dataset[()])
        except DumpError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged shard fails with many error types
            raise DumpError(f"{self._path}: cannot read tensor {key!r} ({_first_line(exc)}); "
                            "the file is corrupted") from None


def _declared_nbytes(dataset) -> int | None:
    """The bytes a dataset of plain numbers expands to, from its header; None for other types."""
    if dataset.dtype.kind not in "biufc" or dataset.shape is None:
        return None
    count = 1
    for n in dataset.shape:
        count *= n
    return count * dataset.dtype.itemsize


ShardStream = SafetensorsStream | H5Stream


def storage_for(name: str):
    if name == "safetensors":
        return SafetensorsStorage()
    if name == "h5":
        return H5Storage()
    raise DumpError(f"unknown storage format {name!r}: use one of {', '.join(STORAGES)}")


def storage_for_file(path: Path):
    return storage_for("h5" if path.suffix == ".h5" else "safetensors")


def _temporary_path(path: Path) -> Path:
    """Where a shard is written before it is renamed into place (FORMAT.md names the pattern)."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tmp")


def _write_atomically(path: Path, write) -> None:
    tmp = _temporary_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
