"""Every torch dtype round-trips bit-exactly through both storage formats."""

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
