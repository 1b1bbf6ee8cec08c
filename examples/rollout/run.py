"""Rollout against training on Hugging Face transformers: one tiny Qwen2 (random weights, fp32)
run as an engine (a left-padded prefill of two prompts of different lengths, then greedy decode
steps with a KV cache) and as a trainer (one forward over the finished sequences, right-padded,
in the other order).

    python examples/rollout/run.py engine --save rollout.json                 # writes the sequences
    python examples/rollout/run.py trainer --sequences rollout.json
    python examples/rollout/run.py engine --decode-fault                      # a fault in decode only
    python examples/rollout/run.py generate --save generated.json             # HF generate as the engine
    python examples/rollout/run.py forward --sequences generated.json         # a plain model(ids) forward

The engine dumps the log-prob of each sampled token at the position of that token; the trainer
dumps the log-prob of every token of its sequences (but the first), at each token's position.
Under `tdiff capture` both record every module; `tdiff compare` aligns them token by token
(docs/ALIGNMENT.md). The decode fault perturbs layer 1's down projection when it sees one token
per row: `tdiff bisect` names it, and the token. ``generate`` and ``forward`` are the first pair
a user writes: ``model.generate`` (keyword arguments, its own position_ids and cache) against
``model(ids, attention_mask=mask)`` (input_ids by position, no position_ids).
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import tdiff

PAD = 0
PROMPTS = [[5, 17, 9], [3, 44, 21, 8, 61, 30]]
DECODE_STEPS = 3
FAULTY = "model.layers.1.mlp.down_proj"


def build_model(layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


@dataclass
class Rollout:
    prompts: list[list[int]]
    sequences: list[list[int]]      # prompt + every sampled token (the last one never fed)
    decode_steps: int


def engine(model, prompts: list[list[int]], decode_steps: int, dump_dir=None, **capture) -> Rollout:
    """Prefill all prompts in one left-padded batch, then ``decode_steps`` one-token steps
    (captured into ``dump_dir`` when given; else under the capture `tdiff capture` armed)."""
    from transformers import DynamicCache

    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sequences = [list(p) for p in prompts]
    with torch.no_grad(), _captured(dump_dir, model, capture):
        cache = DynamicCache(config=model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        fed = ids
        for _ in range(decode_steps + 1):
            logits = model(input_ids=fed, attention_mask=mask, position_ids=positions, cache=cache,
                           use_cache=True).logits[:, -1].float()
            sampled = logits.argmax(-1)
            scored = torch.log_softmax(logits, -1).gather(-1, sampled[:, None])[:, 0]
            next_positions = positions[:, -1] + 1
            tdiff.dump("logprobs", scored, positions=next_positions)   # element i: sequence i
            for sequence, token in zip(sequences, sampled.tolist()):
                sequence.append(token)
            fed, positions = sampled[:, None], next_positions[:, None]
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
    return Rollout(prompts, sequences, decode_steps)


def trainer(model, sequences: list[list[int]], dump_dir=None, **capture) -> None:
    """One forward over the finished sequences, right-padded, and the log-prob of each token."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad(), _captured(dump_dir, model, capture):
        positions = torch.arange(width).expand(len(sequences), -1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
        dump_logprobs(logits, ids)


def generate(model, prompts: list[list[int]], decode_steps: int) -> Rollout:
    """HF ``generate``, greedy, over the left-padded prompts; the log-prob of each sampled token
    at its position, dumped once at the end (row i: sequence i of the last step's batch, which
    holds them all)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=decode_steps + 1, do_sample=False,
                             pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    sampled = out.sequences[:, width:]
    logits = torch.stack(out.logits, 1).float()   # [batch, new tokens, vocab]
    scored = torch.log_softmax(logits, -1).gather(-1, sampled[..., None])[..., 0]
    lengths = torch.tensor([len(p) for p in prompts])
    tdiff.dump("logprobs", scored, positions=lengths[:, None] + torch.arange(sampled.shape[1]))
    return Rollout(prompts, [p + t for p, t in zip(prompts, sampled.tolist())], decode_steps)


def forward(model, sequences: list[list[int]]) -> None:
    """The plain forward a user writes first: ``model(ids, attention_mask=mask)``, right-padded."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        dump_logprobs(model(ids, attention_mask=mask).logits.float(), ids)


def dump_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> None:
    """A trainer's log-prob of every token but the first, from its [batch, seq, vocab] logits."""
    scored = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    tdiff.dump("logprobs", scored, positions=torch.arange(1, ids.shape[1]).expand(len(ids), -1))


def decode_only_fault(model, module: str, delta: float = 1e-3):
    """Perturb ``module``'s output in decode steps (one token per row) only; returns the hook handle."""

    def plant(_, args, output):
        if args[0].shape[-2] != 1:
            return output
        output = output.clone()
        output[..., 0] += delta
        return output

    return model.get_submodule(module).register_forward_hook(plant)


def _captured(dump_dir, model, options: dict):
    return tdiff.capture(dump_dir, model=model, **options) if dump_dir is not None else nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["engine", "trainer", "generate", "forward"])
    parser.add_argument("--save", help="engine: write the finished sequences to this JSON file")
    parser.add_argument("--sequences", help="trainer, forward: the engine's finished sequences (JSON)")
    parser.add_argument("--decode-fault", action="store_true",
                        help=f"engine, generate: perturb {FAULTY} in decode steps")
    options = parser.parse_args()
    model = build_model()
    if options.role in ("engine", "generate"):
        if options.decode_fault:
            decode_only_fault(model, FAULTY)
        rollout = (engine if options.role == "engine" else generate)(model, PROMPTS, DECODE_STEPS)
        if options.save:
            with open(options.save, "w") as file:
                json.dump(rollout.sequences, file)
    else:
        if not options.sequences:
            parser.error(f"{options.role} needs --sequences (the engine's --save)")
        with open(options.sequences) as file:
            sequences = json.load(file)
        if options.role == "forward":
            forward(model, sequences)
        else:
            trainer(model, sequences[::-1])   # the trainer's batch holds them in another order


if __name__ == "__main__":
    main()
