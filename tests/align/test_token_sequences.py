"""Sequences followed across steps and matched across runs: ragged engine batches whose order
changes between steps, chunked prefill, n samples of one prompt (request ids, then order),
packed trainer rows and padding, on dumps written by tdiff.tokens and tdiff.dump."""

import pytest
import torch

import tdiff
from tdiff.align import TokenPairing, choose_pairing
from tdiff.compare import compare_dumps
from tdiff.store import open_dump

PROMPT = [11, 12, 13]
RESPONSES = {"r1": [7, 8, 9], "r2": [7, 8, 9], "r3": [5, 6, 4]}   # r1 and r2: one prompt sampled twice alike


def value(request: str, position: int, planted: set | frozenset = frozenset()) -> list[float]:
    """What both runs compute for a token: different for every request, so a wrong partner shows."""
    base = float(sorted(RESPONSES).index(request) * 100 + position)
    return [base + (0.5 if (request, position) in planted else 0.0), -base]


def engine(path, order_by_step, *, ids=True, chunk=None, planted=frozenset(), last_planted=frozenset()):
    """A ragged engine: step 0 prefills every prompt (optionally in two chunks), then one decode
    step per response token but the last, the batch order given per step."""
    with tdiff.capture(path):
        steps = [[(r, list(range(len(PROMPT)))) for r in order_by_step[0]]]
        if chunk:
            steps = [[(r, list(range(chunk))) for r in order_by_step[0]],
                     [(r, list(range(chunk, len(PROMPT)))) for r in order_by_step[0]]]
        for k, order in enumerate(order_by_step[1:], 1):
            steps.append([(r, [len(PROMPT) + k - 1]) for r in order])
        for fed in steps:
            tokens = [(PROMPT + RESPONSES[r])[p] for r, positions in fed for p in positions]
            tdiff.step()
            tdiff.tokens(input_ids=tokens + [0], positions=[p for _, ps in fed for p in ps] + [0],
                         seq_lens=[len(ps) for _, ps in fed],
                         seq_ids=[r for r, _ in fed] if ids else None)
            rows = [value(r, p, planted) for r, ps in fed for p in ps] + [[0.0, 0.0]]   # + a padding cell
            tdiff.dump("hidden", torch.tensor(rows))
            prefill = any(len(ps) > 1 for _, ps in fed)
            # an LM head that scores only each sequence's last token in the prefill
            tdiff.dump("logits", torch.tensor([value(r, ps[-1], last_planted) for r, ps in fed]) if prefill
                       else torch.tensor(rows))
    return open_dump(path)


def packed_trainer(path, order, *, ids=True):
    sequences = [PROMPT + RESPONSES[r] for r in order]
    with tdiff.capture(path):
        tdiff.tokens(input_ids=[t for s in sequences for t in s], seq_lens=[len(s) for s in sequences],
                     seq_ids=list(order) if ids else None)
        rows = torch.tensor([value(r, p) for r in order for p in range(len(PROMPT) + 3)])
        tdiff.dump("hidden", rows)
        tdiff.dump("logits", rows)
    return open_dump(path)


def aligned(a, b):
    pairing = choose_pairing(a, b)
    assert isinstance(pairing, TokenPairing)
    return compare_dumps(a, b, pairing=pairing), pairing.alignment


@pytest.mark.parametrize("chunk", [None, 2])
def test_sequences_followed_by_request_id_across_reordered_batches_match_a_packed_trainer(tmp_path, chunk):
    a = packed_trainer(tmp_path / "trainer", ["r2", "r3", "r1"])
    b = engine(tmp_path / "engine", [["r1", "r2", "r3"], ["r3", "r1", "r2"], ["r2", "r3", "r1"]], chunk=chunk)
    report, alignment = aligned(a, b)
    assert report.status == "match", report.first_divergence.to_json()
    fed = len(RESPONSES) * (len(PROMPT) + 2)
    assert report.comparisons[0].tokens.compared == fed
    # identical sequences r1 and r2 pair by request id: trainer's 0 is r2, the engine's 1
    assert {(s.a, s.b) for s in alignment.sequences} == {(0, 1), (1, 2), (2, 0)}
    assert all(s.only_a == [len(PROMPT) + 2] for s in alignment.sequences)


def test_without_request_ids_identical_sequences_pair_in_order(tmp_path):
    a = packed_trainer(tmp_path / "trainer", ["r1", "r2", "r3"], ids=False)
    b = engine(tmp_path / "engine", [["r1", "r2", "r3"]] * 3, ids=False)
    report, alignment = aligned(a, b)
    assert report.status == "match"
    assert {(s.a, s.b) for s in alignment.sequences} == {(0, 0), (1, 1), (2, 2)}


