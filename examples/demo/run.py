"""The bundled example: a tiny Qwen2-shaped model (random weights, bf16) scoring one sequence.

    python examples/demo/run.py             # the reference run
    python examples/demo/run.py --planted   # the same run with one planted divergence

The planted divergence is a classic one: layer 1's post-attention RMSNorm computes its variance
in bf16 instead of fp32 (see ``bf16_rmsnorm_forward``). Everything else is identical, so
`tdiff bisect` should name `model.layers.1.post_attention_layernorm` (kind: norm).

Under `tdiff capture -- python examples/demo/run.py` every module's inputs and outputs are
recorded; the explicit `tdiff.dump("logprobs", ...)` adds the per-token log-probabilities.
"""

from __future__ import annotations

import argparse
import types

import torch

import tdiff

PLANTED_MODULE = "model.layers.1.post_attention_layernorm"


def build_model(layers: int = 4, dtype=torch.bfloat16):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype).eval()


def bf16_rmsnorm_forward(self, hidden_states):
    """Qwen2RMSNorm.forward with the variance computed in the input dtype (the planted bug)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states


def plant(model) -> None:
    norm = model.get_submodule(PLANTED_MODULE)
    norm.forward = types.MethodType(bf16_rmsnorm_forward, norm)


def score(model, tokens: int = 24, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator)
    with torch.no_grad():
        logits = model(input_ids).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    token_logprobs = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return tdiff.dump("logprobs", token_logprobs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--planted", action="store_true", help="plant the bf16-variance RMSNorm")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    model = build_model(args.layers)
    if args.planted:
        plant(model)
    token_logprobs = score(model)
    print(f"{'planted' if args.planted else 'reference'} run: mean token log-prob "
          f"{token_logprobs.mean().item():.6f}")


if __name__ == "__main__":
    main()
