"""The report of a rollout against training (tests/stacks/hf_rollout: Hugging Face with a KV
cache against its full forward, two prompts of different lengths, the trainer's batch in the other
order): log-prob parity per sequence and rank, the culprit's tokens named by (sequence,
position), and its picture over (sequence, position)."""

import json
import struct

import pytest
import torch

import tdiff

from tdiff.align import choose_pairing
from tdiff.compare import compare_dumps
from tdiff.compare.engine import CompareOptions
from tdiff.compare.metrics import Tolerance
from tdiff.report.html import render_html
from tdiff.report.markdown import render_markdown
from tdiff.report.model import build_report
from tdiff.report.parity import response_starts
from tdiff.store import open_dump
from tdiff.store.tokens import RowTokens
from tests.helpers import tdiff_cli
from tests.stacks.hf_rollout import capture_runs, rollout as hf_rollout

PROMPTS, DECODE_STEPS, FAULTY = hf_rollout.PROMPTS, hf_rollout.DECODE_STEPS, hf_rollout.FAULTY
ATOL = 1e-5
NEAR = Tolerance(atol=ATOL)    # decode and prefill differ legitimately around 1e-7 (fp32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    return root, capture_runs(root)


def logprobs_by_row(path) -> dict[tuple[int, int], float]:
    """(batch row, position) -> the log-prob dumped for the token there, over every step. Both
    runs keep a sequence in one batch row (the trainer's rows in the other order)."""
    dump = open_dump(path)
    out = {}
    for record in dump.records:
        if record.name == "logprobs":
            rows = RowTokens.of(record.attrs)
            for row, position, value in zip(rows.seqs, rows.positions, dump.load(record).flatten().tolist()):
                out[(row, position)] = value
    return out


def bits(value: float) -> bytes:
    return struct.pack("<f", value)


