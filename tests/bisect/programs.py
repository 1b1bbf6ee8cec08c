"""Small programs that tests run under `tdiff capture` / `tdiff bisect` as real subprocesses.

    python -m tests.bisect.programs repeat COUNTER --nondeterministic-run K
    python -m tests.bisect.programs amplify [--split-k]
    python -m tests.bisect.programs zoom CASE [--planted]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from pathlib import Path

import torch

import tdiff
from tests.bisect import planted
from tests.helpers import tiny_qwen2, token_ids


def repeat(counter: Path, nondeterministic_run: int) -> None:
    """A tiny Qwen2 scoring one sequence; run number K (counted in COUNTER) reduces
    model.layers.0.mlp.down_proj in another order, like a nondeterministic kernel would."""
    run = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(run))
    model = tiny_qwen2()
    if run == nondeterministic_run:
        planted.split_k_linear(model.model.layers[0].mlp.down_proj)
    with torch.no_grad():
        logits = model(token_ids()).logits
    tdiff.dump("logprobs", torch.log_softmax(logits, -1))


class Amplify(torch.nn.Module):
    def forward(self, x):
        return x * 1e4


def amplify(split_k: bool) -> None:
    """proj -> amplify (x 1e4) -> head. With --split-k, proj reduces in another order: a difference
    far below 1e-5 that ``amplify`` scales past it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(proj=torch.nn.Linear(64, 64), amplify=Amplify(),
                                            head=torch.nn.Linear(64, 4)))
    if split_k:
        planted.split_k_linear(model.proj)
    with torch.no_grad():
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)))


def zoom(case: str, planted_: bool) -> None:
    """A real model with a change planted inside a module's own code (tests.bisect.planted):
    ``rope`` (HF apply_rotary_pos_emb), ``softmax`` (HF eager attention), ``residual`` (a Qwen2
    decoder layer's forward), ``moe`` (HF MoE experts' index_add_), ``bda`` (Megatron's
    bias-dropout-add)."""
    if case == "bda":
        from megatron.core.fusions import fused_bias_dropout

        from tests.stacks import megatron

        megatron.init_megatron()
        if planted_:
            fused_bias_dropout._bias_dropout_add_func = planted.bf16_bias_dropout_add
        megatron.gpt_forward(megatron.build_gpt(megatron.gpt_config(layers=2)), token_ids(tokens=8))
        return
    from transformers.models.qwen2 import modeling_qwen2

    model = tiny_moe() if case == "moe" else tiny_qwen2()
    model.config._attn_implementation = "eager"
    if planted_:
        if case == "rope":
            modeling_qwen2.apply_rotary_pos_emb = planted.bf16_apply_rotary_pos_emb
        elif case == "softmax":
            modeling_qwen2.eager_attention_forward = planted.bf16_softmax_eager_attention
        elif case == "residual":
            planted.bf16_residual(model.model.layers[1])
        else:
            planted.reversed_index_add_combine(model.model.layers[1].mlp.experts)
    with torch.no_grad():
        model(token_ids())


def tiny_moe():
    """A tiny HF Qwen2-MoE whose experts loop with index_add_, three experts per token (so that
    the order of their sum can matter)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=3,
                            moe_intermediate_size=32, shared_expert_intermediate_size=64,
                            max_position_embeddings=64)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="program", required=True)
    rep = sub.add_parser("repeat")
    rep.add_argument("counter", type=Path)
    rep.add_argument("--nondeterministic-run", type=int, default=0)
    amp = sub.add_parser("amplify")
    amp.add_argument("--split-k", action="store_true")
    zoo = sub.add_parser("zoom")
    zoo.add_argument("case", choices=["rope", "softmax", "residual", "moe", "bda"])
    zoo.add_argument("--planted", action="store_true")
    args = parser.parse_args()
    if args.program == "repeat":
        repeat(args.counter, args.nondeterministic_run)
    elif args.program == "amplify":
        amplify(args.split_k)
    else:
        zoom(args.case, args.planted)


if __name__ == "__main__":
    main()
