"""Tensor shard files: safetensors (default, memory-mapped on read) or HDF5.

A shard is written once, to a temporary name, then renamed into place. Every tensor is stored
as its raw bytes: natively typed where the file format knows the dtype (so other tools can open
the shard), as uint8 otherwise (float8_e8m0, complex32, sub-byte types); the record's dtype and
shape rebuild it bit-exactly.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch

from tdiff.store.dtypes import to_bytes_view
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
        from safetensors.torch import save_file

        storable = {key: t if t.dtype in self._native and t.is_contiguous() else to_bytes_view(t)
                    for key, t in tensors.items()}
        _write_atomically(path, lambda tmp: save_file(storable, str(tmp)))

    def open(self, path: Path):
        from safetensors import safe_open

        try:
            return _SafetensorsShard(safe_open(str(path), framework="pt"), path)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a damaged header
            raise DumpError(f"{path}: cannot open tensor shard ({_first_line(exc)}); "
                            "the file is truncated or corrupted") from None


class _SafetensorsShard:
    def __init__(self, handle, path: Path):
        self._handle = handle
        self._path = path
        self._keys = set(handle.keys())

    def get(self, key: str, *, nbytes: int) -> torch.Tensor:
        """The tensor stored under ``key`` (memory-mapped), when its header declares the ``nbytes``
        its record expects."""
        if key not in self._keys:
            raise DumpError(f"{self._path}: tensor {key!r} is missing from its shard")
        try:
            header = self._handle.get_slice(key)
            dtype = SAFETENSORS_DTYPES.get(header.get_dtype())
            declared = torch.Size(header.get_shape()).numel() * dtype.itemsize if dtype is not None else None
            if declared != nbytes:
                raise DumpError(f"{self._path}: tensor {key!r} declares {declared} bytes, its record "
                                f"says {nbytes}: the shard is corrupted")
            return self._handle.get_tensor(key)
        except DumpError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged shard fails with many error types
            raise DumpError(f"{self._path}: cannot read tensor {key!r} ({_first_line(exc)}); "
                            "the file is truncated or corrupted") from None


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
        import h5py

        try:
            return _H5Shard(h5py.File(path, "r"), path)
        except Exception as exc:  # noqa: BLE001 - h5py raises many error types for a damaged file
            raise DumpError(f"{path}: cannot open HDF5 shard ({_first_line(exc)}); "
                            "the file is truncated or corrupted") from None


class _H5Shard:
    def __init__(self, handle, path: Path):
        self._handle = handle
        self._path = path

    def get(self, key: str, *, nbytes: int) -> torch.Tensor:
        """The dataset ``key``, read only when it is stored in this file and declares the
        ``nbytes`` its record expects: a compressed dataset cannot expand beyond its record, and
        no file outside the dump (an external link, external storage, a virtual dataset) is read."""
        import h5py

        if "/" in key:  # a path through groups, any of which could be a link to another file
            raise DumpError(f"{self._path}: tensor key {key!r} is a path; tdiff writes plain keys")
        try:
            link = self._handle.get(key, getlink=True)
            if link is None:
                raise DumpError(f"{self._path}: tensor {key!r} is missing from its shard")
            if not isinstance(link, h5py.HardLink):
                raise DumpError(f"{self._path}: tensor {key!r} is a {type(link).__name__} to data "
                                "elsewhere; tdiff reads only data stored in the dump's own files")
            dataset = self._handle[key]
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
