"""A call's plan: the layout a module declares, read at every call the way torch.nn declares it;
calls that record nothing (quiet) still name where the calls inside them come from."""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import tdiff
from tdiff.errors import DumpError
from tdiff.hooks.plan import declared_layout, frame_layout
from tdiff.hooks.running import Frame
from tdiff.store import open_dump
from tdiff.vocab.paths import record_layer
from tests.helpers import tiny_qwen2, token_ids


class Forwarding(nn.Module):
    """A wrapper that looks attributes it lacks up on what it wraps (as PEFT's and FSDP's do)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class Declares(nn.Module):
    @property
    def batch_first(self):
        return False


class Plain(nn.Module):
    pass


def test_a_module_declares_its_layout_the_ways_torch_nn_does():
    assert declared_layout(nn.MultiheadAttention(8, 2, batch_first=True), None) == "batch-first"
    assert declared_layout(nn.TransformerEncoderLayer(8, 2), None) == "seq-first"   # its child self_attn's
    assert declared_layout(Declares(), None) == "seq-first"                          # a property
    assert declared_layout(Forwarding(Forwarding(nn.LSTM(4, 4, batch_first=True))), None) == "batch-first"
    enclosing = Frame(Plain(), "outer", None, None, layout="seq-first")
    assert declared_layout(Plain(), enclosing) == "seq-first"                        # the enclosing call's
    assert declared_layout(Plain(), None) is None


def test_a_layout_declared_after_the_first_call_is_read_at_the_next():
    class Late(nn.Module):
        pass

    module = Late()
    assert declared_layout(module, None) is None
    Late.batch_first = True            # on the class
    assert declared_layout(module, None) == "batch-first"
    module.batch_first = False         # on the instance
    assert declared_layout(module, None) == "seq-first"


def test_an_enclosing_calls_layout_is_worked_out_when_a_record_inside_it_asks():
    outer = Frame(Declares(), "outer", None, None)                 # seq-first, not worked out yet
    middle = Frame(Plain(), "outer.middle", None, None, parent=outer)
    assert declared_layout(Plain(), middle) == "seq-first"           # through both, each once
    assert (outer.layout, middle.layout) == ("seq-first", "seq-first")
    assert frame_layout(Frame(Plain(), "alone", None, None)) is None


def test_a_selected_module_inside_an_unselected_seq_first_one_says_seq_first(tmp_path):
    # the enclosing layer records nothing, so nothing asked its layout while it ran: its child's
    # records must still inherit it
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0).eval()   # batch_first=False
    with torch.no_grad(), tdiff.capture(tmp_path / "d", select=["linear1"]):
        layer(torch.randn(3, 2, 8))
    records = open_dump(tmp_path / "d").records
    assert records and {r.module for r in records} == {"linear1"}
    assert all(r.attrs.get("layout") == "seq-first" for r in records)


class Block(nn.Module):
    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.attn = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.rotary = rotary

    def forward(self, x):
        return self.attn(x) + self.rotary(x)


class Shared(nn.Module):
    """Modules called from more than one place: one twice in a row, one owned by every layer (named
    after its first owner, ``layers.0.rotary``, as SGLang's rotary embedding is): each call is told
    apart by its count, its enclosing call and the layer that made it."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        rotary = nn.Linear(8, 8)
        self.layers = nn.ModuleList([Block(rotary) for _ in range(3)])

    def forward(self, x):
        x = self.shared(self.shared(x))
        for layer in self.layers:
            x = layer(x) + self.shared(x)
        return x


_MODELS = [(tiny_qwen2(), token_ids()), (Shared(), torch.randn(2, 3, 8))]
_RECORDED = ("name", "module", "role", "step", "call", "sub", "module_class", "parent", "depth", "layer",
             "dtype", "shape", "fingerprint", "thread", "attrs")


def _capture(path, model, inputs, **options):
    with torch.no_grad(), tdiff.capture(path, mode="stats", **options):
        model(inputs)
        model(inputs)
    return open_dump(path).records


def _rows(records) -> list[tuple]:
    return sorted(tuple(repr(getattr(r, field)) for field in _RECORDED) for r in records)


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(range(len(_MODELS))), data=st.data())
def test_a_narrow_selection_records_what_a_full_capture_records_of_those_modules(tmp_path_factory, which, data):
    # the modules no call of which can be selected run quiet (a frame, no counts, no checks): the
    # records of the selected ones are a full capture's, to the name, call, layer and parent
    model, inputs = _MODELS[which]
    full = _capture(tmp_path_factory.mktemp("full") / "d", model, inputs)
    chosen = data.draw(st.lists(st.sampled_from(sorted({r.module for r in full})), min_size=1, max_size=4,
                                unique=True))
    layers = data.draw(st.none() | st.sets(st.integers(0, 2), min_size=1))
    expected = [r for r in full if r.module in chosen and (layers is None or record_layer(r) in layers)]
    options = {"select": [f"^{re.escape(module)}$" for module in chosen],
               "layers": ",".join(map(str, sorted(layers))) if layers else None}
    narrow = tmp_path_factory.mktemp("narrow") / "d"
    if not expected:
        with pytest.raises(DumpError, match="dump has no tensors"):
            _capture(narrow, model, inputs, **options)
        return
    assert _rows(_capture(narrow, model, inputs, **options)) == _rows(expected)


@pytest.mark.parametrize("layers", [None, "2"])
def test_a_shared_module_selected_alone_keeps_the_layer_and_count_of_each_call(tmp_path, layers):
    # the layers that call it record nothing (quiet), yet their frames say which layer called;
    # with --layers its calls from other layers are not recorded but still counted
    model = Shared()
    with torch.no_grad(), tdiff.capture(tmp_path / "d", mode="stats", select=[r"^layers\.0\.rotary$"], layers=layers):
        model(torch.randn(2, 3, 8))
    outputs = [r for r in open_dump(tmp_path / "d").records if r.role == "output"]
    calls = [(0, "layers.0", None), (1, "layers.1", 1), (2, "layers.2", 2)]
    assert [(r.call, r.parent, r.layer) for r in outputs] == (calls if layers is None else calls[2:])
