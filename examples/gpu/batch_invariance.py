"""Score one sequence alone, or inside a batch of different sequences, on a GPU: a Qwen2-0.5B-shaped
model (bf16, random weights). Batch invariance means the sequence's log-probs are bitwise the
same either way; cuBLAS and attention kernels choose reduction splits by shape, so often they
are not (issue 8, part 1).

    python examples/gpu/batch_invariance.py                 # the sequence alone
    python examples/gpu/batch_invariance.py --batch 8       # the same sequence as row 3 of 8

Under `tdiff capture --batch-row 3` the batched run records only that sequence's row, so it
compares module by module with the lone run. The sequence's per-token log-probs are dumped as
"logprobs".
"""

from __future__ import annotations

import argparse

import torch

import tdiff


def build(layers: int, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def sequences(batch: int, row: int, tokens: int, vocab: int, device: str) -> torch.Tensor:
    """``batch`` different sequences; the one under study (seed 100) sits at ``row``."""
    seeds = [200 + i for i in range(batch)]
    seeds[row if batch > 1 else 0] = 100
    rows = [torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(s)) for s in seeds]
    return torch.stack(rows).to(device)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--row", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    model = build(args.layers, args.device)
    row = args.row if args.batch > 1 else 0
    ids = sequences(args.batch, args.row, args.tokens, model.config.vocab_size, args.device)
    with torch.no_grad():
        logits = model(ids).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1)   # the whole batch, as a scorer does
        picked = logprobs[row:row + 1, :-1].gather(-1, ids[row:row + 1, 1:, None]).squeeze(-1)
    tdiff.dump("logprobs", picked)
    print(f"batch {args.batch}, row {row}: mean token log-prob {picked.mean().item():.8f}, "
          f"sum of bits {int(picked.view(torch.int32).sum())}")


if __name__ == "__main__":
    main()
