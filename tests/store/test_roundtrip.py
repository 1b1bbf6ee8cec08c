"""Every torch dtype round-trips bit-exactly through both storage formats."""

import os

import pytest
import torch

import tdiff
from tdiff.store import open_dump
from tdiff.store.dtypes import dtype_name, to_bytes_view

ALL_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)


def random_tensor(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    numel = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(hash(str(dtype)) % 2**31))
    return raw.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)


STORABLE = [d for d in ALL_DTYPES if d not in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2,
                                                 torch.quint2x4)]


@pytest.mark.parametrize("storage", ["safetensors", "h5"])
def test_every_dtype_round_trips_bit_exactly(tmp_path, storage):
    originals = {dtype_name(d): random_tensor(d) for d in STORABLE}
    originals["scalar"] = torch.tensor(3.5, dtype=torch.bfloat16)
    originals["empty"] = torch.empty(0, 4, dtype=torch.float16)
    originals["strided"] = torch.arange(20, dtype=torch.float32).reshape(4, 5).t()
    with tdiff.capture(tmp_path / "d", storage=storage):
        for name, tensor in originals.items():
            tdiff.dump(name, tensor)
    dump = open_dump(tmp_path / "d")
    by_name = {r.name: r for r in dump.records}
    assert set(by_name) == set(originals)
    for name, original in originals.items():
        loaded = dump.load(by_name[name])
        assert loaded.dtype == original.dtype, name
        assert loaded.shape == original.shape, name
        assert torch.equal(to_bytes_view(loaded), to_bytes_view(original)), name


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_tensors_are_stored_as_their_integer_representation(tmp_path):
    q = torch.quantize_per_tensor(torch.tensor([0.5, -1.0, 2.0]), scale=0.5, zero_point=3, dtype=torch.qint8)
    with tdiff.capture(tmp_path / "d"):
        tdiff.dump("q", q)
    dump = open_dump(tmp_path / "d")
    assert torch.equal(dump.load(dump.records[0]), q.int_repr())


def test_float8_and_bfloat16_values_survive_with_nan_and_negative_zero(tmp_path):
    values = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -1.5, 448.0])
    tensors = {"bf16": values.bfloat16(), "fp8": values.to(torch.float8_e5m2)}
    with tdiff.capture(tmp_path / "d"):
        for name, t in tensors.items():
            tdiff.dump(name, t)
    dump = open_dump(tmp_path / "d")
    for record in dump.records:
        assert torch.equal(to_bytes_view(dump.load(record)), to_bytes_view(tensors[record.name]))


