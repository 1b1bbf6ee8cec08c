"""The catalogue: every entry applies to the installed packages and changes exactly the numerics
it claims, on tiny real transformers models (random weights, bf16)."""

import torch
import pytest

import tdiff
from tdiff.source_patcher import apply_patches
from tdiff.source_patcher.catalogue import (builtin, candidates_from, catalogue, entries_for_kind, ordered_for_cause,
                                            patches_from)
from tdiff.source_patcher.check import OK, check_patches
from tdiff.source_patcher.fixes.reduction import fixed_order_sum
from tdiff.store import open_dump
from tdiff.vocab.kinds import KINDS
from tests.helpers import tdiff_cli
from tests.source_patcher import planted
from tests.source_patcher.numerics import introducers


def test_every_entry_says_which_kinds_it_addresses_and_the_lookup_by_kind_finds_it():
    entries = catalogue()
    assert {e.name for e in entries} >= {"rmsnorm-fp32", "rope-fp32", "logsoftmax-fp32", "residual-fp32",
                                         "moe-combine-fp32", "batch-invariant-matmul", "batch-invariant-mean",
                                         "batch-invariant-log-softmax", "batch-invariant"}
    for entry in entries:
        assert entry.kinds and set(entry.kinds) <= set(KINDS) and entry.summary
    assert [e.name for e in entries_for_kind("norm")] == ["rmsnorm-fp32", "batch-invariant-mean", "batch-invariant"]
    assert [e.name for e in entries_for_kind("rope")] == ["rope-fp32"]
    assert [e.name for e in entries_for_kind("embedding")] == []
    assert [c.name for c in candidates_from("builtin:rope-fp32,logsoftmax-fp32")] == ["rope-fp32", "logsoftmax-fp32"]
    with pytest.raises(tdiff.TdiffError, match="no catalogue entry named 'nope'"):
        builtin(["nope"])


@pytest.mark.parametrize("cause, order", [
    ("rounding", ["batch-invariant-mean", "batch-invariant", "rmsnorm-fp32"]),
    ("precision", ["rmsnorm-fp32", "batch-invariant-mean", "batch-invariant"]),
    ("logic", ["rmsnorm-fp32", "batch-invariant-mean", "batch-invariant"]),
    (None, ["rmsnorm-fp32", "batch-invariant-mean", "batch-invariant"]),
])
def test_the_cause_class_orders_the_fixes_to_try(cause, order):
    assert [e.name for e in ordered_for_cause(entries_for_kind("norm"), cause)] == order


def test_the_whole_catalogue_applies_to_the_installed_versions():
    results = check_patches(patches_from("builtin"))
    assert [(r.patch.name, r.status, r.reason) for r in results if r.status != OK] == []
    targets = {r.patch.target.split(".")[0] for r in results}
    assert {"transformers", "sglang", "megatron", "torch"} <= targets
    result = tdiff_cli("patch", "check", "--config", "builtin", expect=0)
    assert "stale" not in result.output


def run(tmp_path, name, model, fault, patches=(), experts=None):
    network = planted.build(model, torch.bfloat16, fault, experts)
    with apply_patches(patches), tdiff.capture(tmp_path / name, side=name):
        planted.score(network, batch=1, tokens=10, fault=fault)
    return open_dump(tmp_path / name)


@pytest.mark.parametrize("entry, model, fault, classes", [
    ("rmsnorm-fp32", "qwen2", "none", {"Qwen2RMSNorm"}),
    ("rmsnorm-fp32", "llama", "none", {"LlamaRMSNorm"}),
    ("rmsnorm-fp32", "qwen3_moe", "none", {"Qwen3MoeRMSNorm"}),
    ("residual-fp32", "qwen2", "none", {"Qwen2DecoderLayer"}),
    ("residual-fp32", "llama", "none", {"LlamaDecoderLayer"}),
    ("residual-fp32", "qwen3_moe", "none", {"Qwen3MoeDecoderLayer"}),
    ("moe-combine-fp32", "qwen3_moe", "none", {"Qwen3MoeExperts"}),
    ("moe-combine-fp32", "qwen3_moe:eager", "none", {"Qwen3MoeExperts"}),
    ("moe-combine-fp32", "qwen3_moe:batched_mm", "none", {"Qwen3MoeExperts"}),
    ("rope-fp32", "qwen2", "rope-bf16", {"Qwen2RotaryEmbedding"}),
    ("rope-fp32", "llama", "rope-bf16", {"LlamaRotaryEmbedding"}),
    ("rope-fp32", "qwen3_moe", "rope-bf16", {"Qwen3MoeRotaryEmbedding"}),
    ("logsoftmax-fp32", "qwen2", "logsoftmax-bf16", {"explicit:logprobs"}),
])
def test_each_entry_changes_exactly_the_numerics_it_claims(tmp_path, entry, model, fault, classes):
    model, _, experts = model.partition(":")
    stock = run(tmp_path, "stock", model, fault, experts=experts or None)
    patched = run(tmp_path, "patched", model, fault, builtin([entry])[0].patches, experts=experts or None)
    assert introducers(stock, patched) == classes


@pytest.mark.parametrize("entry, fault", [("rope-fp32", "none"), ("logsoftmax-fp32", "none")])
def test_an_entry_changes_nothing_where_the_numerics_already_hold(tmp_path, entry, fault):
    stock = run(tmp_path, "stock", "qwen2", fault)
    patched = run(tmp_path, "patched", "qwen2", fault, builtin([entry])[0].patches)
    assert introducers(stock, patched) == set()


def test_the_fixed_order_sum_is_a_pairwise_tree_and_row_independent():
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0, 3.0]], dtype=torch.float32)
    # ((x0 + x4) + (x2 + 0)) + ((x1 + 0) + (x3 + 0)), each add rounded to fp32
    expected = ((x[0, 0] + x[0, 4]) + x[0, 2]) + (x[0, 1] + x[0, 3])
    assert torch.equal(fixed_order_sum(x), expected.reshape(1))
    rows = torch.randn(64, 4097)
    assert torch.equal(fixed_order_sum(rows)[7:8], fixed_order_sum(rows[7:8]))