def test_a_decode_token_that_differs_is_named_by_sequence_position_and_step(tmp_path):
    planted = {("r3", len(PROMPT) + 1)}
    a = packed_trainer(tmp_path / "trainer", ["r2", "r3", "r1"])
    b = engine(tmp_path / "engine", [["r1", "r2", "r3"], ["r3", "r1", "r2"], ["r2", "r3", "r1"]], planted=planted)
    report, _ = aligned(a, b)
    first = report.first_divergence
    assert first.name == "hidden" and first.tokens.compared - first.tokens.equal == 1
    # the engine's steps: 1 the prefill (tdiff.step() opens each), 1 + k the k-th decode, which feeds
    # position len(PROMPT) + k - 1
    assert first.tokens.first_differing.to_json() == {"seq_a": 1, "seq_b": 2, "position": len(PROMPT) + 1,
                                                      "step_a": 0, "step_b": 1 + 2}


def test_a_sequence_the_other_run_lacks_is_listed_and_its_tokens_are_one_sided(tmp_path):
    a = packed_trainer(tmp_path / "trainer", ["r3", "r1"])
    b = engine(tmp_path / "engine", [["r1", "r2", "r3"]] * 3)
    report, alignment = aligned(a, b)
    assert report.status == "match"
    assert [u["seq"] for u in alignment.unmatched_b] == [1]
    assert report.comparisons[0].tokens.only_b == len(PROMPT) + 2


def test_an_lm_head_scoring_each_sequences_last_token_in_the_prefill_aligns_with_its_last_fed_position(tmp_path):
    """The engine's prefill logits are [num_seqs, vocab] (SGLang's logits processor): row s is
    sequence s's last prompt position (issue 27 §6)."""
    a = packed_trainer(tmp_path / "trainer", ["r1", "r2", "r3"])
    b = engine(tmp_path / "engine", [["r1", "r2", "r3"]] * 3)
    report, alignment = aligned(a, b)
    assert report.status == "match"
    logits = next(c for c in report.comparisons if c.name == "logits")
    assert logits.tokens.compared == len(RESPONSES) * (1 + 2)    # the prompt's last token, then the decodes'
    assert not alignment.partly and alignment.uncompared.count == 0
    planted = engine(tmp_path / "planted", [["r1", "r2", "r3"]] * 3, last_planted={("r3", len(PROMPT) - 1)})
    report, _ = aligned(a, planted)
    logits = next(c for c in report.comparisons if c.name == "logits")
    assert logits.tokens.first_differing.position == len(PROMPT) - 1 and logits.tokens.equal == logits.tokens.compared - 1


def test_replicated_ranks_hold_one_layout_and_another_batching_is_another(tmp_path, monkeypatch):
    from tdiff.align.tokens import layouts_differ

    monkeypatch.setenv("TDIFF_RUN", "two-ranks")   # the ranks' captures are parts of one run
    for rank in ("0", "1"):   # two tensor-parallel ranks: the same tokens on each
        monkeypatch.setenv("RANK", rank)
        packed_trainer(tmp_path / "tp2", ["r1", "r2"])
    monkeypatch.setenv("RANK", "0")
    tp2, tp1 = open_dump(tmp_path / "tp2"), packed_trainer(tmp_path / "tp1", ["r1", "r2"])
    assert sorted(tp2.token_batches()) == [(0, 0), (0, 1)]
    assert not layouts_differ(tp2, tp1)
    assert not isinstance(choose_pairing(tp2, tp1), TokenPairing)
    other = packed_trainer(tmp_path / "other", ["r1", "r3"])
    assert layouts_differ(tp1, other) and isinstance(choose_pairing(tp1, other), TokenPairing)


def test_when_no_tensor_has_rows_by_token_the_dumps_pair_by_name_unless_tokens_are_asked_for(tmp_path):
    """One sequence alone against the same sequence in a batch: both forwards carry token metadata,
    but the script dumps only its first row's log-probs, without positions (nothing to locate)."""
    from tdiff.compare.pairing import NamePairing
    from tdiff.errors import TdiffError

    sequences = [PROMPT + RESPONSES[r] for r in ("r1", "r3")]
    dumps = []
    for name, batch in (("alone", sequences[:1]), ("batched", sequences)):
        with tdiff.capture(tmp_path / name):
            tdiff.tokens(input_ids=[t for s in batch for t in s], seq_lens=[len(s) for s in batch])
            tdiff.dump("logprobs", torch.tensor([[value("r1", p)[0] for p in range(len(sequences[0]) - 1)]]))
        dumps.append(open_dump(tmp_path / name))
    pairing = choose_pairing(*dumps)
    report = compare_dumps(*dumps, pairing=pairing)
    assert isinstance(pairing.base, NamePairing) and pairing.alignment is None
    assert report.status == "match" and [c.name for c in report.comparisons] == ["logprobs"]
    with pytest.raises(TdiffError, match="nothing to compare"):
        compare_dumps(*dumps, pairing=choose_pairing(*dumps, align="tokens"))
