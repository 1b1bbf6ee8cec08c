"""CompareResult: the object of `tdiff compare --json`, read back from its JSON on real dumps."""

import json
import math

import pytest
import torch

import tdiff
from tdiff.align import TokenPairing, choose_pairing
from tdiff.compare import CompareOptions, CompareResult, Tolerance, compare_dumps
from tdiff.errors import TdiffError
from tdiff.store import open_dump
from tests.helpers import tdiff_cli, tiny_qwen2
from tests.stacks.hf_rollout import rollout as hf_rollout


def dump_of(path, **tensors):
    with tdiff.capture(path):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A and B with every verdict: equal, within 0.5, beyond it, NaN and infinities, reshaped,
    retyped, and a tensor each side alone has."""
    root = tmp_path_factory.mktemp("pair")
    x = torch.linspace(-2, 2, 12)
    special = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    a = dump_of(root / "a", same=x, near=x, far=x, special=special, shape=torch.ones(2, 3),
                dtype=torch.ones(4), only_a=torch.zeros(2))
    b = dump_of(root / "b", same=x, near=x + 0.25, far=x * 3, special=special.flip(0), shape=torch.ones(3, 2),
                dtype=torch.ones(4, dtype=torch.float64), only_b=torch.zeros(2))
    return a, b


def round_trips(report) -> CompareResult:
    result = report.result()
    assert CompareResult.from_json(result.to_json()) == result
    assert CompareResult.from_json(json.loads(json.dumps(result.to_json()))) == result
    return result


def test_a_matching_pair_reads_back_as_a_match(pair):
    a, _ = pair
    result = round_trips(compare_dumps(open_dump(a), open_dump(a)))
    assert result.status == "match" and result.same_dump and result.first_divergence is None
    assert result.summary["compared"] == result.summary["match"] == len(open_dump(a).records)


def test_a_diverged_pair_reads_back_with_each_tensors_verdict(pair):
    a, b = pair
    report = compare_dumps(open_dump(a), open_dump(b))
    result = round_trips(report)
    assert result.status == "diverged" and result.summary == report.counts()
    verdicts = {t.name: t for t in result.tensors}
    assert {name: t.status for name, t in verdicts.items()} == {c.name: c.status for c in report.comparisons}
    assert result.first_divergence == report.first_divergence.verdict()
    special = verdicts["special"].metrics
    assert special.nan_mismatch == 2 and special.max_abs == "inf"  # an infinity as JSON writes it
    assert verdicts["shape"].metrics is None and "[2, 3] vs [3, 2]" in verdicts["shape"].reason
    assert verdicts["only_a"].module_b is None and verdicts["only_b"].shape_a is None


def test_a_tolerance_run_reads_back_with_its_tolerance(pair):
    a, b = pair
    report = compare_dumps(open_dump(a), open_dump(b), CompareOptions(tolerance=Tolerance(atol=0.5)))
    result = round_trips(report)
    assert result.tolerance == Tolerance(atol=0.5).describe()
    verdicts = {t.name: t for t in result.tensors}
    assert verdicts["near"].status == "match" and verdicts["near"].metrics.outside_tolerance == 0
    assert verdicts["far"].status == "mismatch" and verdicts["far"].metrics.outside_tolerance > 0


def test_a_stats_mode_pair_reads_back_with_its_reasons(tmp_path):
    with tdiff.capture(tmp_path / "a", mode="stats"):
        tdiff.dump("x", torch.arange(4.0))
    with tdiff.capture(tmp_path / "b", mode="stats"):
        tdiff.dump("x", torch.arange(4.0) + 1)
    result = round_trips(compare_dumps(open_dump(tmp_path / "a"), open_dump(tmp_path / "b")))
    assert result.tensors[0].reason.startswith("fingerprints differ") and result.tensors[0].metrics is None


def test_a_token_aligned_pair_reads_back_with_its_tokens_plans_and_alignment(tmp_path):
    model = tiny_qwen2()
    rollout = hf_rollout.engine(model, hf_rollout.PROMPTS, hf_rollout.DECODE_STEPS, tmp_path / "engine")
    hf_rollout.trainer(model, rollout.sequences[::-1], tmp_path / "trainer")
    trainer, engine = open_dump(tmp_path / "trainer"), open_dump(tmp_path / "engine")
    pairing = choose_pairing(trainer, engine)
    assert isinstance(pairing, TokenPairing)
    report = compare_dumps(trainer, engine, CompareOptions(tolerance=Tolerance(atol=1e-5)), pairing=pairing)
    result = round_trips(report)
    assert result.alignment == report.alignment.to_json() and result.alignment["by"] == "tokens"
    by_tokens = [(t, c) for t, c in zip(result.tensors, report.comparisons) if c.tokens is not None]
    assert by_tokens and all(t.tokens == c.tokens and (t.plan_a, t.plan_b) == (c.plan_a, c.plan_b)
                             for t, c in by_tokens)


@pytest.mark.parametrize("options", [[], ["--atol", "0.5"], ["--select", "near|far"]])
def test_the_cli_prints_the_results_json_and_it_reads_back_to_the_same_text(pair, options):
    a, b = pair
    printed = tdiff_cli("compare", a, b, "--json", *options, expect=1).output
    result = CompareResult.from_json(json.loads(printed))
    assert json.dumps(result.to_json(), indent=1) + "\n" == printed
    tolerance = Tolerance(atol=0.5) if "--atol" in options else Tolerance()
    report = compare_dumps(open_dump(a), open_dump(b), CompareOptions(tolerance=tolerance,
                                                                     select=["near|far"] if "--select" in options else []))
    assert result == CompareResult.from_json(json.loads(json.dumps(report.to_json())))


def _broken(data: dict, change) -> dict:
    broken = json.loads(json.dumps(data))
    change(broken)
    return broken


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("tensors"), "not the JSON of `tdiff compare --json`"),
    (lambda d: d["tensors"][0].pop("kind"), "not the JSON of `tdiff compare --json`"),
    (lambda d: d["tensors"][0].update(status="close enough"), "unknown status 'close enough'"),
    (lambda d: d["tensors"][0]["metrics"].pop("cosine"), "not the JSON of `tdiff compare --json`"),
    (lambda d: d.update(a="runs/a"), "not the JSON of `tdiff compare --json`"),
    (lambda d: d.update(status="match"), "disagrees with its own tensors on status"),
    (lambda d: d["summary"].update(mismatch=0), "disagrees with its own tensors on summary"),
])
def test_bad_json_is_refused_in_one_line(pair, change, message):
    a, b = pair
    data = compare_dumps(open_dump(a), open_dump(b)).to_json()
    assert data["tensors"][0]["metrics"] is not None
    with pytest.raises(TdiffError) as error:
        CompareResult.from_json(_broken(data, change))
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("data", [[], "diverged", None])
def test_json_that_is_not_an_object_is_refused(data):
    with pytest.raises(TdiffError, match="not the JSON of `tdiff compare --json`"):
        CompareResult.from_json(data)
