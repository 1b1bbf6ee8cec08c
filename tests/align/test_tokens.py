"""Token alignment: Hugging Face with a KV cache (prefill + decode, two prompts of different
lengths, left-padded) against Hugging Face's full forward of the finished sequences
(right-padded, in the other order)."""

import json
import shutil

import pytest

from tdiff.align import TokenAlignment, TokenPairing, choose_pairing
from tdiff.bisect import bisect_dumps
from tdiff.compare import compare_dumps
from tdiff.compare.engine import CompareOptions
from tdiff.compare.metrics import Tolerance
from tdiff.errors import TdiffError
from tdiff.store import open_dump
from tests.helpers import tdiff_cli, tiny_qwen2
from tests.stacks.hf_rollout import capture_runs, rollout as hf_rollout

PROMPTS, DECODE_STEPS, FAULTY = hf_rollout.PROMPTS, hf_rollout.DECODE_STEPS, hf_rollout.FAULTY
TOLERANCE = Tolerance(atol=1e-5)   # decode and prefill differ legitimately around 1e-7 (fp32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    return root, capture_runs(root)


def _dumps(root, b="engine"):
    return open_dump(root / "trainer"), open_dump(root / b)


def test_layouts_that_differ_pair_by_token_and_clean_runs_match_under_a_small_tolerance(runs):
    root, _ = runs
    trainer, engine = _dumps(root)
    pairing = choose_pairing(trainer, engine)
    assert isinstance(pairing, TokenPairing)
    report = compare_dumps(trainer, engine, CompareOptions(tolerance=TOLERANCE), pairing=pairing)
    assert report.status == "match", report.first_divergence.to_json()
    fed = sum(len(p) + DECODE_STEPS for p in PROMPTS)   # the engine never feeds its last sample
    layer = next(c for c in report.comparisons if c.name == "model.layers.0" and c.record.role == "output")
    assert (layer.tokens.compared, layer.tokens.equal) == (fed, fed)
    assert layer.tokens.only_a == len(PROMPTS) and layer.tokens.only_b == 0
    logprobs = next(c for c in report.comparisons if c.name == "logprobs")
    # every sampled token is scored by both; the trainer also scores the prompts' tokens
    assert logprobs.tokens.compared == len(PROMPTS) * (DECODE_STEPS + 1)
    assert logprobs.tokens.only_a >= sum(len(p) - 1 for p in PROMPTS)


def test_sequences_pair_by_token_ids_across_orders_and_the_last_sample_is_one_sided(runs):
    root, rollout = runs
    trainer, engine = _dumps(root)
    pairing = choose_pairing(trainer, engine)
    pairing.pair(trainer, engine)
    alignment = pairing.alignment
    assert isinstance(alignment, TokenAlignment)
    pairs = {(s.a, s.b) for s in alignment.sequences}
    assert pairs == {(0, 1), (1, 0)}      # the trainer holds the sequences in the other order
    for sequence in alignment.sequences:
        finished = rollout.sequences[sequence.b]
        assert sequence.only_a == [len(finished) - 1] and sequence.only_b == []
        assert sequence.shared == len(finished) - 1
    assert not alignment.unmatched_a and not alignment.unmatched_b
    # only the attention masks have no row per token ([batch, 1, seq, keys]; [batch, keys] over the cache)
    assert alignment.not_aligned and all("[attention_mask]" in name for name, _ in alignment.not_aligned)


