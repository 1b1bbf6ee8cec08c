"""`tdiff CMD --help` answers at once: the installed `tdiff` command imports no torch, numpy or
model framework until a command actually runs."""

import os
import subprocess
import sys

import pytest

from tdiff.cli import COMMANDS
from tests.helpers import REPO, installed_tdiff

HEAVY = ("torch", "numpy", "transformers", "megatron", "sglang", "safetensors", "h5py", "matplotlib")
PATCH_SUBCOMMANDS = ("apply", "check", "try")


def imported_modules(args: list[str]) -> set[str]:
    """Top-level modules imported by the installed `tdiff` script run with ARGS (python -X importtime)."""
    script = installed_tdiff()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-X", "importtime", script, *args], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Usage: tdiff" in result.stdout
    lines = [line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    return {name.split(".")[0] for name in lines}


@pytest.mark.parametrize("args", [[name] for name in COMMANDS] + [["patch", sub] for sub in PATCH_SUBCOMMANDS]
                         + [[]], ids=lambda args: " ".join(args) or "tdiff")
def test_help_imports_no_heavy_package(args):
    loaded = imported_modules([*args, "--help"])
    assert "tdiff" in loaded  # the measurement saw tdiff's own imports
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
