"""Coverage is part of the verdict (issue 27): every row of a tensor standing for a token both runs
fed is compared, or a match exits 2 saying which was not; --allow-unaligned makes it a note."""

import json
import re

import pytest
import torch

import tdiff
from tdiff.errors import TdiffError
from tdiff.testing import assert_match
from tests.align.token_layouts import Run, capture_run, engine, row, trainer
from tests.helpers import tdiff_cli

SEQUENCES = {"r1": [5, 6, 7, 8, 9, 10], "r2": [5, 11, 12, 13, 14]}
PROMPTS = {"r1": 3, "r2": 2}
UNCOMPARED = re.compile(r"tdiff: error: (\d+) tensor-tokens fed by both runs were not compared; first: (\S+) "
                        r"seq (\S+)/(\S+) position (\S+): .+; --allow-unaligned accepts that\n")


def _pair(tmp_path, a: Run, b: Run):
    capture_run(tmp_path / "a", a)
    capture_run(tmp_path / "b", b)
    return tmp_path / "a", tmp_path / "b"


def test_a_decode_step_without_token_metadata_makes_a_match_exit_2_unless_allowed(tmp_path):
    run = engine(SEQUENCES, PROMPTS, no_tokens={2})
    a, b = _pair(tmp_path, trainer(SEQUENCES, ["r2", "r1"]), run)
    lost = len(run.forwards[2].feeds)
    for command in (("compare", a, b), ("bisect", a, b), ("report", a, b)):
        result = tdiff_cli(*command, expect=2)
        found = UNCOMPARED.search(result.output)
        assert found, result.output
        assert int(found[1]) >= lost and found[2] == "hidden"
    allowed = json.loads(tdiff_cli("compare", a, b, "--json", "--allow-unaligned", expect=0).output)
    uncompared = allowed["alignment"]["uncompared"]
    assert uncompared["count"] >= lost and uncompared["first"]["tensor"] == "hidden"
    assert set(uncompared["first"]) == {"tensor", "seq_a", "seq_b", "position", "why"}
    assert "not compared" in tdiff_cli("bisect", a, b, "--allow-unaligned", expect=0).output
    report = tdiff_cli("report", a, b, "--allow-unaligned", expect=0).output   # Markdown: the note as a warning
    assert "**Warning:**" in report and "not compared" in report
    assert any("not compared" in p for p in json.loads(
        tdiff_cli("report", a, b, "--allow-unaligned", "--json", expect=0).output)["problems"])
    with pytest.raises(TdiffError, match="--allow-unaligned accepts that"):
        assert_match(a, b)
    assert_match(a, b, allow_unaligned=True)


def test_a_real_divergence_still_exits_1_when_tokens_were_left_uncompared(tmp_path):
    a, b = _pair(tmp_path, trainer(SEQUENCES), engine(SEQUENCES, PROMPTS, no_tokens={2}, planted={("r2", 0): 1.0}))
    data = json.loads(tdiff_cli("compare", a, b, "--json", expect=1).output)
    assert data["alignment"]["uncompared"]["count"] > 0
    assert data["first_divergence"]["tokens"]["first_differing"]["position"] == 0


def test_honest_runs_leave_nothing_uncompared(tmp_path):
    a, b = _pair(tmp_path, trainer(SEQUENCES, ["r2", "r1"], padded=True), engine(SEQUENCES, PROMPTS))
    data = json.loads(tdiff_cli("compare", a, b, "--json", expect=0).output)
    assert data["alignment"]["uncompared"] == {"count": 0, "first": None}


def _rope_runs(tmp_path, fault_at: int | None):
    """A: a padded [2, seq] batch whose RoPE table [1, seq, dim] serves both rows (indexed by
    position alone); B: one packed forward with a table row per token."""
    def table(positions, planted):
        return torch.tensor([[float(p), float(p) / 3 + (0.25 if p == planted else 0.0)] for p in positions])

    order = ["r1", "r2"]
    width = max(len(SEQUENCES[k]) for k in order)
    with tdiff.capture(tmp_path / "a"):
        tdiff.tokens(input_ids=torch.tensor([SEQUENCES[k] + [0] * (width - len(SEQUENCES[k])) for k in order]),
                     seq_lens=[len(SEQUENCES[k]) for k in order])
        tdiff.dump("rope", table(range(width), fault_at).unsqueeze(0))
    with tdiff.capture(tmp_path / "b"):
        tdiff.tokens(input_ids=[t for k in order for t in SEQUENCES[k]], seq_lens=[len(SEQUENCES[k]) for k in order])
        tdiff.dump("rope", table([p for k in order for p in range(len(SEQUENCES[k]))], None))
    return tmp_path / "a", tmp_path / "b"


