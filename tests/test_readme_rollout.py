"""The README's rollout walkthrough, run as written from a fresh clone through the installed
`tdiff` command."""

import json
import os
import re
import subprocess

import pytest

from tests.helpers import fresh_clone, installed_tdiff

EXIT_STATUS = {"capture": 0, "compare": 0, "bisect": 1}   # as the README's comments say


def rollout_commands(readme: str) -> list[str]:
    section = readme.split("## Rollout against training", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_the_rollout_walkthrough_runs_as_written(tmp_path):
    clone = fresh_clone(tmp_path / "clone")
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(installed_tdiff()), os.environ["PATH"]]),
           "PYTHONPATH": str(clone)}
    outputs = []
    for command in rollout_commands((clone / "README.md").read_text()):
        result = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                                timeout=900)
        expected = EXIT_STATUS[re.search(r"\btdiff (\w+)", command).group(1)]
        assert result.returncode == expected, (command, result.stdout[-3000:], result.stderr[-3000:])
        outputs.append(result.stdout)
    compare, bisect = outputs[2], outputs[4]
    generated, faulty = " ".join(outputs[7].split()), " ".join(outputs[9].split())
    assert "match: all" in generated and "not compared (not a divergence): (model)[position_ids] (B)" in generated
    assert "introduced at model.layers.1.mlp.down_proj (linear, layer 1)" in faulty
    assert "first differing token: position 3 of sequence 0 (A, step 0) / 0 (B, step 1)" in faulty
    assert "aligned by token" in compare and "15/15" in compare
    assert "introduced at model.layers.1.mlp.down_proj (linear, layer 1)" in bisect
    assert "first differing token: position 3 of sequence 1 (A, step 0) / 0 (B, step 1)" in bisect
    with_json = subprocess.run(["bash", "-c", "tdiff bisect dumps/trainer dumps/faulty --atol 1e-5 --json"],
                               cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert json.loads(with_json.stdout)["first_divergence"]["token"] == {
        "seq_a": 1, "seq_b": 0, "position": 3, "step_a": 0, "step_b": 1}
