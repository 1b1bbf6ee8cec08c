"""The walk's rules on small real torch modules: which forward and which events a "between"
names, and when a module itself is the op."""

import torch

import tdiff
from tdiff.bisect import bisect_dumps


class Block(torch.nn.Module):
    """proj -> (own code) -> mix(x, y) -> (own code) -> output; an explicit dump inside."""

    def __init__(self, skew_before_mix=False, skew_dump=False, skew_after=False):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.mix = Mix()
        self.skews = (skew_before_mix, skew_dump, skew_after)

    def forward(self, x):
        h = self.proj(x)
        y = x * 2
        if self.skews[0]:
            y = y + 1e-3
        tdiff.dump("scores", h.sum(-1) + (1e-3 if self.skews[1] else 0))
        out = self.mix(h, y)
        return out + 1e-3 if self.skews[2] else out


class Mix(torch.nn.Module):
    def forward(self, h, y):
        return h + y


def bisect_blocks(tmp_path, **skew):
    for side, block in (("a", Block()), ("b", Block(**skew))):
        with torch.no_grad(), tdiff.capture(tmp_path / side):
            block(torch.ones(2, 8))
    return bisect_dumps(tmp_path / "a", tmp_path / "b").first_divergence


def test_a_later_input_of_a_call_is_judged_against_the_previous_sibling_not_its_own_first_input(tmp_path):
    d = bisect_blocks(tmp_path, skew_before_mix=True)
    assert (d.name, d.module, d.event) == ("mix[1]", "", "between")
    assert d.description == "in `(model)` forward, between the dump `scores` and `mix` input"


def test_an_explicit_dump_inside_a_forward_names_that_forward(tmp_path):
    d = bisect_blocks(tmp_path, skew_dump=True)
    assert (d.name, d.module, d.event, d.kind) == ("scores", "", "between", "other")
    assert d.description == "in `(model)` forward, between `proj` output and the dump `scores`"


def test_own_code_after_the_last_child_is_a_between_ending_at_the_modules_output(tmp_path):
    d = bisect_blocks(tmp_path, skew_after=True)
    assert (d.name, d.module, d.event, d.introduced) == ("(model)", "", "between", True)
    assert d.description == ("in `(model)` forward, between `mix` output and its output "
                             "(everything recorded inside it matches)")
    assert d.before == "mix"
