import pytest

from tdiff.errors import TdiffError
from tdiff.hooks.selection import Selection
from tdiff.vocab.parse import parse_ranges
from tdiff.vocab.paths import layer_of


@pytest.mark.parametrize("text, expected", [
    ("0-3,7", {0, 1, 2, 3, 7}), ("5", {5}), (" 1 - 2 , 4 ", {1, 2, 4}), ("all", None), ("", None), (None, None),
])
def test_parse_ranges(text, expected):
    result = parse_ranges(text)
    assert (set(result) if result is not None else None) == expected


@pytest.mark.parametrize("text", ["a", "3-1", "1,,2", "-2"])
def test_bad_ranges_are_user_errors(text):
    with pytest.raises(TdiffError, match="--layers"):
        parse_ranges(text, "--layers")


@pytest.mark.parametrize("path, layer", [
    ("model.layers.12.mlp.down_proj", 12), ("decoder.layers.3", 3), ("transformer.h.7.attn", 7),
    ("model.embed_tokens", None), ("lm_head", None), ("model.layers.1.mlp.experts.3", 1),
])
def test_layer_of(path, layer):
    assert layer_of(path) == layer


def test_selection_combines_select_exclude_and_layers():
    sel = Selection(select=["mlp"], exclude=["act_fn"], layers=parse_ranges("0-1"))
    assert sel.wants("model.layers.0.mlp.up_proj")
    assert not sel.wants("model.layers.0.mlp.act_fn")
    assert not sel.wants("model.layers.2.mlp.up_proj")
    assert not sel.wants("model.layers.0.self_attn")
    assert not sel.wants("model.embed_tokens")
    assert sel.wants("logprobs", explicit=True)
    assert not Selection(exclude=["logprobs"]).wants("logprobs", explicit=True)


def test_bad_regex_is_a_user_error():
    with pytest.raises(TdiffError, match="--select"):
        Selection(select=["("])