def test_safetensors_dtype_names_are_the_ones_safetensors_writes(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tdiff.store.storage import SAFETENSORS_DTYPES

    save_file({name: torch.zeros(2, dtype=dtype) for name, dtype in SAFETENSORS_DTYPES.items()},
              str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as shard:
        written = {name: shard.get_slice(name).get_dtype() for name in shard.keys()}  # noqa: SIM118 - not a dict
    assert written == {name: name for name in SAFETENSORS_DTYPES}


def test_natively_typed_tensors_open_with_their_dtype_in_plain_safetensors(tmp_path):
    from safetensors.torch import load_file

    from tdiff.store.manifest import DATA_DIR

    tensors = {"bf16": torch.ones(3, dtype=torch.bfloat16), "fp8": torch.ones(3).to(torch.float8_e4m3fn),
               "u16": torch.ones(3, dtype=torch.uint16)}
    with tdiff.capture(tmp_path / "d"):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    dump = open_dump(tmp_path / "d")
    stored = {}
    for shard in {record.file for record in dump.records}:
        stored.update(load_file(str(tmp_path / "d" / DATA_DIR / shard)))
    padding = {key for key in stored if key.startswith("_pad")}   # 6 bytes of bf16: u16 aligned after it
    assert all(stored[key].dtype == torch.uint8 for key in padding)
    assert {str(stored[r.key].dtype) for r in dump.records} == {str(t.dtype) for t in tensors.values()}
    assert {str(stored[r.key].dtype) for r in dump.records} == {str(stored[k].dtype) for k in stored.keys() - padding}


def test_a_shard_tdiff_writes_is_the_one_safetensors_writes(tmp_path):
    # tdiff hands safetensors' serializer each tensor's address (save_file's checks cost too much
    # on pinned memory): every dtype, a 0-d and an empty tensor come out as save_file's, byte for byte
    from safetensors.torch import load_file, save_file

    from tdiff.store.storage import SAFETENSORS_DTYPES, SafetensorsStorage

    g = torch.Generator().manual_seed(3)
    tensors = {name: (torch.randn(3, 5, generator=g) * 50).to(dtype) for name, dtype in SAFETENSORS_DTYPES.items()}
    tensors |= {"0-d": torch.tensor(2.5), "empty": torch.empty(0, 4)}
    SafetensorsStorage().write(tmp_path / "tdiff.safetensors", tensors)
    save_file(tensors, str(tmp_path / "plain.safetensors"))
    assert (tmp_path / "tdiff.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    loaded = load_file(str(tmp_path / "tdiff.safetensors"))
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(to_bytes_view(loaded[name]), to_bytes_view(tensor)), name


def test_a_loaded_tensor_is_writable_without_touching_its_shard_and_holds_no_memory_once_dropped(tmp_path):
    original = torch.arange(5000, dtype=torch.float32)
    with tdiff.capture(tmp_path / "d"):
        tdiff.dump("t", original)
    dump = open_dump(tmp_path / "d")
    (record,) = dump.records
    (shard,) = (tmp_path / "d" / "data").iterdir()
    before = shard.read_bytes()

    def mappings_of_the_shard() -> int:
        with open("/proc/self/maps") as maps:
            return sum(str(shard) in line for line in maps)

    loaded = [dump.load(record) for _ in range(20)]
    assert mappings_of_the_shard() == 20   # one map per loaded tensor, held as long as it lives
    loaded[0].view(-1)[:] = -1.0
    assert torch.equal(dump.load(record), original) and shard.read_bytes() == before
    del loaded
    assert mappings_of_the_shard() == 0


@pytest.mark.parametrize("storage", ["safetensors", "h5"])
def test_a_loaded_tensor_lies_at_an_address_aligned_for_its_dtype(tmp_path, storage):
    # dtypes safetensors cannot name are stored as bytes (U8) and may follow U8 entries of any
    # length; a kernel given a misaligned complex128 crashes the process (cloning one segfaults)
    tensors = {"a_odd_bytes": torch.arange(3, dtype=torch.uint8),
               "b_complex128": random_tensor(torch.complex128), "c_complex32": random_tensor(torch.complex32)}
    with tdiff.capture(tmp_path / "d", storage=storage):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    dump = open_dump(tmp_path / "d")
    for record in dump.records:
        loaded = dump.load(record)
        assert loaded.data_ptr() % loaded.element_size() == 0, record.name
        assert torch.equal(to_bytes_view(loaded.clone()), to_bytes_view(tensors[record.name]))


def test_loaded_tensors_hold_no_open_files(tmp_path):
    # a map of a shard's bytes needs no open file: holding each tensor's file open exhausted the
    # process's files (often 1024) for a caller keeping a dump's tensors, blamed on corruption
    with tdiff.capture(tmp_path / "d"):
        for i in range(50):
            tdiff.dump(f"t{i}", torch.full((300,), float(i)))
    dump = open_dump(tmp_path / "d")

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_files()
    loaded = {record.name: dump.load(record) for record in dump.records}
    assert open_files() == before
    assert all(torch.equal(tensor, torch.full((300,), float(name[1:]))) for name, tensor in loaded.items())


def test_past_the_limit_of_maps_a_tensor_is_read_instead(tmp_path, monkeypatch):
    # each loaded tensor is a map of its own; past vm.max_map_count (~65k held) mmap answers
    # ENOMEM, which was reported as a corrupted dump: the bytes are read into memory instead
    import errno

    from tdiff.store import storage

    tensors = {f"t{i}": torch.arange(i * 1000.0, i * 1000 + 5000 + i) for i in range(3)}
    with tdiff.capture(tmp_path / "d", mode="full"):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    dump = open_dump(tmp_path / "d")

    def no_more_maps(fd, length, offset):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(storage, "_map_copy_on_write", no_more_maps)
    for record in dump.records:
        loaded = dump.load(record)
        assert torch.equal(loaded, tensors[record.name])
        loaded.add_(1)  # its own memory: writable
    assert torch.equal(dump.load(dump.records[0]), tensors["t0"])
