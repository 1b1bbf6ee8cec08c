"""Reassembling shards: plans from coordinates and specs, execution on tensors."""

import pytest
import torch

from tdiff.align.unshard import UnshardError, execute_unshard, plan_unshard


def shards_of(full: torch.Tensor, dim: int, size: int, axis: str = "tp"):
    return [({axis: (rank, size)}, part) for rank, part in enumerate(full.chunk(size, dim))]


def run(shards, spec, warnings=None):
    steps = plan_unshard([c for c, _ in shards], spec)
    return steps, execute_unshard(steps, shards, (warnings if warnings is not None else []).append)


def test_split_dims_concatenate_in_rank_order():
    full = torch.arange(48.0).reshape(4, 3, 4)
    for dim in (0, -1):     # sequence parallel splits dim 0, column-parallel outputs the last
        steps, out = run(shards_of(full, dim, 2), [{"axis": "tp", "dim": dim}])
        assert [s.describe() for s in steps] == [f"concatenate 2 tp shards on dim {dim}"]
        assert out.equal(full)


def test_partial_sums_are_added():
    parts = [torch.ones(3), torch.full((3,), 2.0)]
    steps, out = run([({"tp": (r, 2)}, t) for r, t in enumerate(parts)], [{"axis": "tp", "reduce": "sum"}])
    assert steps[0].describe() == "sum 2 tp partial sums" and out.equal(torch.full((3,), 3.0))


def test_replicas_are_checked_bitwise_and_differences_reported():
    same = [({"tp": (r, 2)}, torch.ones(4)) for r in range(2)]
    warnings = []
    steps, out = run(same, [], warnings)
    assert steps[0].describe() == "2 tp replicas: checked bitwise identical, rank 0's kept"
    assert out.equal(torch.ones(4)) and warnings == []
    differ = [({"tp": (0, 2)}, torch.ones(4)), ({"tp": (1, 2)}, torch.tensor([1.0, 1.0, 1.0, 1.0 + 2 ** -23]))]
    run(differ, [], warnings)
    assert warnings == ["tp replicas differ: rank 1 differs from rank 0 in 1 of 16 bytes"]


def test_two_axes_unshard_innermost_first():
    full = torch.arange(32.0).reshape(4, 8)
    shards = []
    for ep, rows in enumerate(full.chunk(2, 0)):
        for tp, part in enumerate(rows.chunk(2, 1)):
            shards.append(({"ep": (ep, 2), "tp": (tp, 2)}, part))
    steps, out = run(shards, [{"axis": "ep", "dim": 0}, {"axis": "tp", "dim": 1}])
    assert [s.axis for s in steps] == ["tp", "ep"] and out.equal(full)


def test_axes_that_move_together_are_undone_once():
    """Megatron's expert tensor parallelism follows tensor parallelism by default."""
    full = torch.arange(8.0)
    shards = [({"tp": (r, 2), "etp": (r, 2)}, part) for r, part in enumerate(full.chunk(2))]
    steps, out = run(shards, [{"axis": "tp", "dim": 0}])
    assert [s.describe() for s in steps] == ["concatenate 2 tp shards on dim 0"] and out.equal(full)


def test_missing_or_repeated_ranks_are_refused():
    with pytest.raises(UnshardError, match=r"expected 2 shard\(s\) over tp=2, found \(tp 0\)"):
        plan_unshard([{"tp": (0, 2)}], [{"axis": "tp", "dim": -1}])
    with pytest.raises(UnshardError, match="expected 2 shard"):
        plan_unshard([{"tp": (0, 2)}, {"tp": (0, 2)}], [])
    with pytest.raises(UnshardError, match="disagree on the tp size"):
        plan_unshard([{"tp": (0, 2)}, {"tp": (1, 4)}], [])
