"""Trainer vs engine-style model on one GPU: megatron-core GPTModel (local layer spec, no
TransformerEngine) against transformers' Qwen2 with the same weights, bf16 (issue 8, part 2).

    python examples/gpu/megatron_vs_hf.py --out gpu-out/mvh [--layers 4] [--tokens 128]

Writes two tdiff dumps, OUT/hf and OUT/megatron, of the same sequence; then
`tdiff compare OUT/hf OUT/megatron` and `tdiff bisect OUT/hf OUT/megatron` align them by
canonical op boundary and name the first divergence and its kind.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tdiff


def qwen2(layers: int, device: str, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype=dtype, device=device).eval()


def init_megatron(device: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if device == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # Megatron asks CUDA for the device (see cpu-stacks)
    parallel_state.initialize_model_parallel(1, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16

    init_megatron(args.device)
    from tests.stacks.megatron import gpt_forward
    from tests.stacks.models import megatron_twin

    hf = qwen2(args.layers, args.device, dtype)
    megatron = megatron_twin(hf.cpu()).to(args.device)
    hf = hf.to(args.device)
    ids = torch.randint(0, hf.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    with torch.no_grad():
        with tdiff.capture(args.out / "hf", side="transformers", model=hf):
            hf_logits = hf(ids).logits
        with tdiff.capture(args.out / "megatron", side="megatron-core", model=megatron):
            mg_logits = gpt_forward(megatron, ids)
    difference = (hf_logits.float() - mg_logits.float()).abs().max().item()
    print(f"transformers vs megatron-core logits: max abs difference {difference:.4g} "
          f"({args.layers} layers, {args.tokens} tokens, bf16, {args.device})")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
