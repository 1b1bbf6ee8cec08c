"""Megatron with tensor parallelism 2 (two real processes under torchrun, gloo) against the same
weights on one process: shards are concatenated, partial sums added, replicas checked."""

import json
import socket
import sys

import pytest

from tests.helpers import REPO, tdiff_process

pytestmark = pytest.mark.slow

MODELS = ["qwen2", "qwen3_moe"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_dumps(dumps, tmp_path_factory):
    tp2 = tmp_path_factory.mktemp("tensor-parallel") / "tp2"
    captured = tdiff_process("capture", "--out", tp2, "--", sys.executable, "-m", "torch.distributed.run",
                             "--nproc-per-node", "2", "--master-port", free_port(), "-m", "tests.stacks.run_megatron",
                             *[arg for m in MODELS for arg in ("--model", m)], cwd=REPO)
    assert captured.returncode == 0, captured.stderr[-3000:]
    return dumps["tp1:" + "+".join(MODELS)], tp2


def test_tp2_matches_tp1_within_fp32_tolerance(tp_dumps):
    result = tdiff_process("compare", *tp_dumps, "--atol", "1e-5", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0, report["first_divergence"]
    tensors = {(t["name"], t["step"]): t for t in report["tensors"]}
    assert len(tensors) == len(report["tensors"]) > 60
    assert all(t["metrics"]["max_abs"] < 1e-5 for t in tensors.values())
    alignment = report["alignment"]
    assert alignment["a"]["unmatched"] == alignment["b"]["unmatched"] == []
    assert alignment["warnings"] == [], "replicas of every unsplit tensor agree bitwise"
    # MoE experts under TP without sequence parallelism see every rank's copy of the tokens
    assert set(alignment["b"]["not_exposed"]) == {"moe.dispatch", "moe.experts"}

    def plan(name, step=0):
        return tensors[(name, step)]["plan"]["b"]

    assert plan("layers.0.attn.q")[1:3] == [
        "take q from QKV ordered per query group (1 group(s) of 2 q + 1 k + 1 v heads of 16)",
        "concatenate 2 tp shards on dim -1"]
    assert "concatenate 2 tp shards on dim -1" in plan("layers.1.mlp.gate")
    assert "concatenate 2 tp shards on dim -2" in plan("layers.0.attn.q_rope")
    assert "concatenate 2 tp shards on dim -1" in plan("logits")
    assert "2 tp replicas: checked bitwise identical, rank 0's kept" in plan("layers.1.input_norm")
    assert plan("layers.0.attn.out")[0] == "decoder.layers.0.self_attention.linear_proj[0] on ranks 0, 1"
    assert "2 tp replicas: checked bitwise identical, rank 0's kept" in plan("layers.0.moe.topk_ids", step=1)


def test_megatron_ranks_record_their_coordinates_and_shard_specs(tp_dumps):
    from tdiff.store import open_dump

    records = {(r.name, r.role, r.rank): r for r in open_dump(tp_dumps[1]).records if r.step == 0}
    qkv = records[("decoder.layers.0.self_attention.linear_qkv[0]", "output", 1)].attrs
    assert qkv["framework"] == "megatron" and qkv["parallel"]["tp"] == [1, 2]
    assert qkv["shard"] == [{"axis": "tp", "dim": -1}]
    assert records[("decoder.layers.0.self_attention.linear_proj[0]", "input", 0)].attrs["shard"] == \
        [{"axis": "tp", "dim": -1}]
    norm = records[("decoder.layers.0.input_layernorm", "output", 1)].attrs   # a torch.nn.RMSNorm
    assert norm["framework"] == "torch" and norm["parallel"]["tp"] == [1, 2] and "shard" not in norm


def test_tp2_against_hugging_face(tp_dumps, dumps):
    """Two hops at once: another framework and another parallel layout."""
    result = tdiff_process("compare", dumps["hf:qwen2"], tp_dumps[1], "--atol", "1e-5", "--select", "^layers",
                           "--json")
    report = json.loads(result.stdout)
    step0 = [t for t in report["tensors"] if t["step"] == 0]
    assert step0 and all(t["status"] == "match" for t in step0)
