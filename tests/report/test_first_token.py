"""Reports name the token: for runs aligned by token, the Markdown and HTML verdict line gives the
first differing token (sequence, position, step and prefill or decode on each side), as the CLI
and JSON do; and the worst token of the report is the one compare's worst element lies in."""

import json

import pytest
import torch

from tdiff.compare.metrics import EXACT, compare_tensors
from tdiff.report.tokens import token_errors
from tests.helpers import tdiff_cli
from tests.stacks.hf_rollout import capture_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    capture_runs(root)
    return root


def test_markdown_html_and_json_reports_name_the_first_differing_token(runs, tmp_path):
    args = [runs / "trainer", runs / "faulty", "--atol", "1e-5"]
    token = json.loads(tdiff_cli("bisect", *args, "--json", expect=1).output)["first_divergence"]["token"]
    # the trainer computed it in its one forward; the engine in a decode step after its prefill
    line = (f"First differing token: position {token['position']} of sequence {token['seq_a']} (A, step "
            f"{token['step_a']}, prefill) / {token['seq_b']} (B, step {token['step_b']}, decode)")
    markdown = tdiff_cli("report", *args, expect=1).output
    verdict = next(text for text in markdown.splitlines() if text.startswith("**Diverged:**"))
    assert line in verdict
    tdiff_cli("report", *args, "--format", "html", "-o", tmp_path / "r.html", expect=1)
    assert line in (tmp_path / "r.html").read_text()
    reported = json.loads(tdiff_cli("report", *args, "--json", expect=1).output)["culprit"]["first_token"]
    assert reported == {**token, "phase_a": "prefill", "phase_b": "decode"}


def test_the_worst_token_holds_compares_worst_element_when_differences_tie():
    a = torch.zeros(4, 3)
    b = a.clone()
    b[1, 0] = 0.5                 # one element off by 0.5 in token 1
    b[2] = torch.tensor([0.5, 0.5, 0.25])   # token 2: as far off, in more elements
    worst = compare_tensors(a, b, EXACT).worst_index
    assert token_errors("x", a, b, 0).worst == worst[0] == 1
