"""The GIL-free XXH3-128 gives the xxhash module's digests."""

import threading

import numpy as np
import xxhash
from hypothesis import given, strategies as st

from tdiff.store.xxh3 import xxh3_128_hex


@given(prefix=st.binary(max_size=64), data=st.binary(max_size=4096))
def test_digest_is_the_xxhash_modules(prefix, data):
    array = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, dtype=np.uint8)
    assert xxh3_128_hex(prefix, array.ctypes.data, array.nbytes) == xxhash.xxh3_128(prefix + data).hexdigest()


def test_sizes_on_either_side_of_the_one_call_bound_give_the_xxhash_modules_digest():
    from tdiff.store.xxh3 import SMALL

    data = np.random.default_rng(3).integers(0, 256, SMALL + 4097, dtype=np.uint8)
    for size in (0, 1, SMALL - 1, SMALL, SMALL + 1, SMALL + 4097):
        expected = xxhash.xxh3_128(b"tag" + data[:size].tobytes()).hexdigest()
        assert xxh3_128_hex(b"tag", data.ctypes.data, size) == expected


def test_threads_hashing_at_once_get_each_their_own_digest():
    buffers = [np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8) for seed in range(8)]
    expected = [xxhash.xxh3_128(b"tag" + b.tobytes()).hexdigest() for b in buffers]
    got = [None] * len(buffers)

    def run(i):
        got[i] = xxh3_128_hex(b"tag", buffers[i].ctypes.data, buffers[i].nbytes)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(buffers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


@given(prefix=st.binary(max_size=64), data=st.binary(max_size=4096))
def test_without_the_exported_library_the_digest_is_the_same(prefix, data):
    from unittest import mock

    from tdiff.store import xxh3

    array = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, dtype=np.uint8)
    with mock.patch.object(xxh3, "_lib", None):   # an xxhash whose extension exports no XXH3 symbols
        assert xxh3_128_hex(prefix, array.ctypes.data, array.nbytes) == xxhash.xxh3_128(prefix + data).hexdigest()
