"""The README's rollout walkthrough on the real stacks (SGLang engine against a Megatron trainer) and
its CI gate, run as written: the bash commands from the root of a fresh clone through the installed
`tdiff` command, then the gate's Python block."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, fresh_clone, installed_tdiff

SECTION = "### SGLang engine against a Megatron trainer"
EXIT_STATUS = {"capture": 0, "compare": 0, "bisect": 1}   # as the section says
CULPRIT = "introduced at model.layers.1.self_attn.attn (attention, layer 1)"


def section(readme: str) -> str:
    """This subsection and the CI gate's after it, up to the next section."""
    return readme.split(SECTION, 1)[1].split("\n## ", 1)[0]


def bash_commands(text: str) -> list[str]:
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
            for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.strip().startswith("#")]


def gate_block(text: str) -> str:
    """The first Python block: the one that runs against the dumps the commands wrote."""
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)[0]


def test_the_section_shows_the_output_its_test_checks():
    text = section((REPO / "README.md").read_text())
    commands = bash_commands(text)
    assert commands[0] == ". .venv/bin/activate"
    assert [re.search(r"\btdiff (\w+)", c).group(1) for c in commands[1:]] == \
        ["capture", "capture", "compare", "capture", "capture", "bisect"]
    assert CULPRIT in text and "assert_match" in gate_block(text)


@pytest.mark.slow
def test_the_rollout_walkthrough_runs_as_written_from_a_fresh_clone(tmp_path):
    clone = fresh_clone(tmp_path / "clone")
    text = section((clone / "README.md").read_text())
    commands = bash_commands(text)
    assert commands.pop(0) == ". .venv/bin/activate"   # this test runs in that environment
    bin_dir = os.path.dirname(installed_tdiff())
    env = {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ["PATH"]]), "PYTHONPATH": str(clone),
           "OMP_NUM_THREADS": "1"}
    outputs = {}
    for command in commands:
        result = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                                timeout=900)
        subcommand = re.search(r"\btdiff (\w+)", command).group(1)
        assert result.returncode == EXIT_STATUS[subcommand], (command, result.stdout[-3000:], result.stderr[-3000:])
        outputs[subcommand] = result.stdout
    assert "\nmatch: all " in outputs["compare"] and "aligned by token: 2 sequence pair(s)" in outputs["compare"]
    assert f"\ndiverged: {CULPRIT}" in "\n" + outputs["bisect"]
    assert "first differing token: position " in outputs["bisect"]
    gate = subprocess.run([sys.executable, "-c", gate_block(text)], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=600)
    # the first two gates pass; the third raises with bisect's summary, as the comment says
    planted_line = next(n for n, line in enumerate(gate_block(text).splitlines(), 1) if "sglang-bf16" in line)
    assert gate.returncode == 1 and f"AssertionError: diverged: {CULPRIT}" in gate.stderr, gate.stderr[-3000:]
    assert f'File "<string>", line {planted_line}, in <module>' in gate.stderr, gate.stderr[-3000:]
