"""Calling conventions under token alignment (issue 27 §7): a model called with keywords on one
side and positionally on the other pairs its arguments by parameter name (bound to the forward's
signature); an input only one side passes (the engine's position_ids and cache, the trainer's
nothing but input_ids) is listed as one-sided, not a divergence; a one-sided output still is."""

import importlib.util
import json
import sys

import pytest
import torch

import tdiff
from tdiff.bisect import bisect_dumps
from tdiff.store import open_dump
from tests.helpers import REPO, tdiff_cli

spec = importlib.util.spec_from_file_location("rollout_run", REPO / "examples" / "rollout" / "run.py")
run = sys.modules["rollout_run"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)


def positional_trainer(model, sequences, dump_dir):
    """The plain forward a user writes first: ``model(ids)``, positionally, no mask or positions
    (the sequences have one length)."""
    with torch.no_grad(), tdiff.capture(dump_dir, model=model):
        ids = torch.tensor(sequences)
        run.dump_logprobs(model(ids).logits.float(), ids)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("conventions")
    model = run.build_model()
    prompts = [[5, 17, 9, 30], [3, 44, 21, 8]]   # one length: the trainer needs no mask
    rollout = run.engine(model, prompts, 3, dump_dir=root / "engine")
    positional_trainer(model, [s[:-1] for s in rollout.sequences], root / "trainer")
    handle = run.decode_only_fault(model, run.FAULTY)
    run.engine(model, prompts, 3, dump_dir=root / "faulty")
    handle.remove()
    return root


def test_a_positional_argument_pairs_with_the_same_keyword_argument(dumps):
    trainer = open_dump(dumps / "trainer")
    (ids,) = [r for r in trainer.records if r.module == "" and r.role == "input"]
    assert ids.sub == "0" and ids.attrs["bound"].endswith("[input_ids]")
    engine = open_dump(dumps / "engine")
    assert any(r.bound_key[0] == ids.bound_key[0] for r in engine.records if r.role == "input")


def test_inputs_one_side_alone_passes_are_listed_not_divergences(dumps):
    report = json.loads(tdiff_cli("compare", dumps / "trainer", dumps / "engine", "--ulp", "16", "--json",
                                  expect=0).output)
    one_sided = {(entry["name"], entry["side"]) for entry in report["alignment"]["one_sided_inputs"]}
    assert any(name.endswith("[position_ids]") and side == "B" for name, side in one_sided), one_sided
    assert all(side == "B" for _, side in one_sided)
    printed = tdiff_cli("compare", dumps / "trainer", dumps / "engine", "--ulp", "16", expect=0).output
    assert "inputs one run alone passes" in " ".join(printed.split())


def test_a_decode_only_fault_is_still_named(dumps):
    result = " ".join(tdiff_cli("bisect", dumps / "trainer", dumps / "faulty", "--ulp", "16", expect=1).output.split())
    assert f"introduced at {run.FAULTY} " in result
    assert "input(s) one run alone passes were not compared (not a divergence by itself)" in result


def test_a_one_sided_output_is_still_a_divergence(dumps, tmp_path):
    model = run.build_model()
    extra = torch.nn.Identity()
    with torch.no_grad(), tdiff.capture(tmp_path / "extra", model=model):
        ids = torch.tensor([[5, 17, 9, 30, 1, 2, 3], [3, 44, 21, 8, 4, 5, 6]])
        logits = model(ids).logits.float()
        tdiff.dump("only_here", extra(logits[:, 0]))
        run.dump_logprobs(logits, ids)
    result = bisect_dumps(dumps / "engine", tmp_path / "extra")
    assert result.status == "diverged"


def test_allow_incomplete_is_honoured_by_bisect_as_by_compare(dumps, tmp_path):
    """An engine dump cut short before its end line (a killed server): with --allow-incomplete both
    commands judge what it holds alike, its one-sided inputs listed and not a divergence."""
    import shutil

    cut = tmp_path / "engine-cut"
    shutil.copytree(dumps / "engine", cut)
    for manifest in (cut / "manifests").glob("*.jsonl"):
        lines = manifest.read_text().splitlines(keepends=True)
        manifest.write_text("".join(lines[:-1]))   # no end line: the part reads as incomplete
    for command in ("compare", "bisect"):
        assert "incomplete" in tdiff_cli(command, dumps / "trainer", cut, "--ulp", "16", expect=2).output
        printed = " ".join(tdiff_cli(command, dumps / "trainer", cut, "--ulp", "16", "--allow-incomplete",
                                     expect=0).output.split())
        assert "one run alone passes" in printed, (command, printed)
