"""Rollout against training on Hugging Face transformers: the same tiny Qwen2 run as an engine
(a left-padded prefill of several prompts, then greedy decode steps with a KV cache) and as a
trainer (one forward over the finished sequences, right-padded, in another order).

The engine dumps the log-prob of each sampled token at the position of that token; the trainer
dumps the log-prob of every token of its sequences (but the first), at each token's position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import tdiff

PAD = 0


@dataclass
class Rollout:
    prompts: list[list[int]]
    sequences: list[list[int]]      # prompt + every sampled token (the last one never fed)
    decode_steps: int


def engine(model, prompts: list[list[int]], decode_steps: int, dump_dir, **capture) -> Rollout:
    """Prefill all prompts in one left-padded batch, then ``decode_steps`` one-token steps."""
    from transformers import DynamicCache

    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sequences = [list(p) for p in prompts]
    with torch.no_grad(), tdiff.capture(dump_dir, model=model, **capture):
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


def trainer(model, sequences: list[list[int]], dump_dir, **capture) -> None:
    """One forward over the finished sequences, right-padded, and the log-prob of each token."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad(), tdiff.capture(dump_dir, model=model, **capture):
        positions = torch.arange(width).expand(len(sequences), -1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
        dump_logprobs(logits, ids)


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
