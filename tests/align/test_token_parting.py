"""Sequences that part are a divergence, not a hole (issue 27 §4); n samples of one request id
told apart; decode steps recorded out of order still located; every claim of a token compared
(§2: a recompute in a later step)."""

import json

from tests.align.token_layouts import Forward, capture_run, engine, trainer
from tests.helpers import tdiff_cli

PROMPTS = {"r1": 3, "r2": 2}
SEQUENCES = {"r1": [5, 6, 7, 23, 9, 10], "r2": [5, 11, 12, 13, 14]}
PARTED = {"r1": [5, 6, 7, 40, 9, 10], "r2": SEQUENCES["r2"]}   # run B sampled 40 where A sampled 23


def _hidden(data):
    return next(t for t in data["tensors"] if t["name"] == "hidden")


def test_runs_that_sample_different_tokens_diverge_there_and_compare_the_positions_before(tmp_path):
    capture_run(tmp_path / "a", engine(SEQUENCES, PROMPTS))
    capture_run(tmp_path / "b", engine(PARTED, PROMPTS, ["r2", "r1"]))
    result = tdiff_cli("compare", tmp_path / "a", tmp_path / "b", expect=1)
    assert "sampled token differs at seq 0/1 position 3: 23 vs 40" in result.output
    data = json.loads(tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--json", expect=1).output)
    assert data["status"] == "diverged" and data["first_divergence"] is None
    assert data["alignment"]["parted"] == [{"seq_a": 0, "seq_b": 1, "position": 3, "token_a": 23, "token_b": 40}]
    # r1's positions before 3 and all r2's fed ones (the engine never feeds its last sample)
    assert _hidden(data)["tokens"]["compared"] == 3 + (len(SEQUENCES["r2"]) - 1)
    assert data["alignment"]["uncompared"]["count"] == 0
    bisected = tdiff_cli("bisect", tmp_path / "a", tmp_path / "b", expect=1)
    assert "sampled token differs at seq 0/1 position 3: 23 vs 40" in bisected.output


def test_bisect_names_the_op_that_made_the_difference(tmp_path):
    """The row of the position before the parting (whose logits sampled it) differs on B."""
    capture_run(tmp_path / "a", engine(SEQUENCES, PROMPTS))
    capture_run(tmp_path / "b", engine(PARTED, PROMPTS, planted={("r1", 2): 0.5}))
    data = json.loads(tdiff_cli("bisect", tmp_path / "a", tmp_path / "b", "--json", expect=1).output)
    found = data["first_divergence"]
    assert found["name"] == "hidden" and found["token"]["position"] == 2
    assert any("sampled token differs" in note for note in data["notes"])


def test_n_samples_of_one_request_id_are_told_apart(tmp_path):
    """GRPO: two samples of request q, prefilled and decoded in the same forwards."""
    samples = {"q#0": [1, 2, 3, 4, 5, 6], "q#1": [1, 2, 3, 7, 8, 9], "p": [4, 4, 4, 4]}
    prompts = {"q#0": 3, "q#1": 3, "p": 2}
    capture_run(tmp_path / "engine", engine(samples, prompts))
    capture_run(tmp_path / "trainer", trainer(samples, ["q#1", "p", "q#0"]))
    data = json.loads(tdiff_cli("compare", tmp_path / "engine", tmp_path / "trainer", "--json", expect=0).output)
    fed = sum(len(s) - 1 for s in samples.values())
    assert _hidden(data)["tokens"]["compared"] == fed
    assert data["alignment"]["unmatched"] == {"a": [], "b": []}
    capture_run(tmp_path / "faulty", engine(samples, prompts, planted={("q#1", 4): 1.0}))
    data = json.loads(tdiff_cli("compare", tmp_path / "faulty", tmp_path / "trainer", "--json", expect=1).output)
    first = _hidden(data)["tokens"]["first_differing"]
    assert (first["seq_a"], first["position"]) == (1, 4)


def test_decode_steps_recorded_out_of_order_are_still_located(tmp_path):
    run = engine(SEQUENCES, PROMPTS, planted={("r1", 4): 1.0})
    run.forwards[1], run.forwards[2] = run.forwards[2], run.forwards[1]
    capture_run(tmp_path / "engine", run)
    capture_run(tmp_path / "trainer", trainer(SEQUENCES))
    data = json.loads(tdiff_cli("compare", tmp_path / "trainer", tmp_path / "engine", "--json", expect=1).output)
    hidden = _hidden(data)["tokens"]
    assert hidden["compared"] == sum(len(s) - 1 for s in SEQUENCES.values())
    assert hidden["compared"] - hidden["equal"] == 1 and hidden["first_differing"]["position"] == 4


def test_a_recompute_in_a_later_step_is_compared_claim_by_claim(tmp_path):
    """The engine feeds r1's prompt again in its last step (a retracted request re-prefilled): the
    second claim is compared too, and a fault in it alone is found."""
    run = engine(SEQUENCES, PROMPTS)
    run.forwards.append(Forward([("r1", [0, 1, 2])], padding=1))
    capture_run(tmp_path / "engine", run)
    capture_run(tmp_path / "trainer", trainer(SEQUENCES))
    data = json.loads(tdiff_cli("compare", tmp_path / "trainer", tmp_path / "engine", "--json", expect=0).output)
    assert _hidden(data)["tokens"]["compared"] == sum(len(s) - 1 for s in SEQUENCES.values()) + 3
    run.planted[(len(run.forwards) - 1, "r1", 1)] = 0.5
    capture_run(tmp_path / "faulty", run)
    data = json.loads(tdiff_cli("compare", tmp_path / "trainer", tmp_path / "faulty", "--json", expect=1).output)
    hidden = _hidden(data)["tokens"]
    assert hidden["compared"] - hidden["equal"] == 1
    # the engine's steps: tdiff.step() opens each forward, so forward k is step k + 1
    assert (hidden["first_differing"]["position"], hidden["first_differing"]["step_b"]) == (1, len(run.forwards))