def test_a_decode_only_fault_is_named_with_its_module_kind_and_token(runs):
    root, _ = runs
    trainer, faulty = _dumps(root, "faulty")
    result = bisect_dumps(trainer, faulty, tolerance=TOLERANCE, pairing=choose_pairing(trainer, faulty))
    assert any("without a row per token were not compared" in note for note in result.notes)
    found = result.to_json()["first_divergence"]
    assert (found["module"], found["event"]) == (FAULTY, "output")
    assert found["kind"] == result.first_divergence.first.boundary_kind == "linear"
    shortest = min(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    # the first decoded token of the shortest prompt: position len(prompt), the engine's step 1
    assert found["token"] == {"seq_a": len(PROMPTS) - 1 - shortest, "seq_b": shortest,
                              "position": len(PROMPTS[shortest]), "step_a": 0, "step_b": 1}
    report = compare_dumps(trainer, faulty, CompareOptions(tolerance=TOLERANCE), pairing=choose_pairing(trainer, faulty))
    culprit = next(c for c in report.comparisons if c.name == FAULTY and c.record.role == "output")
    assert culprit.tokens.equal == sum(map(len, PROMPTS))        # the prefill's tokens are untouched
    assert culprit.tokens.compared - culprit.tokens.equal == len(PROMPTS) * DECODE_STEPS


def test_op_records_on_pairs_aligned_by_token_stop_bisect_at_the_module_and_say_why(tmp_path):
    model = tiny_qwen2()
    ops = {"ops": f"^{FAULTY}$"}
    rollout = hf_rollout.engine(model, PROMPTS, DECODE_STEPS, tmp_path / "clean", **ops)
    hf_rollout.trainer(model, rollout.sequences, tmp_path / "trainer", **ops)
    handle = hf_rollout.decode_only_fault(model, FAULTY)
    hf_rollout.engine(model, PROMPTS, DECODE_STEPS, tmp_path / "faulty", **ops)
    handle.remove()
    trainer, faulty = open_dump(tmp_path / "trainer"), open_dump(tmp_path / "faulty")
    assert trainer.ops and faulty.ops
    result = bisect_dumps(trainer, faulty, tolerance=TOLERANCE, pairing=choose_pairing(trainer, faulty))
    found = result.first_divergence
    assert (found.module, found.token is not None, found.op) == (FAULTY, True, None)
    assert any("aligned by token" in note and "stops at the module" in note for note in result.notes)


def test_the_fault_hides_nowhere_bitwise_either(runs):
    root, _ = runs
    trainer, faulty = _dumps(root, "faulty")
    report = compare_dumps(trainer, faulty, pairing=choose_pairing(trainer, faulty))
    assert report.status == "diverged"
    assert all(c.tokens is not None for c in report.comparisons if c.a is not None and c.b is not None)


def test_compare_cli_aligns_by_itself_and_align_forces_another_pairing(runs):
    root, _ = runs
    result = tdiff_cli("compare", root / "trainer", root / "engine", "--atol", "1e-5", "--json", expect=0)
    data = json.loads(result.output)
    assert data["alignment"]["by"] == "tokens"
    assert all(t["tokens"]["compared"] > 0 for t in data["tensors"])
    text = tdiff_cli("compare", root / "trainer", root / "engine", "--atol", "1e-5", expect=0).output
    assert "aligned by token" in text and "tokens equal" in text
    by_name = json.loads(tdiff_cli("compare", root / "trainer", root / "engine", "--align", "names", "--json",
                                   expect=1).output)
    assert by_name["summary"]["shape_mismatch"] > 0 and "alignment" not in by_name
    result = tdiff_cli("bisect", root / "trainer", root / "faulty", "--atol", "1e-5", "--json", expect=1)
    assert json.loads(result.output)["first_divergence"]["token"]["step_b"] == 1


def test_tokens_are_refused_for_a_dump_without_token_metadata(runs, tmp_path):
    root, _ = runs
    shutil.copytree(root / "trainer", tmp_path / "plain")
    for manifest in (tmp_path / "plain" / "manifests").glob("*.jsonl"):   # as a version 1 dump has it
        lines = manifest.read_text().splitlines(keepends=True)
        manifest.write_text("".join(line for line in lines if '"type":"tokens"' not in line))
    engine, plain = open_dump(root / "engine"), open_dump(tmp_path / "plain")
    assert not plain.token_batches()
    assert not isinstance(choose_pairing(plain, engine), TokenPairing)
    with pytest.raises(TdiffError, match="no token metadata"):
        choose_pairing(plain, engine, align="tokens").pair(plain, engine)
    result = tdiff_cli("compare", tmp_path / "plain", root / "engine", "--align", "tokens", expect=2)
    assert "no token metadata" in result.output
