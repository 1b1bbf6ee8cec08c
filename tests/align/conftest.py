"""Dumps of the same tiny models in transformers, megatron-core and SGLang, captured once per
session (the stacks share one process: Megatron's distributed state first, then SGLang's)."""

from __future__ import annotations

import json

import pytest
import torch

import tdiff
from tests.helpers import tdiff_cli, token_ids
from tests.stacks.models import HF_MODELS, megatron_twin

BATCH, TOKENS = 2, 8


def batch_ids(batch: int = BATCH) -> torch.Tensor:
    return torch.cat([token_ids(TOKENS, seed=1 + b) for b in range(batch)])


@pytest.fixture(scope="session")
def stacks():
    from tests.stacks.megatron import init_megatron
    from tests.stacks.sglang import init_sglang

    init_megatron()
    init_sglang()


class Dumps:
    """Captures the models on first request; each dump directory is made once per session."""

    def __init__(self, root):
        self.root = root
        self.made: dict[str, object] = {}

    def __getitem__(self, key: str):
        if key not in self.made:
            self.made[key] = self._capture(key)
        return self.made[key]

    def _capture(self, key: str):
        framework, model_name = key.split(":")
        out = self.root / f"{framework}-{model_name}"
        hf = HF_MODELS[model_name]()
        if framework == "hf":             # batch of 2, the Megatron twin's input
            with tdiff.capture(out, side=key, model=hf), torch.no_grad():
                hf(batch_ids())
        elif framework == "hf1":          # one sequence, SGLang's prefill
            with tdiff.capture(out, side=key, model=hf), torch.no_grad():
                hf(batch_ids(1))
        elif framework in ("megatron", "megatron1"):
            from tests.stacks.megatron import gpt_forward

            model = megatron_twin(hf)
            with tdiff.capture(out, side=key, model=model):
                gpt_forward(model, batch_ids(BATCH if framework == "megatron" else 1))
        elif framework == "sglang":
            from tests.stacks.sglang import build_qwen2, build_qwen3_moe, load_hf_weights, prefill

            model = (build_qwen2 if model_name == "qwen2" else build_qwen3_moe)(hf.config)
            load_hf_weights(model, hf.state_dict())
            with tdiff.capture(out, side=key, model=model):
                prefill(model, batch_ids(1)[0])
        return out


@pytest.fixture(scope="session")
def dumps(stacks, tmp_path_factory):
    return Dumps(tmp_path_factory.mktemp("align-dumps"))


def compare_json(a, b, *args, expect: int | None = None) -> dict:
    result = tdiff_cli("compare", a, b, "--json", *args, expect=expect)
    return json.loads(result.output)


def by_name(report: dict) -> dict:
    return {t["name"]: t for t in report["tensors"]}
