"""Run the Megatron twins of tiny transformers models on the CPU, tensor-parallel over the ranks
torchrun starts (gloo), one step per model. Meant to run under `tdiff capture`:

    python -m tests.stacks.run_megatron --model qwen2 --model qwen3_moe
    python -m torch.distributed.run --nproc-per-node 2 --master-port P -m tests.stacks.run_megatron ...
"""

from __future__ import annotations

import argparse
import os

import torch

import tdiff


def run(models: list[str], *, batch: int = 2, tokens: int = 8, tensor_parallel: int = 1, rank: int = 0) -> None:
    """Forward each model once (Megatron already initialised); each model is its own step."""
    from tests.helpers import token_ids
    from tests.stacks.megatron import gpt_forward
    from tests.stacks.models import HF_MODELS, megatron_twin

    ids = torch.cat([token_ids(tokens, seed=1 + b) for b in range(batch)])
    for index, name in enumerate(models):
        if index:
            tdiff.step()
        gpt_forward(megatron_twin(HF_MODELS[name](), tensor_parallel=tensor_parallel, rank=rank), ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen2", "llama", "qwen3_moe"], action="append")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()

    from tests.stacks.megatron import init_megatron

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    init_megatron(world, rank=rank, world_size=world)
    run(args.model or ["qwen2"], batch=args.batch, tokens=args.tokens, tensor_parallel=world, rank=rank)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
