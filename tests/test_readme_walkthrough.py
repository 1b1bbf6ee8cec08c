"""The README's walkthrough, run as written: every command of its bash blocks, from the root of a
fresh clone, through the installed `tdiff` command (which, unlike `python -m tdiff`, does not see
the current directory)."""

import json
import os
import re
import subprocess

import pytest
import yaml

from tests.helpers import REPO, fresh_clone, installed_tdiff

PLANTED = "model.layers.1.post_attention_layernorm"
EXIT_STATUS = {"capture": 0, "compare": 1, "bisect": 1, "report": 1, "patch": 0}   # as the README says
ACTIVATE = ". .venv/bin/activate"


def walkthrough_commands(readme: str) -> list[str]:
    """The commands of the bash blocks of the "Five-minute walkthrough" section, in order."""
    section = readme.split("## Five-minute walkthrough", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                commands.append(line.strip())
    return commands


def subcommand(command: str) -> str:
    return re.search(r"\btdiff (\w+)", command).group(1)


def test_the_walkthrough_uses_every_command_and_the_shipped_candidates():
    commands = walkthrough_commands((REPO / "README.md").read_text())
    assert commands[0] == ACTIVATE
    assert {subcommand(c) for c in commands[1:]} == set(EXIT_STATUS)
    shipped = yaml.safe_load((REPO / "examples" / "demo" / "candidates.yaml").read_text())
    patches_doc = (REPO / "docs" / "PATCHES.md").read_text()
    worked = patches_doc.split("## A worked example", 1)[1]
    assert yaml.safe_load(re.search(r"```yaml\n(.*?)```", worked, re.DOTALL).group(1)) == shipped


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_written_from_a_fresh_clone(tmp_path):
    clone = fresh_clone(tmp_path / "clone")
    commands = walkthrough_commands((clone / "README.md").read_text())
    assert commands.pop(0) == ACTIVATE   # this test runs in that environment: its bin first on PATH
    bin_dir = os.path.dirname(installed_tdiff())
    # the clone's own tdiff, as `pip install -e .` in the clone would give it
    env = {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ["PATH"]]), "PYTHONPATH": str(clone)}
    outputs = {}
    for command in commands:
        result = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                                timeout=900)
        assert result.returncode == EXIT_STATUS[subcommand(command)], (command, result.stdout[-3000:],
                                                                       result.stderr[-3000:])
        outputs[command] = result.stdout
    by_name = {subcommand(c) + (" --json" if "--json" in c else ""): out for c, out in outputs.items()}
    assert json.loads(by_name["compare --json"])["first_divergence"]["module"] == PLANTED
    assert f"introduced at {PLANTED} (norm, layer 1)" in by_name["bisect"]
    assert "cause: " in by_name["bisect"] and "side A equals the exact RMSNorm correctly rounded" in by_name["bisect"]
    assert f"Introduced at** `{PLANTED}`" in (clone / "report.md").read_text()
    assert "**Cause:**" in (clone / "report.md").read_text()
    assert (clone / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert "best: fp32-variance (matches the baseline" in by_name["patch"]
