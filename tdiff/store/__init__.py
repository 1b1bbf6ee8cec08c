"""The dump format (tdiff.store): a versioned manifest per process plus safetensors or HDF5 tensor shards."""

from tdiff.store.manifest import FORMAT_VERSION
from tdiff.store.reader import Dump, open_dump
from tdiff.store.record import Record

__all__ = ["Dump", "FORMAT_VERSION", "Record", "open_dump"]
