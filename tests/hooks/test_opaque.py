"""Capture notes, on a call's output records, the arguments it did not record as tensors and that
may carry them (attrs "unrecorded", tdiff.hooks.opaque); settings are not listed."""

import enum
from dataclasses import dataclass

import numpy as np
import torch

import tdiff
from tdiff.store import open_dump

OBJECT = "an object tdiff does not record: "


class Mode(enum.Enum):
    EXTEND = 1


class KVCache:
    """An object of the user's own holding tensors (no dataclass: capture does not open it)."""

    def __init__(self):
        self.keys = torch.ones(2, 3)


@dataclass
class PackedParams:
    cu_seqlens: torch.Tensor
    cache: KVCache | None = None


class Attend(torch.nn.Module):
    def forward(self, x, cache, packed=None, scale=1.0, mode=Mode.EXTEND, act=torch.tanh, nested=None, **kwargs):
        return x * scale


def unrecorded(tmp_path, *args, **kwargs):
    with torch.no_grad(), tdiff.capture(tmp_path / "dump"):
        Attend()(*args, **kwargs)
    (output,) = [r for r in open_dump(tmp_path / "dump").records if r.role == "output"]
    return output.attrs.get("unrecorded")


def test_settings_and_tensors_in_containers_are_not_listed(tmp_path):
    x = torch.ones(2, 3)
    assert unrecorded(tmp_path, x, (x, [x]), PackedParams(torch.tensor([0, 2])), 0.5, Mode.EXTEND, torch.tanh,
                      {"eps": 1e-6, "dtype": torch.float32, "layer_id": 3, "name": "attn"}, flag=None) is None


def test_objects_that_may_carry_tensors_are_listed_by_argument_name(tmp_path):
    x = torch.ones(2, 3)
    found = unrecorded(tmp_path, x, KVCache(), PackedParams(torch.tensor([0, 2]), KVCache()),
                       extra=np.ones(3), module=torch.nn.Linear(3, 3))
    assert found == {"cache": OBJECT + "KVCache", "packed.cache": OBJECT + "KVCache", "extra": OBJECT + "ndarray",
                     "module": OBJECT + "Linear"}


def test_a_container_deeper_than_capture_walks_is_listed(tmp_path):
    deep: list = [torch.ones(1)]
    for _ in range(8):
        deep = [deep]
    found = unrecorded(tmp_path, torch.ones(2, 3), None, nested=deep)
    ((name, why),) = found.items()
    assert name.startswith("nested.0.0.") and why.startswith("nested deeper than tdiff records")
