"""Run the Megatron twin of a tiny transformers model on the CPU, tensor-parallel over the ranks
torchrun starts (gloo). Meant to run under `tdiff capture`:

    python -m tests.stacks.run_megatron --model qwen2
    python -m torch.distributed.run --nproc-per-node 2 --master-port P -m tests.stacks.run_megatron
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["qwen2", "qwen3_moe"], default="qwen2")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()

    from tests.helpers import token_ids
    from tests.stacks.megatron import gpt_forward, init_megatron
    from tests.stacks.models import HF_MODELS, megatron_twin

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    init_megatron(world, rank=rank, world_size=world)
    model = megatron_twin(HF_MODELS[args.model](), tensor_parallel=world, rank=rank)
    ids = torch.cat([token_ids(args.tokens, seed=1 + b) for b in range(args.batch)])
    gpt_forward(model, ids)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