def expected_parity(root, b: str, rollout) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(trainer sequence, B sequence) -> (response tokens, bitwise equal, within ATOL), from the tensors."""
    trainer, other = logprobs_by_row(root / "trainer"), logprobs_by_row(root / b)
    out = {}
    for seq_b, sequence in enumerate(rollout.sequences):
        seq_a = len(rollout.sequences) - 1 - seq_b
        # the engine scores each sampled token: positions len(prompt) .. the last one
        positions = range(len(PROMPTS[seq_b]), len(sequence))
        pairs = [(trainer[(seq_a, p)], other[(seq_b, p)]) for p in positions]
        out[(seq_a, seq_b)] = (len(pairs), sum(bits(x) == bits(y) for x, y in pairs),
                               sum(abs(x - y) <= ATOL for x, y in pairs))
    return out


def report_of(root, b: str, tolerance=NEAR):
    a, other = open_dump(root / "trainer"), open_dump(root / b)
    compared = compare_dumps(a, other, CompareOptions(tolerance=tolerance), pairing=choose_pairing(a, other))
    return build_report(compared)


def parity_of(report) -> dict[tuple[int, int], tuple[int, int, int | None]]:
    assert {(row.tensor, row.rank, row.rank_b, row.scope) for row in report.token_parity} == \
        {("logprobs", 0, 0, "response")}
    return {(row.seq_a, row.seq_b): (row.compared, row.equal, row.within) for row in report.token_parity}


def test_the_response_starts_where_the_first_decode_step_fed_a_sequence(runs):
    root, _ = runs
    assert response_starts(open_dump(root / "engine")) == {i: len(p) for i, p in enumerate(PROMPTS)}
    assert response_starts(open_dump(root / "trainer")) == {}    # one forward, no prompt_lens


def test_parity_counts_the_response_log_probs_per_sequence_and_rank(runs):
    root, rollout = runs
    report = report_of(root, "engine")
    assert report.status == "match"
    assert parity_of(report) == expected_parity(root, "engine", rollout)
    bitwise = parity_of(report_of(root, "engine", Tolerance()))
    assert bitwise == {key: (n, equal, None) for key, (n, equal, _) in expected_parity(root, "engine", rollout).items()}


def test_a_decode_only_fault_lowers_the_equal_count_at_exactly_its_tokens(runs):
    root, rollout = runs
    clean, faulty = parity_of(report_of(root, "engine")), parity_of(report_of(root, "faulty"))
    expected = expected_parity(root, "faulty", rollout)
    assert faulty == expected
    engine, broken = logprobs_by_row(root / "engine"), logprobs_by_row(root / "faulty")
    for (seq_a, seq_b), (compared, equal, within) in faulty.items():
        prompt = len(PROMPTS[seq_b])
        # the decode steps score positions prompt + 1 on; the prefill scores position `prompt`
        decoded = range(prompt + 1, len(rollout.sequences[seq_b]))
        assert all(bits(engine[(seq_b, p)]) != bits(broken[(seq_b, p)]) for p in decoded)
        assert bits(engine[(seq_b, prompt)]) == bits(broken[(seq_b, prompt)])
        assert compared == clean[(seq_a, seq_b)][0] == len(decoded) + 1
        assert within == clean[(seq_a, seq_b)][2] - len(decoded) == 1


def test_the_culprits_tokens_are_named_by_sequence_and_position(runs):
    root, _ = runs
    report = report_of(root, "faulty")
    tokens = report.culprit.tokens
    assert report.culprit.comparison.name == FAULTY and tokens.refs is not None
    assert len(tokens.refs) == len(tokens.max_abs)
    differing = [ref for ref, n in zip(tokens.refs, tokens.differing) if n]
    # the fault touches the tokens the decode steps fed (B's steps 1 on), every one of them
    assert {(ref.seq_b, ref.position) for ref in differing} == \
        {(i, p) for i, prompt in enumerate(PROMPTS) for p in range(len(prompt), len(prompt) + DECODE_STEPS)}
    assert all(ref.step_b >= 1 for ref in differing)
    worst = tokens.refs[tokens.worst]
    text = render_markdown(report)
    assert f"the worst is position {worst.position} of sequence {worst.seq_a} (A) / {worst.seq_b} (B)" in text
    assert report.to_json()["culprit"]["tokens"]["tokens"][tokens.worst] == worst.to_json()
    assert "Log-prob parity per token" in text
    compared = sum(row.compared for row in report.token_parity)
    equal = sum(row.equal for row in report.token_parity)
    assert f"{equal:,}/{compared:,} token/rank log-probs bitwise equal" in text


def test_html_draws_the_first_divergence_over_sequence_and_position(runs):
    root, _ = runs
    report = report_of(root, "faulty")
    page = render_html(report)
    assert 'id="plot-token-grid"' in page and 'id="token-parity"' in page
    clean = render_html(report_of(root, "engine"))
    assert 'id="plot-token-grid"' not in clean and 'id="token-parity"' in clean


def test_the_report_json_lists_token_parity(runs):
    root, rollout = runs
    result = tdiff_cli("report", root / "trainer", root / "engine", "--atol", str(ATOL), "--format", "json",
                       expect=0)
    rows = json.loads(result.output)["token_parity"]
    expected = expected_parity(root, "engine", rollout)
    assert {(r["seq_a"], r["seq_b"]): (r["compared"], r["equal"], r["within_tolerance"]) for r in rows} == expected


def test_prompt_lens_say_where_the_response_starts_and_without_them_every_token_counts(tmp_path):
    """Log-probs computed by hand (no model) for two sequences, scored at positions 1 on; A's
    token metadata gives prompt_lens, B's and C's none. Faults planted in a prompt and a response."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 2, 1, 0]])
    positions = torch.arange(1, ids.shape[1]).expand(len(ids), -1)
    prompt_lens = [2, 3]
    torch.manual_seed(0)
    clean = torch.randn(positions.shape)
    planted = clean.clone()
    planted[0, 0] += 1      # sequence 0, position 1: a prompt token
    planted[1, -1] += 1     # sequence 1, the last position: a response token
    for name, values, lens in (("a", clean, prompt_lens), ("b", planted, None), ("c", clean, None)):
        with tdiff.capture(tmp_path / name):
            tdiff.tokens(input_ids=ids, prompt_lens=lens)
            tdiff.dump("logprobs", values, positions=positions)
    same_bits = clean.view(torch.int32) == planted.view(torch.int32)

    def parity(a: str, b: str) -> dict:
        da, db = open_dump(tmp_path / a), open_dump(tmp_path / b)
        report = build_report(compare_dumps(da, db, pairing=choose_pairing(da, db, align="tokens")))
        return {row.seq_a: (row.seq_b, row.scope, row.compared, row.equal, row.within) for row in report.token_parity}

    assert parity("a", "b") == {s: (s, "response", int((positions[s] >= n).sum()),
                                    int(same_bits[s][positions[s] >= n].sum()), None)
                                for s, n in enumerate(prompt_lens)}
    assert parity("c", "b") == {s: (s, "all", positions.shape[1], int(same_bits[s].sum()), None)
                                for s in range(len(ids))}


