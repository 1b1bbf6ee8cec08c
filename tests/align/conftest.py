"""Dumps of the same tiny models in transformers, megatron-core and SGLang, captured once for the
package by one subprocess (tests/stacks/capture_models.py): Megatron and SGLang initialise
torch.distributed, which the test process itself must not keep."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, tdiff_cli
from tests.stacks.capture_models import batch_ids  # noqa: F401  (the inputs every dump saw)

RUNS = ["hf:qwen2", "hf:llama", "hf:qwen3_moe", "hf1:qwen2", "hf1:qwen3_moe", "megatron:qwen2", "megatron:llama",
        "megatron:qwen3_moe",
        "megatron1:qwen2", "megatron1:qwen3_moe", "sglang:qwen2", "sglang:qwen3_moe", "sglang_rope1:qwen2", "planted:qwen2",
        "dumper:qwen2", "dumper:qwen3_moe", "tp1:qwen2+qwen3_moe", "sgldumper:qwen2", "sgldumper:qwen3_moe", "sgldumper_rope1:qwen2",
        "sgldumper_attn1:qwen2"]


class Dumps:
    def __init__(self, root):
        self.root = root

    def __getitem__(self, name: str):
        run, _, model = name.partition(":")
        path = self.root / f"{run}-{model}"
        assert path.is_dir(), f"{name} is not among the captured RUNS"
        return path


@pytest.fixture(scope="package")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("align-dumps")
    done = subprocess.run([sys.executable, "-m", "tests.stacks.capture_models", str(root), *RUNS], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return Dumps(root)


def compare_json(a, b, *args, expect: int | None = None) -> dict:
    result = tdiff_cli("compare", a, b, "--json", *args)
    report = json.loads(result.output) if result.output.startswith("{") else None
    if expect is not None:
        assert result.exit_code == expect, (report or {}).get("first_divergence") or result.output[-2000:]
    return report


def by_name(report: dict) -> dict:
    return {t["name"]: t for t in report["tensors"]}
