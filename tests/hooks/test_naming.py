from collections import namedtuple
from dataclasses import dataclass

import torch

import tdiff
from tdiff.hooks.naming import flatten_call_inputs, flatten_tensors, replace_call_inputs, tensor_name
from tdiff.store import open_dump
from tests.helpers import tiny_qwen2, token_ids


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


def test_deeper_values_are_cut_at_six_levels_and_skip_per_call_context():
    x = torch.zeros(1)

    @dataclass
    class ForwardBatch:   # SGLang's per-call context: never flattened
        positions: torch.Tensor

    value = {"a": [[[[[x, [x]]]]]], "batch": ForwardBatch(x), 3: (x,)}
    assert [name for name, _ in flatten_tensors(value, "out")] == ["out.a.0.0.0.0.0", "out.3.0"]


def test_graft_replaces_inputs_under_the_names_capture_gives_them():
    Pair = namedtuple("Pair", "cos sin")
    x = torch.zeros(2)
    args = (x, [Output(x, (Pair(x, x), {"k": x}))])
    kwargs = {"position_embeddings": (x, x), "mask": None}
    named = []

    def new(name, tensor):
        named.append(name)
        return tensor + 1 if name == "1.0.extra.1.k" else tensor

    new_args, new_kwargs = replace_call_inputs(args, kwargs, new)
    assert named == [name for name, _ in flatten_call_inputs(args, kwargs)]
    assert new_args[1][0].extra[1]["k"].equal(x + 1) and new_args[0] is x
    assert new_kwargs["position_embeddings"] is kwargs["position_embeddings"]


def test_a_transformers_model_keeps_the_tensor_names_of_existing_dumps(tmp_path):
    """The names are in every dump written so far: they must not change (ModelOutput is a
    dataclass and a mapping: its present fields by key; position embeddings a tuple)."""
    model = tiny_qwen2(layers=1)
    with tdiff.capture(tmp_path / "a", model=model):
        model(token_ids(6)[None])
    names = [(r.role, r.name) for r in open_dump(tmp_path / "a").records]
    layer = "model.layers.0"
    assert names == [
        ("input", "(model)[0]"), ("input", "model[input_ids]"),
        ("input", "model.embed_tokens[0]"), ("output", "model.embed_tokens"),
        ("input", "model.rotary_emb[0]"), ("input", "model.rotary_emb[1]"),
        ("output", "model.rotary_emb[0]"), ("output", "model.rotary_emb[1]"),
        ("input", f"{layer}[0]"), ("input", f"{layer}[position_embeddings][0]"),
        ("input", f"{layer}[position_embeddings][1]"), ("input", f"{layer}[position_ids]"),
        ("input", f"{layer}.input_layernorm[0]"), ("output", f"{layer}.input_layernorm"),
        ("input", f"{layer}.self_attn[hidden_states]"), ("input", f"{layer}.self_attn[position_ids]"),
        ("input", f"{layer}.self_attn[position_embeddings][0]"),
        ("input", f"{layer}.self_attn[position_embeddings][1]"),
        *[(role, f"{layer}.self_attn.{proj}_proj{sub}") for proj in "qkvo"
          for role, sub in (("input", "[0]"), ("output", ""))],
        ("output", f"{layer}.self_attn[0]"),
        ("input", f"{layer}.post_attention_layernorm[0]"), ("output", f"{layer}.post_attention_layernorm"),
        ("input", f"{layer}.mlp[0]"),
        *[(role, f"{layer}.mlp.{part}{sub}") for part in ("gate_proj", "act_fn", "up_proj", "down_proj")
          for role, sub in (("input", "[0]"), ("output", ""))],
        ("output", f"{layer}.mlp"), ("output", layer),
        ("input", "model.norm[0]"), ("output", "model.norm"),
        ("output", "model[last_hidden_state]"),
        ("input", "lm_head[0]"), ("output", "lm_head"),
        ("output", "(model)[logits]"),
    ]