def test_a_table_indexed_by_position_aligns_by_position_and_a_fault_is_found_where_it_starts(tmp_path):
    a, b = _rope_runs(tmp_path / "clean", None)
    data = json.loads(tdiff_cli("compare", a, b, "--align", "tokens", "--json", expect=0).output)
    rope = data["tensors"][0]
    fed = sum(map(len, SEQUENCES.values()))
    assert rope["tokens"]["compared"] == fed and rope["tokens"]["equal"] == fed
    a, b = _rope_runs(tmp_path / "faulty", 4)
    data = json.loads(tdiff_cli("compare", a, b, "--align", "tokens", "--json", expect=1).output)
    assert data["first_divergence"]["tokens"]["first_differing"]["position"] == 4
    assert data["first_divergence"]["tokens"]["compared"] - data["first_divergence"]["tokens"]["equal"] == 2


def test_a_tensor_with_no_row_per_token_is_compared_as_stored_where_shapes_agree(tmp_path):
    for side, scale in (("a", 1.0), ("b", 1.5)):
        with tdiff.capture(tmp_path / side):
            tdiff.tokens(input_ids=SEQUENCES["r1"] if side == "a" else [SEQUENCES["r1"]])
            tdiff.dump("hidden", torch.tensor([row(SEQUENCES["r1"], p) for p in range(6)]))
            tdiff.dump("scales", torch.tensor([1.0, scale, 2.0, 3.0, 4.0, 5.0, 6.0]))
    data = json.loads(tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--align", "tokens", "--json",
                                expect=1).output)
    assert data["first_divergence"]["name"] == "scales" and "tokens" not in data["first_divergence"]


def test_a_tensor_whose_rows_one_side_cannot_place_is_not_a_silent_match(tmp_path):
    """B's rows are the tokens, A's the same values in a layout no rule reads ([dim, tokens])."""
    tokens = SEQUENCES["r1"]
    rows = torch.tensor([row(tokens, p) for p in range(len(tokens))])
    for side, value in (("a", rows.T.contiguous()), ("b", rows)):
        with tdiff.capture(tmp_path / side):
            tdiff.tokens(input_ids=[tokens] if side == "a" else tokens)
            tdiff.dump("hidden", rows)
            tdiff.dump("odd", value)
    result = tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--align", "tokens", expect=2)
    found = UNCOMPARED.search(result.output)
    assert found and (int(found[1]), found[2]) == (len(tokens), "odd")
    # a filter judges the tensors it keeps
    tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--align", "tokens", "--select", "hidden", expect=0)


def test_forward_rows_of_a_sequence_the_step_does_not_hold_are_uncompared(tmp_path):
    """An explicit dump's seq_ids naming a sequence the forward's metadata lacks."""
    tokens = SEQUENCES["r1"]
    for side in ("a", "b"):
        with tdiff.capture(tmp_path / side):
            tdiff.tokens(input_ids=tokens if side == "a" else [tokens])
            lp = torch.tensor([row(tokens, p)[0] for p in range(1, len(tokens))])
            seqs = torch.zeros(len(tokens) - 1, dtype=torch.long)
            if side == "b":
                seqs[-1] = 3
            tdiff.dump("logprobs", lp, positions=torch.arange(1, len(tokens)), seq_ids=seqs)
    result = tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--align", "tokens", expect=2)
    assert UNCOMPARED.search(result.output), result.output


def test_a_fragment_of_decode_steps_without_a_partner_is_uncompared(tmp_path):
    """Without request ids, decode steps recorded out of order cut a sequence into pieces that do
    not continue each other; a piece that finds no partner holds tokens both runs fed."""
    run = engine(SEQUENCES, PROMPTS)
    run.forwards[1], run.forwards[2] = run.forwards[2], run.forwards[1]
    for forward in run.forwards:
        forward.ids = False
    a, b = _pair(tmp_path, trainer(SEQUENCES), run)
    result = tdiff_cli("compare", a, b, expect=2)
    assert "fragment" in result.output
