"""Tensor shard files: safetensors (default) or HDF5.

A shard is written once, to a temporary name, then renamed into place. Every tensor is stored
as its raw bytes: natively typed where the file format knows the dtype (so other tools can open
the shard), as uint8 otherwise (float8_e8m0, complex32, sub-byte types); the record's dtype and
shape rebuild it bit-exactly.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import mmap
import os
import struct
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from tdiff.store.dtypes import dtype_name, to_bytes_view
from tdiff.store.files import open_regular
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


class SafetensorsStorage:
    suffix = "safetensors"

    def __init__(self):
        self._native = set(SAFETENSORS_DTYPES.values())

    def write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors import TensorSpec, serialize_file

        storable = {key: t if t.dtype in self._native and t.is_contiguous() else to_bytes_view(t)
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
        import h5py

        def write(tmp):
            with h5py.File(tmp, "w") as f:
                for key, t in tensors.items():
                    f.create_dataset(key, data=to_bytes_view(t).numpy())

        _write_atomically(path, write)

    def open(self, path: Path):
        with _open_h5(path):   # a damaged file is refused when the dump is opened
            return _H5Shard(path)


def _open_h5(path: Path):
    import h5py

    try:
        return h5py.File(path, "r")
    except Exception as exc:  # noqa: BLE001 - h5py raises many error types for a damaged file
        raise DumpError(f"{path}: cannot open HDF5 shard ({_first_line(exc)}); "
                        "the file is truncated or corrupted") from None


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


def storage_for(name: str):
    if name == "safetensors":
        return SafetensorsStorage()
    if name == "h5":
        return H5Storage()
    raise DumpError(f"unknown storage format {name!r}: use one of {', '.join(STORAGES)}")


def storage_for_file(path: Path):
    return storage_for("h5" if path.suffix == ".h5" else "safetensors")


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
