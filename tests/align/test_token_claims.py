"""No silent drops (issue 27 §2): a position claimed twice in one forward and the prefill rows of
a 1-D ``positions=`` dump are each compared with the other side's row of that token. (A
recompute in a later step: tests/align/test_token_parting.py.)"""

import json

import torch

import tdiff
from tests.align.token_layouts import row
from tests.helpers import tdiff_cli

SEQUENCES = [[5, 6, 7, 8, 9], [5, 11, 12, 13]]
PROMPT = 3


def _logprob(tokens, position, planted=None):
    """The log-prob of the token at ``position`` (scored from the one before)."""
    return row(tokens, position)[0] + (0.25 if planted == position else 0.0)


def _engine(path, planted=None):
    """A prefill of both prompts dumping its log-probs with a 1-D ``positions=`` (rows of
    sequence 0, then of sequence 1), then decode steps dumping one row per sequence."""
    with tdiff.capture(path):
        tdiff.step()
        tdiff.tokens(input_ids=[t for s in SEQUENCES for t in s[:PROMPT]], seq_lens=[PROMPT] * len(SEQUENCES),
                     seq_ids=["r0", "r1"])
        positions = [p for _ in SEQUENCES for p in range(1, PROMPT + 1)]
        values = [_logprob(s, p, planted if k == 1 else None) for k, s in enumerate(SEQUENCES)
                  for p in range(1, PROMPT + 1)]
        tdiff.dump("logprobs", torch.tensor(values), positions=torch.tensor(positions))
        for position in range(PROMPT, min(map(len, SEQUENCES)) - 1):
            tdiff.step()
            tdiff.tokens(input_ids=[s[position] for s in SEQUENCES], positions=[position] * len(SEQUENCES),
                         seq_lens=[1] * len(SEQUENCES), seq_ids=["r0", "r1"])
            tdiff.dump("logprobs", torch.tensor([_logprob(s, position + 1) for s in SEQUENCES]),
                       positions=torch.tensor([position + 1] * len(SEQUENCES)))


def _trainer(path):
    with tdiff.capture(path):
        tdiff.tokens(input_ids=[t for s in SEQUENCES for t in s], seq_lens=[len(s) for s in SEQUENCES],
                     seq_ids=["r0", "r1"])
        scored = [(k, p) for k, s in enumerate(SEQUENCES) for p in range(1, len(s))]
        tdiff.dump("logprobs", torch.tensor([_logprob(SEQUENCES[k], p) for k, p in scored]),
                   positions=torch.tensor([p for _, p in scored]), seq_ids=torch.tensor([k for k, _ in scored]))


def test_the_prefill_rows_of_a_1d_positions_dump_are_each_compared(tmp_path):
    _engine(tmp_path / "engine")
    _trainer(tmp_path / "trainer")
    data = json.loads(tdiff_cli("compare", tmp_path / "trainer", tmp_path / "engine", "--json", expect=0).output)
    scored = len(SEQUENCES) * PROMPT + len(SEQUENCES) * (min(map(len, SEQUENCES)) - 1 - PROMPT)
    assert data["tensors"][0]["tokens"]["compared"] == scored
    _engine(tmp_path / "faulty", planted=2)
    data = json.loads(tdiff_cli("compare", tmp_path / "trainer", tmp_path / "faulty", "--json", expect=1).output)
    first = data["first_divergence"]["tokens"]["first_differing"]
    assert (first["seq_b"], first["position"]) == (1, 2)


def test_a_position_claimed_twice_in_one_forward_compares_each_claim(tmp_path):
    """A re-fed token (a draft verified again): the forward holds position 2 twice; its second
    row alone differs."""
    tokens = SEQUENCES[0]
    for side, second in (("a", 0.0), ("b", 0.5)):
        with tdiff.capture(tmp_path / side):
            fed = [0, 1, 2, 2] if side == "b" else [0, 1, 2]
            tdiff.tokens(input_ids=[tokens[p] for p in fed], positions=fed, seq_ids=["r0"])
            values = [row(tokens, p) for p in fed]
            if side == "b":
                values[-1][0] += second
            tdiff.dump("hidden", torch.tensor(values))
    data = json.loads(tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--align", "tokens", "--json",
                                expect=1).output)
    verdict = data["tensors"][0]["tokens"]
    assert verdict["compared"] == 4 and verdict["equal"] == 3 and verdict["first_differing"]["position"] == 2


def test_generates_last_token_logits_of_a_padded_prefill_align_with_each_sequences_last_prompt_token(tmp_path):
    """Hugging Face's generate keeps one row per sequence ([batch, 1, vocab], logits_to_keep=1)
    in its prefill over a right-padded [batch, seq] batch (issue 27 §6)."""
    prompts = [s[:PROMPT + k] for k, s in enumerate(SEQUENCES)]
    width = max(map(len, prompts))
    for side in ("engine", "faulty"):
        with tdiff.capture(tmp_path / side):
            tdiff.tokens(input_ids=torch.tensor([p + [0] * (width - len(p)) for p in prompts]),
                         seq_lens=[len(p) for p in prompts], seq_ids=["r0", "r1"])
            last = [row(s, len(p) - 1) for s, p in zip(SEQUENCES, prompts)]
            if side == "faulty":
                last[1][2] += 1.0
            tdiff.dump("logits", torch.tensor(last).unsqueeze(1))
    with tdiff.capture(tmp_path / "trainer"):
        tdiff.tokens(input_ids=[t for s in SEQUENCES for t in s], seq_lens=[len(s) for s in SEQUENCES],
                     seq_ids=["r0", "r1"])
        tdiff.dump("logits", torch.tensor([row(s, p) for s in SEQUENCES for p in range(len(s))]))
    data = json.loads(tdiff_cli("compare", tmp_path / "trainer", tmp_path / "engine", "--align", "tokens", "--json",
                                expect=0).output)
    assert data["tensors"][0]["tokens"]["compared"] == len(SEQUENCES)
    data = json.loads(tdiff_cli("compare", tmp_path / "trainer", tmp_path / "faulty", "--align", "tokens", "--json",
                                expect=1).output)
    first = data["first_divergence"]["tokens"]["first_differing"]
    assert (first["seq_a"], first["position"]) == (1, len(prompts[1]) - 1)
