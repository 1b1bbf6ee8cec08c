"""Rollout against training across frameworks: the tiny Qwen2 as a Hugging Face engine (prefill
+ decode with a KV cache) and as its megatron-core twin training on the finished sequences (one
right-padded forward, described by ``tdiff.tokens``), in a process of its own (Megatron
initialises torch.distributed).

    python -m tests.stacks.rollout_megatron OUT [--fault MODULE]

writes OUT/engine and OUT/trainer; with --fault, the engine's MODULE is perturbed in decode steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import tdiff
from tests.stacks.hf_rollout import rollout as hf_rollout

PROMPTS, DECODE_STEPS = hf_rollout.PROMPTS, hf_rollout.DECODE_STEPS


def main() -> None:
    from tests.helpers import tiny_qwen2
    from tests.stacks.megatron import gpt_forward, init_megatron
    from tests.stacks.models import megatron_twin

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fault")
    options = parser.parse_args()
    init_megatron()
    hf = tiny_qwen2()
    if options.fault:
        hf_rollout.decode_only_fault(hf, options.fault)
    rollout = hf_rollout.engine(hf, PROMPTS, DECODE_STEPS, options.out / "engine")
    megatron = megatron_twin(hf)
    sequences = rollout.sequences
    width = max(map(len, sequences))
    ids = torch.tensor([s + [hf_rollout.PAD] * (width - len(s)) for s in sequences])
    with tdiff.capture(options.out / "trainer", model=megatron):
        tdiff.tokens(input_ids=ids, seq_lens=[len(s) for s in sequences])
        logits = gpt_forward(megatron, ids).float()   # causal: the padding after a sequence never reaches it
        hf_rollout.dump_logprobs(logits, ids)


if __name__ == "__main__":
    main()
