"""Which modules each catalogue entry changes in real megatron-core and SGLang models (bf16, random
weights, CPU). Run in its own process per framework (their set-up is process-wide):

    python stack_numerics.py megatron OUT_DIR     # prints {"entry@model": [classes], ...} as JSON
    python stack_numerics.py sglang OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import tdiff
from tdiff.source_patcher import apply_patches
from tdiff.source_patcher.catalogue import builtin
from tdiff.store import open_dump
from tests.source_patcher import planted
from tests.source_patcher.numerics import introducers

TOKENS = 10


def randomize_norms(model) -> None:
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.data = 1 + 0.1 * torch.randn_like(parameter)


def changes(out: Path, label: str, entry: str, build, forward) -> list[str]:
    dumps = []
    for name, patches in (("stock", ()), ("patched", builtin([entry])[0].patches)):
        model = build()
        with apply_patches(patches), tdiff.capture(out / f"{label}-{name}", side=name, model=model):
            forward(model)
        dumps.append(open_dump(out / f"{label}-{name}"))
    return sorted(introducers(*dumps))


def megatron(out: Path) -> dict:
    from tests.stacks.megatron import build_gpt, gpt_config, gpt_forward, init_megatron

    init_megatron()
    ids = torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(1))

    def build(dtype, experts=None):
        def make():
            config = gpt_config(dtype=dtype, experts=experts, topk=3)
            model = build_gpt(config)
            torch.manual_seed(2)
            randomize_norms(model)
            return model
        return make

    forward = lambda model: gpt_forward(model, ids)  # noqa: E731
    # fp32: torch's RMSNorm already multiplies the weight in fp32, so only the reduction order changes
    return {"rmsnorm-fp32@gpt": changes(out, "gpt-norm", "rmsnorm-fp32", build(torch.float32), forward),
            "moe-combine-fp32@gpt-moe": changes(out, "gpt-moe", "moe-combine-fp32", build(torch.bfloat16, 4), forward)}


def sglang(out: Path) -> dict:
    from tests.stacks.sglang import build_qwen2, build_qwen3_moe, load_hf_weights, prefill

    ids = torch.randint(0, 96, (TOKENS,), generator=torch.Generator().manual_seed(1))

    def build(kind, dtype):
        def make():
            hf = planted.build(kind, torch.float32, "none")
            model = (build_qwen3_moe if kind == "qwen3_moe" else build_qwen2)(hf.config)
            load_hf_weights(model, hf.state_dict())
            return model.to(dtype)
        return make

    forward = lambda model: prefill(model, ids)  # noqa: E731
    # fp32 where SGLang already computes in fp32 and only the summation order changes
    return {"rmsnorm-fp32@qwen2": changes(out, "q2-norm", "rmsnorm-fp32", build("qwen2", torch.float32), forward),
            "residual-fp32@qwen2": changes(out, "q2-res", "residual-fp32", build("qwen2", torch.bfloat16), forward),
            "moe-combine-fp32@qwen3_moe": changes(out, "moe", "moe-combine-fp32", build("qwen3_moe", torch.float32),
                                                  forward)}


if __name__ == "__main__":
    framework, out = sys.argv[1], Path(sys.argv[2])
    print(json.dumps({"megatron": megatron, "sglang": sglang}[framework](out)))
