"""Rollout against training on real stacks (examples/rollout): SGLang's engine generating with its
KV cache (EXTEND, then DECODE steps) against megatron-core scoring the finished sequences, padded
and packed THD, every run captured by `tdiff capture` in a subprocess as a user would."""

import json
import struct

from itertools import chain

import pytest

from tdiff.bisect import bisect_dumps
from tdiff.store import open_dump
from tdiff.store.tokens import PADDING, RowTokens
from tdiff.testing import assert_match
from tests.helpers import REPO, tdiff_cli, tdiff_process

pytestmark = pytest.mark.slow

ENGINE = REPO / "examples" / "rollout" / "engine.py"
TRAINER = REPO / "examples" / "rollout" / "trainer.py"
PLANTED_ATTENTION = "model.layers.1.self_attn.attn"
STEPS = 3
CHUNK = 3   # chunked prefill: the prompts' first 3 tokens, then the rest on top of their KV cache
# fp32 round-off between a cached decode and a full forward (cpu-stacks.md measures 1e-6)
TOLERANCE = 1e-5
FORWARD_BATCH = "forward_batch (an object tdiff does not record: ForwardBatch)"


def captured(root, name, script, *args):
    result = tdiff_process("capture", "--out", root / name, "--", "python", script, *map(str, args),
                           env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    rollout = root / "rollout.json"
    planted = root / "planted.json"   # the trainer scores what the faulty engine generated
    out = {"engine": captured(root, "engine", ENGINE, "--rollout", rollout, "--steps", STEPS),
           "planted": captured(root, "planted", ENGINE, "--rollout", planted, "--steps", STEPS, "--planted"),
           "padded": captured(root, "padded", TRAINER, "--rollout", rollout),
           "thd": captured(root, "thd", TRAINER, "--rollout", rollout, "--layout", "thd"),
           "thd-padded": captured(root, "thd-padded", TRAINER, "--rollout", rollout, "--layout", "thd",
                                  "--pad-to", 4),
           "planted-trainer": captured(root, "planted-trainer", TRAINER, "--rollout", planted, "--layout", "thd"),
           "chunked": captured(root, "chunked", ENGINE, "--rollout", root / "chunked.json", "--steps", STEPS,
                               "--chunk", CHUNK),
           "chunked-trainer": captured(root, "chunked-trainer", TRAINER, "--rollout", root / "chunked.json")}
    return out, json.loads(rollout.read_text())


def test_each_engine_forward_records_its_tokens_from_the_forward_batch(runs):
    dumps, rollout = runs
    sequences, prompt_lens, rids = rollout["sequences"], rollout["prompt_lens"], rollout["rids"]
    batches = open_dump(dumps["engine"]).token_batches()
    assert sorted(batches) == [(step, 0) for step in range(STEPS + 1)]
    prefill = batches[(0, 0)]   # EXTEND: the prompts, ragged
    assert prefill.source == "sglang" and prefill.seq_ids == rids
    assert prefill.input_ids == list(chain(*(s[:n] for s, n in zip(sequences, prompt_lens))))
    assert prefill.positions == list(chain(*(range(n) for n in prompt_lens)))
    assert prefill.seqs == list(chain(*([i] * n for i, n in enumerate(prompt_lens))))
    for step in range(1, STEPS + 1):   # DECODE: one token per request, the one sampled before
        decode = batches[(step, 0)]
        positions = [n + step - 1 for n in prompt_lens]
        assert decode.shape == (len(rids),) and decode.seq_ids == rids and decode.seqs == [0, 1]
        assert decode.positions == positions
        assert decode.input_ids == [s[p] for s, p in zip(sequences, positions)]


@pytest.mark.parametrize("layout", ["padded", "thd", "thd-padded"])
def test_the_trainer_forward_records_its_tokens_padding_dropped(runs, layout):
    dumps, rollout = runs
    sequences = rollout["sequences"]
    [(key, batch)] = open_dump(dumps[layout]).token_batches().items()
    assert key == (0, 0) and batch.source == "megatron" and batch.sequences == len(sequences)
    real = [(batch.seqs[i], batch.positions[i], batch.input_ids[i]) for i in range(batch.cells)
            if batch.seqs[i] != PADDING]
    assert real == [(i, p, t) for i, s in enumerate(sequences) for p, t in enumerate(s)]
    padding = batch.cells - sum(map(len, sequences))
    assert padding == (0 if layout == "thd" else batch.seqs.count(PADDING)) and (layout == "thd" or padding > 0)


def logprobs_by_token(dump_path) -> dict[tuple[int, int], float]:
    """(sequence, position) -> the log-prob recorded for the token there, over every step."""
    dump = open_dump(dump_path)
    out = {}
    for record in dump.records:
        if record.name == "logprobs":
            rows = RowTokens.of(record.attrs)
            for seq, position, value in zip(rows.seqs, rows.positions, dump.load(record).tolist()):
                out[(seq, position)] = value
    return out


@pytest.mark.parametrize("layout", ["padded", "thd", "thd-padded"])
def test_the_rollout_log_probs_are_the_trainer_log_probs_within_fp32_round_off(runs, layout):
    dumps, rollout = runs
    engine, trainer = logprobs_by_token(dumps["engine"]), logprobs_by_token(dumps[layout])
    responses = {(i, p) for i, (s, n) in enumerate(zip(rollout["sequences"], rollout["prompt_lens"]))
                 for p in range(n, len(s))}
    assert set(engine) == set(trainer) == responses
    assert max(abs(engine[t] - trainer[t]) for t in responses) <= TOLERANCE


@pytest.mark.parametrize("layout", ["padded", "thd"])
def test_the_report_counts_log_prob_parity_per_sequence_and_rank(runs, layout):
    """`tdiff report`'s parity table: per sequence, the response tokens whose log-probs are
    bitwise equal and within the tolerance, as the tensors say (one rank: no tensor parallelism)."""
    dumps, rollout = runs
    engine, trainer = logprobs_by_token(dumps["engine"]), logprobs_by_token(dumps[layout])
    expected = {}
    for i, (sequence, prompt) in enumerate(zip(rollout["sequences"], rollout["prompt_lens"])):
        pairs = [(engine[(i, p)], trainer[(i, p)]) for p in range(prompt, len(sequence))]
        expected[(i, i, 0)] = (len(pairs), sum(struct.pack("<f", x) == struct.pack("<f", y) for x, y in pairs),
                               sum(abs(x - y) <= TOLERANCE for x, y in pairs))
    result = tdiff_cli("report", dumps["engine"], dumps[layout], "--atol", str(TOLERANCE), "--format", "json",
                       expect=0)
    rows = json.loads(result.output)["token_parity"]
    assert {(r["seq_a"], r["seq_b"], r["rank"]): (r["compared"], r["equal"], r["within_tolerance"])
            for r in rows} == expected
    assert {(r["tensor"], r["scope"]) for r in rows} == {("logprobs", "response")}


def test_the_planted_fault_is_on_the_decode_path_alone(runs):
    """Engine against engine (one framework, paired by name): the prefill is bitwise the clean
    one, and bisect names the decode attention of layer 1 at the first decode step."""
    dumps, _ = runs
    clean, planted = open_dump(dumps["engine"]), open_dump(dumps["planted"])
    prefill = {r.pair_key: r.fingerprint for r in clean.records if r.step == 0}
    planted_prefill = {r.pair_key: r.fingerprint for r in planted.records if r.step == 0}
    assert planted_prefill == prefill
    result = bisect_dumps(clean, planted)
    found = result.first_divergence
    assert (found.module, found.kind, found.step) == (PLANTED_ATTENTION, "attention", 1)
    assert found.introduced
    # it reads the KV cache through its ForwardBatch, which capture does not record: not "its inputs match"
    assert found.not_compared == FORWARD_BATCH and "its inputs match" not in found.description


@pytest.mark.parametrize("layout", ["padded", "thd", "thd-padded"])
def test_clean_rollout_and_training_match_under_a_tolerance_once_aligned_by_token(runs, layout):
    dumps, _ = runs
    assert_match(dumps["engine"], dumps[layout], atol=TOLERANCE)
    assert_match(dumps[layout], dumps["engine"], atol=TOLERANCE)


def test_a_decode_only_fault_is_named_with_its_module_kind_and_token(runs):
    dumps, _ = runs
    rollout = json.loads((dumps["planted"].parent / "planted.json").read_text())
    result = bisect_dumps(dumps["planted"], dumps["planted-trainer"],
                          pairing=choose_pairing_for(dumps["planted"], dumps["planted-trainer"]),
                          tolerance=tolerance(TOLERANCE))
    found = result.first_divergence
    assert (found.module, found.kind, found.layer) == (PLANTED_ATTENTION, "attention", 1)
    assert found.module_b == "decoder.layers.1.self_attention.core_attention" and found.introduced
    assert FORWARD_BATCH in found.not_compared and "its compared inputs match" in found.description
    token = found.to_json()["token"]
    # a decode step's token: past its prompt, fed at step >= 1 by the engine, at step 0 by the trainer
    assert token["step_a"] >= 1 and token["step_b"] == 0
    assert token["position"] >= rollout["prompt_lens"][token["seq_a"]]
    with pytest.raises(AssertionError, match=f"introduced at {PLANTED_ATTENTION} \\(attention, layer 1\\)"):
        assert_match(dumps["planted"], dumps["planted-trainer"], atol=TOLERANCE)


def choose_pairing_for(a, b):
    from tdiff.align import choose_pairing

    return choose_pairing(open_dump(a), open_dump(b))


def tolerance(atol):
    from tdiff.compare.metrics import Tolerance

    return Tolerance(atol=atol, rtol=0.0)


def test_a_chunked_prefill_continues_its_sequences_and_aligns_with_training(runs):
    dumps, _ = runs
    rollout = json.loads((dumps["chunked"].parent / "chunked.json").read_text())
    batches = open_dump(dumps["chunked"]).token_batches()
    first, rest = batches[(0, 0)], batches[(1, 0)]
    assert first.positions == list(chain(*(range(CHUNK) for _ in rollout["prompt_lens"])))
    assert rest.positions == list(chain(*(range(CHUNK, n) for n in rollout["prompt_lens"])))
    assert rest.seq_ids == first.seq_ids == rollout["rids"]
    engine, trainer = open_dump(dumps["chunked"]), open_dump(dumps["chunked-trainer"])
    pairing = choose_pairing_for(dumps["chunked"], dumps["chunked-trainer"])
    pairing.pair(engine, trainer)
    alignment = pairing.alignment.to_json()
    # each chunk joins its sequence: every token but the last sampled one is fed by both runs
    assert alignment["unmatched"] == {"a": [], "b": []}
    assert sum(s["shared"] for s in alignment["sequences"]) == sum(len(s) - 1 for s in rollout["sequences"])
    assert_match(engine, trainer, atol=TOLERANCE)
