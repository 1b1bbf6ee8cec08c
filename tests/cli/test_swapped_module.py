"""Run B swaps a module for a subclass of the user's own (the usual way to try a fix): the two
dumps still pair by name, and compare, bisect and report name the swapped module."""

import json

import pytest
import torch
from torch import nn

import tdiff
from tests.helpers import tdiff_cli


class HalfPrecisionLinear(nn.Linear):
    """A linear layer computing in fp16: the kind of change run B tries."""

    def forward(self, x):
        return nn.functional.linear(x.half(), self.weight.half(), self.bias.half()).float()


def encoder() -> nn.TransformerEncoder:
    """torch's own encoder: no class of it comes from a framework an adapter knows. Train mode
    (dropout 0) keeps torch off its fused fast path, so every submodule is called."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()


def capture_swapped(root):
    """Dumps root/a (torch's encoder) and root/b (layer 1's second linear in fp16)."""
    x = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(1))
    for side in ("a", "b"):
        model = encoder()
        if side == "b":
            swapped = HalfPrecisionLinear(64, 32)
            swapped.load_state_dict(model.layers[1].linear2.state_dict())
            model.layers[1].linear2 = swapped
        with tdiff.capture(root / side), torch.no_grad():
            model(x)
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    return capture_swapped(tmp_path_factory.mktemp("swapped"))


def test_compare_pairs_by_name_and_finds_the_swapped_module(dumps):
    report = json.loads(tdiff_cli("compare", *dumps, "--json", expect=1).output)
    assert report["first_divergence"]["name"] == "layers.1.linear2"
    assert "alignment" not in report
    assert report["summary"]["only_a"] == report["summary"]["only_b"] == 0


def test_bisect_names_the_swapped_module(dumps):
    result = json.loads(tdiff_cli("bisect", *dumps, "--json", expect=1).output)["first_divergence"]
    assert (result["module"], result["event"], result["kind"], result["layer"]) == \
        ("layers.1.linear2", "output", "linear", 1)


def test_report_names_the_swapped_module(dumps, tmp_path):
    tdiff_cli("report", *dumps, "--format", "json", "-o", tmp_path / "r.json", expect=1)
    culprit = json.loads((tmp_path / "r.json").read_text())["culprit"]
    assert culprit["tensor"]["name"] == "layers.1.linear2"
