"""Capture the same tiny models in transformers, megatron-core and SGLang, in a process of its
own (Megatron and SGLang initialise torch.distributed, which the test process must not keep).

    python -m tests.stacks.capture_models OUT hf:qwen2 megatron:qwen2 sglang:qwen3_moe ...

Each NAME is ``<run>:<model>`` and becomes the dump OUT/<run>-<model>:

    hf, megatron      a batch of 2 sequences (transformers, and its Megatron twin)
    hf1, megatron1    one sequence (as SGLang's prefill runs it)
    sglang            SGLang's model class with the transformers weights, one sequence
    sglang_rope1      the same with layer 1's call of the shared rotary module changed
    planted           the Megatron twin with one weight of layer 1's down projection changed
    dumper            the Megatron twin run under SGLang's own dumper (OUT/dumper-<model>/<model>),
                      then captured by tdiff (OUT/dumper-tdiff-<model>)
    sgldumper         SGLang's model class with the transformers weights, one sequence, run under
                      SGLang's own dumper (OUT/sgldumper-<model>/<model>)
    sgldumper_rope1   the same with layer 1's call of the shared rotary module changed
    sgldumper_attn1   the same with layer 1's attention scale changed
    tp1               tests/stacks/run_megatron.py's models, one per step, on one process
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import tdiff
from tests.helpers import token_ids

BATCH, TOKENS = 2, 8


def batch_ids(batch: int = BATCH) -> torch.Tensor:
    return torch.cat([token_ids(TOKENS, seed=1 + b) for b in range(batch)])


def capture(out: Path, run: str, model_name: str) -> None:
    from tests.stacks.megatron import gpt_forward
    from tests.stacks.models import HF_MODELS, megatron_twin

    target = out / f"{run}-{model_name}"
    if run == "tp1":
        from tests.stacks.run_megatron import run as run_megatron

        with tdiff.capture(target):
            run_megatron(model_name.split("+"))
        return
    hf = HF_MODELS[model_name]()
    if run in ("hf", "hf1"):
        with tdiff.capture(target, side=f"{run}:{model_name}", model=hf), torch.no_grad():
            hf(batch_ids(BATCH if run == "hf" else 1))
    elif run in ("megatron", "megatron1", "planted"):
        model = megatron_twin(hf)
        if run == "planted":
            with torch.no_grad():
                model.decoder.layers[1].mlp.linear_fc2.weight[0, 0] += 0.5
        with tdiff.capture(target, side=f"{run}:{model_name}", model=model):
            gpt_forward(model, batch_ids(1 if run == "megatron1" else BATCH))
    elif run in ("sglang", "sglang_rope1"):
        from tests.stacks.sglang import build_qwen2, build_qwen3_moe, load_hf_weights, prefill

        model = (build_qwen2 if model_name == "qwen2" else build_qwen3_moe)(hf.config)
        load_hf_weights(model, hf.state_dict())
        plant_in_layer_1(model, run.removeprefix("sglang").removeprefix("_"))
        with tdiff.capture(target, side=f"{run}:{model_name}", model=model):
            prefill(model, batch_ids(1)[0])
    elif run.startswith("sgldumper"):
        from sglang.srt.debug_utils.dumper import dumper
        from tests.stacks.sglang import build_qwen2, build_qwen3_moe, load_hf_weights, prefill

        model = (build_qwen2 if model_name == "qwen2" else build_qwen3_moe)(hf.config)
        load_hf_weights(model, hf.state_dict())
        plant_in_layer_1(model, run.removeprefix("sgldumper").removeprefix("_"))
        dumper.configure(enable=True, dir=str(target), exp_name=model_name, non_intrusive_mode="all",
                         enable_output_console=False)
        dumper.register_non_intrusive_dumper(model)
        prefill(model, batch_ids(1)[0])
        dumper.step()
        dumper.reset()
        dumper.configure(enable=False)
    elif run == "dumper":
        from sglang.srt.debug_utils.dumper import dumper

        model = megatron_twin(hf)
        dumper.configure(enable=True, dir=str(target), exp_name=model_name, non_intrusive_mode="all",
                         enable_output_console=False)
        dumper.register_non_intrusive_dumper(model)
        gpt_forward(model, batch_ids())
        dumper.step()
        dumper.reset()
        dumper.configure(enable=False)
        with tdiff.capture(out / f"dumper-tdiff-{model_name}", model=model):
            gpt_forward(model, batch_ids())
    else:
        raise SystemExit(f"unknown run {run!r}")


def plant_in_layer_1(model, what: str) -> None:
    """A fault in layer 1 of an SGLang model: "rope1" changes the second call of the rotary module
    all layers share (the call layer 1 makes), "attn1" the scale of layer 1's attention."""
    if what == "rope1":
        calls = []

        def second_call(_module, _inputs, output):
            calls.append(None)
            return (output[0] * 1.001, output[1]) if len(calls) == 2 else output

        model.model.layers[0].self_attn.rotary_emb.register_forward_hook(second_call)
    elif what == "attn1":
        model.model.layers[1].self_attn.attn.scaling *= 1.05
    elif what:
        raise SystemExit(f"unknown fault {what!r}")


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    from tests.stacks.megatron import init_megatron
    from tests.stacks.sglang import init_sglang

    init_megatron()
    init_sglang()          # after Megatron: they share one gloo process group
    for name in names:
        run, _, model_name = name.partition(":")
        capture(out, run, model_name)


if __name__ == "__main__":
    main()
