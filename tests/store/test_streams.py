"""Shards written tensor by tensor (full mode's host tensors): what any reader reads back, and a
tensor cut short."""

import pytest
import torch

from tdiff.store.dtypes import stored_nbytes, to_bytes_view
from tdiff.store.fingerprint import host_summary
from tdiff.store import storage as storage_module
from tdiff.store.storage import SAFETENSORS_DTYPES, storage_for

STORAGES = ["safetensors", "h5"]


def _tensors() -> dict[str, torch.Tensor]:
    """Every dtype safetensors knows, and what tdiff stores as bytes, in an order that leaves
    tensors off 8-byte boundaries; 0-d, empty and strided ones."""
    g = torch.Generator().manual_seed(4)
    tensors = {name: (torch.randn(3, 5, generator=g) * 50).to(dtype) for name, dtype in SAFETENSORS_DTYPES.items()}
    return tensors | {"0-d": torch.tensor(2.5, dtype=torch.bfloat16), "empty": torch.empty(0, 4),
                      "e8m0": torch.ones(3).to(torch.float8_e8m0fnu), "strided": torch.randn(4, 6, generator=g).t(),
                      "odd": torch.ones(3, dtype=torch.bool), "after odd": torch.arange(3.0)}


def _streamed(path, storage: str, tensors: dict[str, torch.Tensor]):
    stream = storage_for(storage).stream(path)
    for key, tensor in tensors.items():
        stream.append(key, tensor, lambda sink, t=tensor: host_summary(t, sink=sink))
    return stream


@pytest.mark.parametrize("storage", STORAGES)
def test_every_tensor_streamed_reads_back_bit_exactly(tmp_path, storage):
    tensors = _tensors()
    path = tmp_path / f"s.{storage_for(storage).suffix}"
    _streamed(path, storage, tensors).seal()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]   # nothing left under a temporary name
    shard = storage_for(storage).open(path)
    for key, tensor in tensors.items():
        raw = shard.get(key, nbytes=stored_nbytes(tensor.dtype, tensor.shape))
        assert torch.equal(raw, to_bytes_view(tensor)), key


def test_a_file_system_without_fallocate_gets_the_same_shard(tmp_path, monkeypatch):
    # blocks are allocated ahead of each tensor where the file system can (ext4); where it
    # cannot (EOPNOTSUPP), the writes alone make the same file
    tensors = _tensors()
    _streamed(tmp_path / "a.safetensors", "safetensors", tensors).seal()
    calls = []
    monkeypatch.setattr(storage_module, "_fallocate", lambda *args: calls.append(args) or -1)
    _streamed(tmp_path / "b.safetensors", "safetensors", tensors).seal()
    assert len(calls) == 1   # tried once a shard
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_a_streamed_safetensors_shard_opens_in_safetensors_with_its_dtypes(tmp_path):
    from safetensors.torch import load_file

    tensors = _tensors()
    _streamed(tmp_path / "s.safetensors", "safetensors", tensors).seal()
    loaded = load_file(str(tmp_path / "s.safetensors"))
    for key, tensor in tensors.items():
        native = tensor.dtype in SAFETENSORS_DTYPES.values()
        assert loaded[key].dtype == (tensor.dtype if native else torch.uint8), key
        assert torch.equal(to_bytes_view(loaded[key]), to_bytes_view(tensor)), key
    assert all(key.startswith("_pad") for key in loaded.keys() - tensors.keys())


@pytest.mark.parametrize("storage", STORAGES)
def test_a_tensor_cut_short_leaves_the_shard_whole(tmp_path, storage):
    # an error or an interrupt (KeyboardInterrupt, SystemExit) halfway through a tensor's bytes:
    # the shard can still be sealed with the tensors before and after it. 99 floats: the next
    # tensor starts after 4 bytes of padding, which are taken back with it; the last one cut
    # short leaves no bytes behind it either
    first, cut, third = torch.arange(99.0), torch.ones(1 << 12), torch.arange(9.0)
    path = tmp_path / f"s.{storage_for(storage).suffix}"
    stream = _streamed(path, storage, {"first": first})

    def cut_short(sink):
        sink(to_bytes_view(cut)[:1000].numpy().data)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stream.append("second", cut, cut_short)
    stream.append("third", third, lambda sink: host_summary(third, sink=sink))
    with pytest.raises(KeyboardInterrupt):
        stream.append("fourth", cut, cut_short)
    stream.seal()
    shard = storage_for(storage).open(path)
    for key, tensor in {"first": first, "third": third}.items():
        assert torch.equal(shard.get(key, nbytes=stored_nbytes(tensor.dtype, tensor.shape)), to_bytes_view(tensor))
    for key in ("second", "fourth"):
        with pytest.raises(Exception, match="missing"):
            shard.get(key, nbytes=stored_nbytes(cut.dtype, cut.shape))
