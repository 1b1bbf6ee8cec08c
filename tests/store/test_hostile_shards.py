"""Crafted h5 shards: nothing outside the dump is ever read, and no dataset expands beyond its
record before the size check (exit 2, one line, bounded memory)."""

import h5py
import numpy as np
import pytest
import torch

import tdiff
from tests.helpers import one_error_line, tdiff_bounded, tdiff_cli


def h5_dump(path):
    with tdiff.capture(path, storage="h5"):
        tdiff.dump("x", torch.arange(64, dtype=torch.float32))
    (shard,) = (path / "data").iterdir()
    return shard


def outside_copy(shard, tmp_path):
    """A file outside the dump holding the very bytes of the shard's tensor: read from there, the
    dump would pass as a match."""
    with h5py.File(shard, "r") as f:
        (key,) = f.keys()
        data = f[key][()]
    outside = tmp_path / "outside.h5"
    with h5py.File(outside, "w") as f:
        f.create_dataset("stolen", data=data)
    raw = tmp_path / "outside.bin"
    raw.write_bytes(data.tobytes())
    return key, data, outside, raw


def one_cli_error_line(result):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tdiff: error:"), result.output
    return lines[0]


def external_link(f, key, data, outside, raw):
    f[key] = h5py.ExternalLink(str(outside), "stolen")


def external_storage(f, key, data, outside, raw):
    f.create_dataset(key, shape=data.shape, dtype=data.dtype, external=[(str(raw), 0, data.nbytes)])


def virtual_dataset(f, key, data, outside, raw):
    layout = h5py.VirtualLayout(shape=data.shape, dtype=data.dtype)
    layout[:] = h5py.VirtualSource(str(outside), "stolen", shape=data.shape)
    f.create_virtual_dataset(key, layout)


@pytest.mark.parametrize("redirect", [external_link, external_storage, virtual_dataset])
def test_data_outside_the_dump_is_refused(tmp_path, redirect):
    good = tmp_path / "good"
    h5_dump(good)
    shard = h5_dump(tmp_path / "bad")
    key, data, outside, raw = outside_copy(shard, tmp_path)
    with h5py.File(shard, "a") as f:
        del f[key]
        redirect(f, key, data, outside, raw)
    line = one_cli_error_line(tdiff_cli("compare", good, tmp_path / "bad"))
    assert shard.name in line and "dump's own files" in line


def test_a_key_through_a_group_linked_to_another_file_is_refused(tmp_path):
    good = tmp_path / "good"
    h5_dump(good)
    bad = tmp_path / "bad"
    shard = h5_dump(bad)
    key, _data, outside, _raw = outside_copy(shard, tmp_path)
    with h5py.File(shard, "a") as f:
        f["elsewhere"] = h5py.ExternalLink(str(outside), "/")
    (manifest,) = (bad / "manifests").iterdir()
    manifest.write_text(manifest.read_text().replace(f'"key":"{key}"', '"key":"elsewhere/stolen"'))
    line = one_cli_error_line(tdiff_cli("compare", good, bad))
    assert shard.name in line and "is a path" in line


def test_a_compressed_dataset_declaring_more_than_its_record_is_refused_before_reading(tmp_path):
    good = tmp_path / "good"
    h5_dump(good)
    shard = h5_dump(tmp_path / "bad")
    with h5py.File(shard, "a") as f:
        (key,) = f.keys()
        del f[key]
        # 3 GiB of zeros (more than the bounded process may hold), a few KB on disk
        f.create_dataset(key, shape=(3 << 30,), dtype=np.uint8, chunks=(1 << 24,), compression="gzip")
    assert shard.stat().st_size < 1 << 20

    line = one_error_line(tdiff_bounded("compare", good, tmp_path / "bad"))
    assert "declares 3221225472 bytes, its record says 256" in line
