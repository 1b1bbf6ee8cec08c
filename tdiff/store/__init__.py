"""The dump format (tdiff.store): a versioned manifest per process plus safetensors or HDF5 tensor shards.

The reader (torch) loads on first use, so that the CLI can read the format's constants without it.
"""

from tdiff.store.manifest import FORMAT_VERSION
from tdiff.store.record import Record

__all__ = ["Dump", "FORMAT_VERSION", "Record", "open_dump"]


def __getattr__(name):
    if name in ("Dump", "open_dump"):
        from tdiff.store import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'tdiff.store' has no attribute {name!r}")
