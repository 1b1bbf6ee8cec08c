"""Megatron MoE with expert parallelism 2 (two real processes under torchrun, gloo; the dense
layers tensor-parallel with sequence parallelism, experts whole per rank) against the same
weights on one process: the routed tokens of both ranks reassemble into one dispatch, and the
router's per-token outputs are split over the sequence, not replicas.

The same runs on one GPU: examples/gpu/parallel.py (docs/GPU.md)."""

import json
import sys

from tests.helpers import REPO, tdiff_process
from tests.stacks import free_port

import pytest

pytestmark = pytest.mark.slow


def capture(out, ranks: int):
    worker = [REPO / "examples/gpu/parallel.py", "--worker", "--axis", "ep", "--model", "qwen3_moe",
              "--backend", "gloo", "--device", "cpu", "--tokens", "8"]
    done = tdiff_process("capture", "--quiet", "--out", out, "--", sys.executable, "-m", "torch.distributed.run",
                         "--nproc-per-node", ranks, "--master-port", free_port(), *worker, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_ep2_matches_ep1_with_dispatch_and_combine_reassembled(tmp_path):
    ep1, ep2 = capture(tmp_path / "ep1", 1), capture(tmp_path / "ep2", 2)
    result = tdiff_process("compare", ep1, ep2, "--atol", "1e-5", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0, report["first_divergence"]
    alignment = report["alignment"]
    assert alignment["warnings"] == [], "no per-token tensor is taken for a replica"
    assert alignment["a"]["unmatched"] == alignment["b"]["unmatched"] == []
    tensors = {t["name"]: t for t in report["tensors"]}
    assert all(t["metrics"]["max_abs"] < 1e-5 for t in tensors.values())
    for layer in (0, 1):
        plan = {part: tensors[f"layers.{layer}.moe.{part}"]["plan"]["b"]
                for part in ("topk_ids", "topk_weights", "dispatch", "experts", "combine")}
        assert "concatenate 2 ep shards on dim 0" in plan["dispatch"]
        assert "concatenate 2 ep shards on dim 0" in plan["experts"]
        assert "concatenate 2 tp shards on dim 0" in plan["combine"]
        assert "concatenate 2 tp shards on dim 0" in plan["topk_ids"]
        assert "concatenate 2 tp shards on dim 0" in plan["topk_weights"]
