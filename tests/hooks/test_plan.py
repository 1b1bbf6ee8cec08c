"""A call's plan: the layout a module declares, read at every call the way torch.nn declares it."""

from torch import nn

from tdiff.hooks.plan import declared_layout
from tdiff.hooks.running import Frame


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
