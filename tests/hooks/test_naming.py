from collections import namedtuple
from dataclasses import dataclass

import torch

from tdiff.hooks.naming import flatten_call_inputs, flatten_tensors, tensor_name


@dataclass
class Output:
    hidden: torch.Tensor
    extra: tuple


def test_nested_values_get_stable_sub_names():
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    Pair = namedtuple("Pair", "cos sin")
    value = (a, {"k": b, "skip": None, "n": 3}, [Output(c, (Pair(d, d),))])
    names = [name for name, _ in flatten_tensors(value)]
    assert names == ["0", "1.k", "2.0.hidden", "2.0.extra.0.cos", "2.0.extra.0.sin"]


def test_inputs_are_named_by_position_and_keyword():
    x, y = torch.zeros(1), torch.ones(1)
    assert [n for n, _ in flatten_call_inputs((x,), {"mask": y, "flag": True})] == ["0", "mask"]


def test_tensor_names():
    assert tensor_name("model.layers.0.self_attn", "0") == "model.layers.0.self_attn[0]"
    assert tensor_name("model.layers.0", "position_embeddings.1") == "model.layers.0[position_embeddings][1]"
    assert tensor_name("", "logits") == "(model)[logits]"
    assert tensor_name("lm_head", "") == "lm_head"
