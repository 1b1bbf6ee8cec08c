"""Test helpers: tiny real models (random weights from small configs) and CLI runners."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo" / "run.py"


def tiny_qwen2(dtype=torch.float32, layers: int = 2, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(dtype).eval()


def token_ids(tokens: int = 12, seed: int = 1, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))


def built_wheel(into: Path) -> Path:
    """The wheel pip builds from a fresh clone of the repository (in ``into``)."""
    clone = fresh_clone(into / "clone")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", into / "dist", clone], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    [wheel] = (into / "dist").glob("*.whl")
    return wheel


def planted_norm_dumps(root: Path) -> tuple[Path, Path]:
    """root/a and root/b: a tiny bf16 Qwen2 run twice, side B with its layer-1 post-attention norm
    scaled by 1.01."""
    import tdiff

    model = tiny_qwen2(torch.bfloat16)
    for side in ("a", "b"):
        if side == "b":
            model.model.layers[1].post_attention_layernorm.register_forward_hook(
                lambda module, args, out: out * 1.01)
        with torch.no_grad(), tdiff.capture(root / side):
            model(token_ids())
    return root / "a", root / "b"


def fresh_clone(into: Path) -> Path:
    """A copy of the repository's files (tracked, and new ones git does not ignore) at ``into``,
    as a fresh clone has them: no .venv, no build outputs."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # a deleted, not yet committed file is still listed
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def tdiff_cli(*args, expect: int | None = None):
    """Run the CLI in-process through click's CliRunner; checks the exit code when given."""
    from tdiff.cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    if expect is not None:
        assert result.exit_code == expect, (result.exit_code, result.output)
    return result


def installed_tdiff() -> str:
    """The installed `tdiff` console script of this Python. Unlike ``python -m tdiff`` it does not
    put the current directory on sys.path: it sees what a user's `tdiff` sees."""
    script = shutil.which("tdiff", path=os.path.dirname(sys.executable))
    assert script, "the tdiff console script is not installed next to this Python (pip install -e .)"
    return script


def tdiff_command(*args, cwd=None, env=None, timeout=600):
    """Run the installed `tdiff` command (see :func:`installed_tdiff`) as a real subprocess."""
    return _run([installed_tdiff()], args, cwd, env, timeout)


def tdiff_process(*args, cwd=None, env=None, timeout=600):
    """Run the CLI as a real subprocess (python -m tdiff)."""
    return _run([sys.executable, "-m", "tdiff"], args, cwd, env, timeout)


def python_script(source: str, where: Path, *args, timeout=120):
    """Run ``source`` as a Python script of its own (written into ``where``) from the repository
    root, as a real subprocess."""
    script = where / "script.py"
    script.write_text(source)
    return _run([sys.executable, str(script)], args, REPO, None, timeout)


def _run(command: list[str], args, cwd, env, timeout):
    return subprocess.run([*command, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


BOUNDED_MEMORY = 2 << 30


def _bounded_memory():
    resource.setrlimit(resource.RLIMIT_DATA, (BOUNDED_MEMORY, BOUNDED_MEMORY))


def tdiff_bounded(*args, unprivileged=False, preexec_fn=None, timeout=120):
    """The CLI as a real subprocess with 2 GiB of data memory and a timeout: a hang or a memory
    blow-up on crafted input fails the test instead of the machine. ``unprivileged``: as root,
    without the capabilities that bypass file permissions (skips when that cannot be arranged)."""
    import pytest

    prefix = []
    if unprivileged and os.getuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: file permissions cannot be enforced")
        dropped = "-dac_override,-dac_read_search"
        prefix = [setpriv, f"--bounding-set={dropped}", f"--inh-caps={dropped}"]

    def setup():
        _bounded_memory()
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.run([*prefix, sys.executable, "-m", "tdiff", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=setup,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def one_error_line(result) -> str:
    """The single ``tdiff: error:`` line of a subprocess that exited 2."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tdiff: error:"), result.stderr[-2000:]
    return lines[0]