def test_without_log_probs_the_logits_rows_are_counted(tmp_path):
    ids = torch.tensor([[5, 6, 7], [3, 4, 2]])
    torch.manual_seed(1)
    clean = torch.randn(2, 3, 8)
    planted = clean.clone()
    planted[1, 2, 5] += 1
    for name, values in (("a", clean), ("b", planted)):
        with tdiff.capture(tmp_path / name):
            tdiff.tokens(input_ids=ids)
            tdiff.dump("logits", values, positions=torch.arange(3).expand(2, -1))
    a, b = open_dump(tmp_path / "a"), open_dump(tmp_path / "b")
    report = build_report(compare_dumps(a, b, pairing=choose_pairing(a, b, align="tokens")))
    rows_equal = (clean.view(torch.int32) == planted.view(torch.int32)).all(dim=-1)
    assert {(r.tensor, r.seq_a, r.scope, r.compared, r.equal) for r in report.token_parity} == \
        {("logits", s, "all", 3, int(rows_equal[s].sum())) for s in range(2)}


def test_each_rank_counts_its_own_log_probs(tmp_path, monkeypatch):
    """Two tensor-parallel ranks, each holding every sequence's log-probs (as after the vocab
    all-reduce); a fault planted on rank 1 alone lowers rank 1's count only."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 2, 1, 0]])
    positions = torch.arange(1, ids.shape[1]).expand(len(ids), -1)
    prompt_lens = [2, 3]
    torch.manual_seed(2)
    clean = torch.randn(positions.shape)
    planted = clean.clone()
    planted[1, -1] += 1     # sequence 1, its last response token
    monkeypatch.setenv("TDIFF_RUN", "two-ranks")   # the ranks' captures are parts of one run
    for name in ("a", "b"):
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            with tdiff.capture(tmp_path / name):
                tdiff.tokens(input_ids=ids, prompt_lens=prompt_lens)
                tdiff.dump("logprobs", planted if (name, rank) == ("b", 1) else clean, positions=positions)
    a, b = open_dump(tmp_path / "a"), open_dump(tmp_path / "b")
    report = build_report(compare_dumps(a, b, pairing=choose_pairing(a, b, align="tokens")))
    same_bits = clean.view(torch.int32) == planted.view(torch.int32)
    response = [positions[s] >= n for s, n in enumerate(prompt_lens)]
    expected = {(rank, s): (int(response[s].sum()), int(response[s].sum()) if rank == 0
                            else int(same_bits[s][response[s]].sum()))
                for rank in (0, 1) for s in range(len(ids))}
    # a run numbers its sequences across ranks in order of first appearance: rank 1's come second
    assert {(r.rank, r.seq_a - r.rank * len(ids)): (r.compared, r.equal) for r in report.token_parity} == expected
    assert all(r.seq_a == r.seq_b and r.rank == r.rank_b for r in report.token_parity)
