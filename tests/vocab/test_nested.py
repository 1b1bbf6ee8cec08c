"""The one walk of nested values (tdiff.vocab.nested): names, replacement and what it does not open,
on plain Python values (the walk needs no torch)."""

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest

from tdiff.vocab.nested import Nested, leaf_name

Pair = namedtuple("Pair", "cos sin")


@dataclass(frozen=True)
class Output:
    hidden: int
    extra: object = None


class Leaf(int):
    """A leaf type apart from the other numbers a value holds."""


def leaves(value, **options):
    return list(Nested(Leaf, max_depth=options.pop("max_depth", 6), **options).leaves(value))


def test_parts_are_named_by_position_key_and_field_in_order():
    a, b, c, d = (Leaf(i) for i in range(4))
    value = [a, OrderedDict(k=b, n=3, skip=None), Output(c, (Pair(d, d), "text"))]
    assert leaves(value) == [("0", a), ("1.k", b), ("2.hidden", c), ("2.extra.0.cos", d), ("2.extra.0.sin", d)]


def test_a_prefix_names_the_value_itself():
    x = Leaf(1)
    walk = Nested(Leaf, max_depth=6)
    assert list(walk.leaves(x, "logits")) == [("logits", x)]
    assert list(walk.leaves({"a": [x]}, "3")) == [("3.a.0", x)]


def test_what_is_not_opened():
    x = Leaf(1)
    loop: list = [x]
    loop.append(loop)                       # a container inside itself: opened once
    assert leaves(loop) == [("0", x)]
    deep = [x, [[[x]]]]
    assert leaves(deep, max_depth=3) == [("0", x)]   # the list three levels down stays closed
    assert leaves([Output(x)], skip={"Output"}) == []


class Refused(Exception):
    pass


def test_a_reader_refuses_through_its_hooks():
    class Strict(Nested):
        def mapping_key(self, key, prefix):
            if not isinstance(key, str):
                raise Refused(f"key {key!r} at {prefix}")
            return key

        def too_deep(self, prefix):
            raise Refused(f"too deep at {prefix}")

    walk = Strict(Leaf, max_depth=2)
    with pytest.raises(Refused, match="key 3 at 0"):
        list(walk.leaves([{3: Leaf(1)}]))
    with pytest.raises(Refused, match="too deep at 0.0"):
        list(walk.leaves([[[Leaf(1)]]]))


def test_replace_rebuilds_only_what_changed_and_keeps_types():
    a, b = Leaf(1), Leaf(2)
    untouched = (a, [b])
    value = [untouched, Pair(a, b), {"o": Output(a, "kept")}]
    walk = Nested(Leaf, max_depth=6)
    seen = []

    def new(sub, leaf):
        seen.append(sub)
        return Leaf(leaf * 10) if sub in ("1.sin", "2.o.hidden") else leaf

    out = walk.replace(value, new)
    assert seen == [name for name, _ in walk.leaves(value)]   # the same names, in the same order
    assert out[0] is untouched
    assert type(out[1]) is Pair and out[1] == (a, 20) and out[1][0] is a
    assert out[2]["o"] == Output(10, "kept") and value[2]["o"] == Output(1, "kept")
    assert walk.replace(value, lambda sub, leaf: leaf) is value


def test_leaf_at_finds_a_leaf_by_its_name():
    x = Leaf(7)
    walk = Nested(Leaf, max_depth=6)
    assert walk.leaf_at({"h": [0, x]}, "h.1") is x
    assert walk.leaf_at({"h": [0, x]}, "h.0") is None     # an int, not a leaf
    assert walk.leaf_at(x, "") is x


def test_leaf_names_bracket_each_part():
    assert leaf_name("model.layers.0", "position_embeddings.1") == "model.layers.0[position_embeddings][1]"
    assert leaf_name("lm_head", "") == "lm_head"


def test_the_walk_loads_no_torch():
    import subprocess
    import sys

    code = "import sys, tdiff.vocab.nested, tdiff.vocab.paths; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
