"""Layouts from metadata, never guessed (issue 27 §5): seq-first activations (torch.nn.Transformer's
default, Megatron's [s, b, h]) are read as such, also over a square batch (as many sequences as
tokens each), where [batch, seq] and [seq, batch] have one shape; where nothing declares the
layout of a square grid, compare exits 2 naming a way to declare it."""

import torch

import tdiff
from tests.helpers import tdiff_cli

SEQUENCES = torch.tensor([[5, 17, 9, 30], [3, 44, 21, 8], [7, 7, 2, 11], [60, 1, 12, 40]])   # square: 4 x 4


def encoder_layer():
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0).eval()   # batch_first=False: [s, b, h]


def embedded(ids: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.nn.Embedding(64, 16)(ids).detach()


def batched(path, model):
    """One forward over the square batch, seq-first as the layer wants it."""
    hidden = embedded(SEQUENCES).transpose(0, 1)
    with torch.no_grad(), tdiff.capture(path, model=model):
        tdiff.tokens(input_ids=SEQUENCES)
        model(hidden)
    return path


def one_by_one(path, model):
    """Each sequence alone: a [seq, 1, h] forward over a [1, seq] grid (no ambiguity)."""
    hidden = [embedded(row[None]).transpose(0, 1) for row in SEQUENCES]
    with torch.no_grad(), tdiff.capture(path, model=model):
        for row, h in zip(SEQUENCES, hidden):
            tdiff.tokens(input_ids=row[None])
            model(h)
    return path


def test_seq_first_activations_over_a_square_batch_are_read_as_seq_first(tmp_path):
    model = encoder_layer()
    batch, alone = batched(tmp_path / "batch", model), one_by_one(tmp_path / "alone", model)
    printed = tdiff_cli("compare", alone, batch, "--ulp", "64", expect=0).output
    assert "aligned by token" in printed
    with torch.no_grad():
        model.linear2.weight[0, 0] += 1e-2
    spoiled = batched(tmp_path / "spoiled", model)
    assert "introduced at linear2" in " ".join(
        tdiff_cli("bisect", alone, spoiled, "--ulp", "64", expect=1).output.split())


class Undeclared(torch.nn.Module):
    """A seq-first module that declares nothing: no batch_first, no known framework."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x)


def test_a_square_grid_nothing_declares_exits_2_naming_how_to_declare_it(tmp_path):
    model = Undeclared().eval()
    batch, alone = batched(tmp_path / "batch", model), one_by_one(tmp_path / "alone", model)
    line = " ".join(tdiff_cli("compare", alone, batch, expect=2).output.split())
    assert "square token grid [4, 4]" in line and "batch_first attribute" in line
    model.batch_first = False   # declared the torch.nn way: read as seq-first, and the runs match
    batch, alone = batched(tmp_path / "declared", model), one_by_one(tmp_path / "declared-alone", model)
    tdiff_cli("compare", alone, batch, "--ulp", "64", expect=0)


def test_an_explicit_dump_over_a_square_grid_says_its_layout_with_layout(tmp_path):
    hidden = embedded(SEQUENCES)   # [batch, seq, h]

    def dumped(path, value, **layout):
        with tdiff.capture(path):
            tdiff.tokens(input_ids=SEQUENCES)
            tdiff.dump("hidden", value, **layout)
        return path

    alone = tmp_path / "alone"
    with tdiff.capture(alone):
        for row, h in zip(SEQUENCES, hidden):
            tdiff.tokens(input_ids=row[None])
            tdiff.dump("hidden", h[None])
            tdiff.step()   # one step a sequence, as an engine's one request at a time
    undeclared = dumped(tmp_path / "undeclared", hidden)
    assert "layout='batch-first' or 'seq-first'" in tdiff_cli("compare", alone, undeclared, expect=2).output
    tdiff_cli("compare", alone, dumped(tmp_path / "batch-first", hidden, layout="batch-first"), expect=0)
    seq_first = dumped(tmp_path / "seq-first", hidden.transpose(0, 1).contiguous(), layout="seq-first")
    tdiff_cli("compare", alone, seq_first, expect=0)
    spoiled = hidden.transpose(0, 1).clone()
    spoiled[2, 1, 3] += 1   # position 2 of sequence 1
    printed = " ".join(tdiff_cli("compare", alone, dumped(tmp_path / "spoiled", spoiled, layout="seq-first"),
                                 expect=1).output.split())
    assert "position 2" in printed
