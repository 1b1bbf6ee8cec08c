"""Token metadata of CUDA graph replays: a replay runs no module call, so the tokens given before
it (by the engine, or tdiff.tokens) describe the replay's step. Skipped without CUDA; run on the
GPU machine with `python -m pytest tests/hooks/test_replay_tokens.py`."""

import pytest
import torch

import tdiff
from tdiff.store import open_dump
from tests.hooks.test_cuda_graphs import Tiny, batches

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_tokens_given_before_each_replay_describe_that_replay(tmp_path):
    model, inputs = Tiny().cuda(), batches(rows=3)
    static_x = torch.zeros(8, inputs[0].shape[1], device="cuda")   # captured for 8 rows, 3 real
    fed = [torch.tensor([10 + step, 20 + step, 30 + step]) for step in range(len(inputs))]
    with torch.no_grad(), tdiff.capture(tmp_path / "d"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), tdiff.warmup():
            model(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(static_x)
        for step, (x, ids) in enumerate(zip(inputs, fed)):
            static_x[:3].copy_(x)
            # three requests decoding, each at its own position
            tdiff.tokens(input_ids=ids, positions=torch.tensor([4, 7, 9]) + step, seq_lens=[1, 1, 1],
                         seq_ids=["r0", "r1", "r2"])
            tdiff.graph_rows(3)
            graph.replay()
        model(inputs[0])   # an eager forward after the replays: no tokens left over for it
        torch.cuda.synchronize()
    dump = open_dump(tmp_path / "d")
    tokens = dump.token_batches()
    assert sorted(tokens) == [(step, 0) for step in range(len(inputs))]
    for step, ids in enumerate(fed):
        assert tokens[(step, 0)].input_ids == ids.tolist()
        assert tokens[(step, 0)].positions == [4 + step, 7 + step, 9 + step]
        assert tokens[(step, 0)].seq_ids == ["r0", "r1", "r2"]
    assert {r.step for r in dump.records} == set(range(len(inputs) + 1))
    assert all(r.shape[0] == 3 for r in dump.records if r.step < len(inputs) and r.name == "head")
