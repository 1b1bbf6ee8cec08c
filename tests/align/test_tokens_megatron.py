"""Token alignment across frameworks: a Hugging Face engine (prefill + decode with a KV cache)
against its megatron-core twin's one padded forward over the finished sequences, paired by
canonical boundary and then by token."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, tdiff_cli
from tests.stacks.rollout_megatron import DECODE_STEPS, PROMPTS

pytestmark = pytest.mark.slow
FAULTY = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-megatron")
    for name, extra in (("clean", []), ("faulty", ["--fault", FAULTY])):
        done = subprocess.run([sys.executable, "-m", "tests.stacks.rollout_megatron", str(root / name), *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
    return root


def test_engine_decode_steps_match_the_megatron_trainer_boundary_by_boundary_and_token_by_token(runs):
    result = tdiff_cli("compare", runs / "clean" / "engine", runs / "clean" / "trainer", "--atol", "1e-5", "--json")
    report = json.loads(result.output)
    assert result.exit_code == 0, report["first_divergence"]
    alignment = report["alignment"]
    assert alignment["by"] == "tokens"
    assert alignment["boundaries"]["a"]["adapter"] == "Hugging Face transformers"
    assert alignment["boundaries"]["b"]["adapter"] == "Megatron-core"
    assert {(s["a"], s["b"]) for s in alignment["sequences"]} == {(0, 0), (1, 1)}
    assert all(s["only_b"] == [len(PROMPTS[s["a"]]) + DECODE_STEPS] for s in alignment["sequences"])
    fed = sum(len(p) + DECODE_STEPS for p in PROMPTS)
    down = next(t for t in report["tensors"] if t["name"] == "layers.1.mlp.down")
    assert down["tokens"]["compared"] == down["tokens"]["equal"] == fed


def test_a_decode_only_fault_is_named_at_its_canonical_boundary_and_token(runs):
    result = tdiff_cli("bisect", runs / "faulty" / "engine", runs / "faulty" / "trainer", "--atol", "1e-5", "--json")
    assert result.exit_code == 1, result.output[-2000:]
    found = json.loads(result.output)["first_divergence"]
    assert (found["name"], found["kind"]) == ("layers.1.mlp.down", "linear")
    shortest = min(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    assert found["token"] == {"seq_a": shortest, "seq_b": shortest, "position": len(PROMPTS[shortest]),
                              "step_a": 1, "step_b": 0}
