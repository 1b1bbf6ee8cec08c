"""A model no adapter knows, aligned through a user's YAML mapping file."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tdiff
from tests.align.conftest import batch_ids, by_name
from tests.helpers import tdiff_cli, tiny_qwen2


class Block(nn.Module):
    def __init__(self, hidden=64, heads=4, groups=2, ffn=128):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.norm1 = nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, (heads + 2 * groups) * self.head_dim)       # fused q|k|v
        self.attn_out = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)                   # fused gate|up
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * self.head_dim, self.groups * self.head_dim,
                                                 self.groups * self.head_dim], -1)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.attn_out(attention.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


def rotate_half(t):
    first, second = t.chunk(2, -1)
    return torch.cat([-second, first], -1)


class TinyDecoder(nn.Module):
    """A user's own Qwen2-shaped model: other names, fused projections, [batch, seq, hidden]."""

    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(128, 64)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.RMSNorm(64, eps=1e-6)
        self.head = nn.Linear(64, 128, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        angles = torch.outer(torch.arange(ids.shape[1]).float(), inv_freq)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def load_qwen2(self, hf):
        sd = hf.state_dict()
        with torch.no_grad():
            self.embed.weight.copy_(sd["model.embed_tokens.weight"])
            self.norm.weight.copy_(sd["model.norm.weight"])
            self.head.weight.copy_(sd["lm_head.weight"])
            for n, block in enumerate(self.blocks):
                p = f"model.layers.{n}."
                block.norm1.weight.copy_(sd[p + "input_layernorm.weight"])
                block.norm2.weight.copy_(sd[p + "post_attention_layernorm.weight"])
                for part in ("weight", "bias"):
                    getattr(block.qkv, part).copy_(torch.cat([sd[f"{p}self_attn.{x}_proj.{part}"] for x in "qkv"]))
                block.attn_out.weight.copy_(sd[p + "self_attn.o_proj.weight"])
                block.gate_up.weight.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
                block.down.weight.copy_(sd[p + "mlp.down_proj.weight"])
        return self


MAPPING = r"""
label: tiny-decoder
layout: bs
rules:
  - {module: embed, role: input, sub: "0", boundary: input_ids}
  - {module: embed, boundary: embedding}
  - {module: 'blocks\.(?P<layer>\d+)\.norm1', boundary: input_norm}
  - {module: 'blocks\.(?P<layer>\d+)\.qkv', boundary: attn.q, slice: [0, 64]}
  - {module: 'blocks\.(?P<layer>\d+)\.qkv', boundary: attn.k, slice: [64, 32]}
  - {module: 'blocks\.(?P<layer>\d+)\.qkv', boundary: attn.v, slice: [96, 32]}
  - {module: 'blocks\.(?P<layer>\d+)\.attn_out', role: input, sub: "0", boundary: attn.core}
  - {module: 'blocks\.(?P<layer>\d+)\.attn_out', boundary: attn.out}
  - {module: 'blocks\.(?P<layer>\d+)\.norm2', role: input, sub: "0", boundary: attn.residual}
  - {module: 'blocks\.(?P<layer>\d+)\.norm2', boundary: pre_mlp_norm}
  - {module: 'blocks\.(?P<layer>\d+)\.gate_up', boundary: mlp.gate, slice: [0, 128]}
  - {module: 'blocks\.(?P<layer>\d+)\.gate_up', boundary: mlp.up, slice: [128, 128]}
  - {module: 'blocks\.(?P<layer>\d+)\.down', role: input, sub: "0", boundary: mlp.act}
  - {module: 'blocks\.(?P<layer>\d+)\.down', boundary: mlp.down}
  - {module: 'blocks\.(?P<layer>\d+)', boundary: output}
  - {module: norm, boundary: final_norm}
  - {module: head, boundary: logits}
not_exposed:
  positions: computed inside forward
  attn.q_rope: applied inline
  attn.k_rope: applied inline
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mapping")
    hf = tiny_qwen2()
    user = TinyDecoder().load_qwen2(hf).eval()
    with tdiff.capture(root / "hf", model=hf), torch.no_grad():
        hf(batch_ids())
    with tdiff.capture(root / "user", model=user), torch.no_grad():
        user(batch_ids())
    (root / "map.yaml").write_text(MAPPING)
    return root


def test_a_mapping_file_aligns_a_model_no_adapter_knows(pair):
    result = tdiff_cli("compare", pair / "hf", pair / "user", "--mapping", pair / "map.yaml", "--atol", "1e-5",
                       "--json", expect=0)
    report = json.loads(result.output)
    tensors = by_name(report)
    assert len(tensors) == 4 + 2 * 13 and all(t["status"] == "match" for t in tensors.values())
    assert tensors["layers.1.attn.k"]["plan"]["b"] == ["blocks.1.qkv", "take attn.k: last dim [64:96]",
                                                        "[batch, seq, ...] -> [tokens, features]"]
    alignment = report["alignment"]
    assert alignment["b"]["adapter"] == "tiny-decoder"
    assert alignment["b"]["not_exposed"]["positions"] == {"reason": "computed inside forward", "skipped": 1}
    assert "blocks.N[1] (x2)" in alignment["b"]["unmapped"]     # cos/sin inputs: listed, not dropped


def test_without_a_mapping_the_unknown_model_is_refused(pair):
    result = tdiff_cli("compare", pair / "hf", pair / "user", expect=2)
    assert "no adapter knows this model (classes from package 'tests'); write a mapping file" in result.output


@pytest.mark.parametrize("text, line, message", [
    ("rules: [", 1, "not valid YAML"),
    ("label: x\nrules: []", 2, "the file: 'rules' must be a non-empty list"),
    ("rules:\n  - {module: 'x(', boundary: embedding}", 2, "rule 1: 'x(' is not a valid regular expression"),
    ("rules:\n  - {module: 'blocks\\.0\\.qkv', boundary: attn.q}", 2, "rule 1: 'attn.q' is a per-layer boundary"),
    ("rules:\n  - {module: x, boundary: embedding, layout: sbh}", 2, "rule 1: layout must be one of bs, sb, t"),
    ("rules:\n  - {module: x, boundary: embedding, shard: [{axis: cp, dim: 0}]}", 2, "rule 1: shard must be a list"),
    ("side: c\nrules:\n  - {module: x, boundary: embedding}", 1, "side must be one of a, b, both, not 'c'"),
    ("rules:\n  - module: x\n    boundary: embedding\n  - module: y\n\n    colour: red\n    boundary: logits",
     6, "rule 2: unknown key 'colour'"),
    ("rules:\n  - {module: x, boundary: embedding}\n  - {module: y, boundary: embedding, role: inputs}", 3,
     "rule 2: role must be one of input, output, not 'inputs'"),
    ("rules:\n  - {module: x, boundary: embedding}\nrules: []", 3, "duplicate key 'rules' (first on line 1)"),
    ("rules:\n  - explicit: x\n    boundary: logits\nnot_exposed: [a]", 4, "not_exposed must map boundary names"),
])
def test_mapping_mistakes_exit_2_naming_the_line_and_rule(pair, tmp_path, text, line, message):
    (tmp_path / "bad.yaml").write_text(text)
    result = tdiff_cli("compare", pair / "hf", pair / "user", "--mapping", tmp_path / "bad.yaml", expect=2)
    assert f"bad.yaml line {line}: " in result.output and message in result.output, result.output
    assert "Traceback" not in result.output


def test_a_mapping_for_two_known_frameworks_must_name_its_side(pair, dumps, tmp_path):
    (tmp_path / "map.yaml").write_text("rules:\n  - {module: x, boundary: embedding}\n")
    result = tdiff_cli("compare", pair / "hf", dumps["megatron:qwen2"], "--mapping", tmp_path / "map.yaml", expect=2)
    assert "say which side the file maps with `side: a` or `side: b`" in result.output


def test_a_mapping_that_matches_nothing_says_so(pair, tmp_path):
    (tmp_path / "map.yaml").write_text("rules:\n  - {module: 'nothing\\.like\\.this', boundary: embedding}\n")
    result = tdiff_cli("compare", pair / "hf", pair / "user", "--mapping", tmp_path / "map.yaml", expect=2)
    assert "the mapping map.yaml adapter found no canonical boundary in it" in result.output


def test_report_measures_an_aligned_culprits_error_per_token(pair, tmp_path):
    """The culprit is reloaded through the pairing compare used: the canonical one (its name is no
    record's name)."""
    user = TinyDecoder().load_qwen2(tiny_qwen2()).eval()
    with torch.no_grad():
        user.blocks[1].down.weight[0, 0] += 0.5
    with tdiff.capture(tmp_path / "planted", model=user), torch.no_grad():
        user(batch_ids())
    tdiff_cli("report", pair / "hf", tmp_path / "planted", "--mapping", pair / "map.yaml", "--atol", "1e-5",
              "--format", "json", "-o", tmp_path / "r.json", expect=1)
    culprit = json.loads((tmp_path / "r.json").read_text())["culprit"]
    assert culprit["tensor"]["name"] == "layers.1.mlp.down"
    assert culprit["tokens_note"] is None and max(culprit["tokens"]["max_abs"]) > 1e-5
