"""XXH3-128 that lets go of the GIL while it hashes, so that threads check tensors at once.

The xxhash module holds the GIL for the whole of an update (docs/PERFORMANCE.md section 2). This
calls the same XXH3 functions, those its extension module exports, through ctypes, which releases
the GIL around each foreign call: the digests are the xxhash module's (tests/store/test_xxh3.py).
"""

from __future__ import annotations

import ctypes

import importlib.util

import xxhash


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _exported_xxh3() -> ctypes.CDLL | None:
    """xxhash's extension module as a C library, where it exports XXH3 (xxhash 4.1 does); else
    None, and hashing goes through the xxhash module, holding the GIL."""
    try:
        lib = ctypes.CDLL(importlib.util.find_spec("xxhash._xxhash").origin)  # type: ignore[union-attr]
        lib.XXH3_createState.restype = ctypes.c_void_p
        lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
        lib.XXH3_128bits_reset.argtypes = [ctypes.c_void_p]
        lib.XXH3_128bits_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.XXH3_128bits_digest.argtypes = [ctypes.c_void_p]
        lib.XXH3_128bits_digest.restype = _Hash128
    except (OSError, AttributeError):
        return None
    return lib


_lib = _exported_xxh3()
SMALL = 1 << 14   # bytes: copied and hashed in one call of the xxhash module


def xxh3_128_hex(prefix: bytes, address: int, nbytes: int) -> str:
    """XXH3-128 (seed 0) of ``prefix`` followed by the ``nbytes`` bytes at ``address``, as
    ``xxhash.xxh3_128(prefix + data).hexdigest()`` writes it. The caller keeps the bytes alive.

    Up to :data:`SMALL` bytes are hashed by the xxhash module at once, holding the GIL: a few
    microseconds of it, against the six foreign calls of the GIL-free path (capture checks a
    small tensor's bytes at every record that may alias an earlier one)."""
    if nbytes <= SMALL:
        return xxhash.xxh3_128_hexdigest(prefix + ctypes.string_at(address, nbytes))
    if _lib is None:
        hasher = xxhash.xxh3_128(prefix)
        if nbytes:
            hasher.update((ctypes.c_char * nbytes).from_address(address))   # the bytes, not a copy
        return hasher.hexdigest()
    state = _lib.XXH3_createState()
    if not state:
        raise MemoryError("XXH3_createState")
    try:
        _lib.XXH3_128bits_reset(state)
        _lib.XXH3_128bits_update(state, prefix, len(prefix))
        if nbytes:
            _lib.XXH3_128bits_update(state, address, nbytes)
        digest = _lib.XXH3_128bits_digest(state)
    finally:
        _lib.XXH3_freeState(state)
    return f"{digest.high64:016x}{digest.low64:016x}"
