"""A call's plan: the layout a module declares, read at every call the way torch.nn declares it."""

import torch
from torch import nn

import tdiff
from tdiff.hooks.plan import declared_layout, frame_layout
from tdiff.hooks.running import Frame
from tdiff.store import open_dump


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
    enclosing = Frame(Plain(), "outer", 0, None, None, layout="seq-first")
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
    outer = Frame(Declares(), "outer", 0, None, None)                 # seq-first, not worked out yet
    middle = Frame(Plain(), "outer.middle", 0, None, None, parent=outer)
    assert declared_layout(Plain(), middle) == "seq-first"           # through both, each once
    assert (outer.layout, middle.layout) == ("seq-first", "seq-first")
    assert frame_layout(Frame(Plain(), "alone", 0, None, None)) is None


def test_a_selected_module_inside_an_unselected_seq_first_one_says_seq_first(tmp_path):
    # the enclosing layer records nothing, so nothing asked its layout while it ran: its child's
    # records must still inherit it
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0).eval()   # batch_first=False
    with torch.no_grad(), tdiff.capture(tmp_path / "d", select=["linear1"]):
        layer(torch.randn(3, 2, 8))
    records = open_dump(tmp_path / "d").records
    assert records and {r.module for r in records} == {"linear1"}
    assert all(r.attrs.get("layout") == "seq-first" for r in records)
