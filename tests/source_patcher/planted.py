"""Tiny transformers models (random weights, small configs) scoring token sequences, with planted
numerical faults for `tdiff patch try` tests.

    python planted.py --model qwen2                      # the reference run
    python planted.py --model qwen2 --fault rope-bf16    # the same run with one planted fault
    python planted.py --model qwen2 --batch 4            # the first sequence scored inside a batch

Faults:
  logsoftmax-bf16  log-probs computed from the bf16 logits in bf16 (the reference upcasts first)
  rope-bf16        RoPE's inverse frequencies left rounded to bf16 by model.to(bf16) (the
                   reference restores them in fp32)
The per-token log-probs of the first sequence are dumped as "logprobs".
"""

from __future__ import annotations

import argparse

import torch

import tdiff

FAULTS = ("none", "logsoftmax-bf16", "rope-bf16")


def build(model: str, dtype: torch.dtype, fault: str, experts: str | None = None):
    import transformers

    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if model == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                             num_experts_per_tok=3, head_dim=8, norm_topk_prob=True, **common)
        cls = transformers.Qwen3MoeForCausalLM
        if experts:
            config._experts_implementation = experts     # eager, grouped_mm (the CPU default), batched_mm
    elif model == "llama":
        config, cls = transformers.LlamaConfig(intermediate_size=64, **common), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen2Config(intermediate_size=64, **common), transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    network = cls(config)
    for name, parameter in network.named_parameters():
        if name.endswith("norm.weight"):     # norms start at ones; random weights show their rounding
            parameter.data = 1 + 0.1 * torch.randn_like(parameter)
    network = network.to(dtype).eval()
    if fault != "rope-bf16":
        rotary = network.model.rotary_emb
        rotary.inv_freq = rotary.compute_default_rope_parameters(config)[0]   # keep RoPE's table fp32
    return network


def score(network, batch: int, tokens: int, fault: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, network.config.vocab_size, (batch, tokens), generator=generator)
    with torch.no_grad():
        logits = network(input_ids).logits[:1, :-1]
    if fault != "logsoftmax-bf16":
        logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:1, 1:, None]).squeeze(-1)
    return tdiff.dump("logprobs", logprobs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("qwen2", "llama", "qwen3_moe"), default="qwen2")
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=12)
    args = parser.parse_args(argv)
    network = build(args.model, getattr(torch, args.dtype), args.fault)
    logprobs = score(network, args.batch, args.tokens, args.fault)
    print(f"{args.model} {args.fault}: mean token log-prob {logprobs.float().mean().item():.6f}")


if __name__ == "__main__":
    main()
