"""A report of a very large dump is summarised to fit a GitHub comment."""

import torch
from torch import nn

import tdiff
from tdiff.compare.engine import compare_dumps
from tdiff.report.markdown import COMMENT_LIMIT, GH_MARKER, render_markdown
from tdiff.report.model import build_report
from tdiff.store import open_dump
from tests.report.test_markdown import table_rows

LAYERS = 240


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_normalization_before_attention = nn.LayerNorm(8)
        self.attention_output_projection_with_a_long_name = nn.Linear(8, 8)
        self.feed_forward_up_projection_with_a_long_name = nn.Linear(8, 8)
        self.feed_forward_down_projection_with_a_long_name = nn.Linear(8, 8)

    def forward(self, x):
        x = x + self.attention_output_projection_with_a_long_name(self.input_normalization_before_attention(x))
        return x + self.feed_forward_down_projection_with_a_long_name(
            torch.tanh(self.feed_forward_up_projection_with_a_long_name(x)))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_report_of_a_very_large_dump_stays_under_the_comment_limit(tmp_path):
    torch.manual_seed(0)
    model = Tower().eval()
    x = torch.randn(2, 4, 8)
    for side in ("a", "b"):
        if side == "b":  # one element of layer 3's norm differs: every later tensor diverges
            with torch.no_grad():
                model.layers[3].input_normalization_before_attention.weight[0] += 1e-3
        with torch.no_grad(), tdiff.capture(tmp_path / side):
            model(x)
    report = build_report(compare_dumps(open_dump(tmp_path / "a"), open_dump(tmp_path / "b")))
    diverged = report.counts["compared"] - report.counts["match"]
    assert diverged > 2000 and len(report.boundaries) == LAYERS * 5 + 1

    for gh_comment in (False, True):
        text = render_markdown(report, gh_comment=gh_comment)
        assert len(text) <= COMMENT_LIMIT
        assert text.startswith(GH_MARKER) == gh_comment
    culprit = "layers.3.input_normalization_before_attention"
    assert f"first divergence at `{culprit}`" in text
    layers = table_rows(text, "| layer | tensors differ | first differing boundary")
    assert "**3** ◀ first" in [row[0] for row in layers]
    assert "more rows not shown" in text
    boundaries = table_rows(text, "| layer | boundary | kind |")
    assert boundaries and boundaries[0][0] == "3" and "◀ first" in boundaries[0][1]  # kept: the culprit first
    # the summary keeps every section, and nothing is cut mid-table
    for section in ("### Error by layer", "### Environment", "All boundaries", "Diverged tensors"):
        assert section in text
    assert text.count("<details>") == text.count("</details>")
