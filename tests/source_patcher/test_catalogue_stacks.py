"""The catalogue on real megatron-core and SGLang models (CPU): each entry changes exactly the
modules it claims. Each framework runs in its own process (their set-up is process-wide)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


def changed_modules(framework: str, out: Path) -> dict:
    result = subprocess.run([sys.executable, "-m", "tests.source_patcher.stack_numerics", framework, out],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_megatron(tmp_path):
    assert changed_modules("megatron", tmp_path) == {
        "rmsnorm-fp32@gpt": ["RMSNorm"],          # torch.nn.RMSNorm, which the local layer spec builds
        # on the CPU, Megatron's scatter_add combine already sums each token's rows in fp32 in
        # expert order: the contract holds and the patch changes nothing
        "moe-combine-fp32@gpt-moe": [],
    }


def test_sglang(tmp_path):
    assert changed_modules("sglang", tmp_path) == {
        "rmsnorm-fp32@qwen2": ["RMSNorm"],
        # SGLang's residual add is fused into RMSNorm, which its decoder layer calls directly
        "residual-fp32@qwen2": ["Qwen2DecoderLayer", "RMSNorm"],
        "moe-combine-fp32@qwen3_moe": ["FusedMoE"],
    }
