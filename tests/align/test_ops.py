"""The alignment steps on real tensors, checked against the layouts the frameworks use."""

import torch

from tdiff.align.ops import GroupedQKV, SeqMajorRows, SortedTopk, TokensFirst, TopkFromRoutingMap
from tests.stacks.convert import grouped_qkv


def test_grouped_qkv_undoes_megatrons_per_group_order():
    heads, groups, dim, hidden = 4, 2, 3, 5
    wq, wk, wv = torch.randn(heads * dim, hidden), torch.randn(groups * dim, hidden), torch.randn(groups * dim, hidden)
    x = torch.randn(7, 2, hidden)                       # [seq, batch, hidden]
    fused = x @ grouped_qkv(wq, wk, wv, heads=heads, groups=groups, head_dim=dim).T
    for part, weight in zip("qkv", (wq, wk, wv)):
        split = GroupedQKV(groups, heads // groups, dim, part).apply(fused)
        assert torch.allclose(split, x @ weight.T, atol=1e-6)


def test_tokens_first_gives_natural_order():
    bsh = torch.arange(2 * 3 * 4).reshape(2, 3, 4)      # [batch, seq, hidden]
    assert TokensFirst("bs").apply(bsh).equal(bsh.reshape(6, 4))
    assert TokensFirst("sb").apply(bsh.transpose(0, 1)).equal(bsh.reshape(6, 4))
    assert TokensFirst("sb").apply(bsh.transpose(0, 1).reshape(3, 2, 2, 2)).equal(bsh.reshape(6, 4))
    seq_major = bsh.transpose(0, 1).reshape(6, 4)        # Megatron's MoE rows
    assert SeqMajorRows(batch=2).apply(seq_major).equal(bsh.reshape(6, 4))


def test_topk_from_a_routing_map_equals_sorted_topk():
    logits = torch.randn(6, 5)
    weights, ids = logits.softmax(-1).topk(2, dim=-1)
    routing_map = torch.zeros(6, 5, dtype=torch.bool).scatter(1, ids, True)
    probs = torch.zeros(6, 5).scatter(1, ids, weights)
    for part in ("ids", "weights"):
        assert TopkFromRoutingMap(part).apply([probs, routing_map]).equal(SortedTopk(part).apply([weights, ids]))
