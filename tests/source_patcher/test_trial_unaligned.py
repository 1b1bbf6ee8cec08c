"""`tdiff patch try --allow-unaligned` (issue 27 §1): a run aligned by token that matches while
rows of tokens both runs fed were left uncompared is no match; the flag turns that into a note."""

import json
import re
import shlex
import sys

import yaml

from tests.align.token_layouts import capture_run, trainer, SEQUENCES
from tests.helpers import REPO, tdiff_cli

UNCOMPARED = re.compile(r"tdiff: error: the unpatched control run failed: (\d+) tensor-tokens fed by both runs were "
                        r"not compared; first: hidden seq \S+/\S+ position \S+: .+; --allow-unaligned accepts that")
# an engine's rollout whose third forward no token metadata describes
# (imported, not run as __main__: the candidate patches the module by its name)
ENGINE = (f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -c "
          "'from tests.align.token_layouts import main; main([\"engine\", \"--no-tokens\", \"2\"])'")
NO_CHANGE = {"patches": [{"name": "same-grid", "target": "tests.align.token_layouts._grid",
                          "edits": [{"match": "parts = [cells(key, positions) for key, positions in forward.feeds]",
                                     "replacement": "parts = [cells(key, p) for key, p in forward.feeds]"}]}]}


def test_patch_try_refuses_a_match_with_uncompared_tokens_unless_allow_unaligned(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))   # the candidate's target and the program are the repository's
    baseline = tmp_path / "baseline"
    capture_run(baseline, trainer(SEQUENCES, ["r2", "r1"]))
    candidates = tmp_path / "candidates.yaml"
    candidates.write_text(yaml.safe_dump(NO_CHANGE))

    def trial(work: str, *flags: str, expect: int):
        return tdiff_cli("patch", "try", "--candidates", candidates, "--baseline", baseline, "--workdir",
                         tmp_path / work, *flags, "--", "/bin/sh", "-c", ENGINE, expect=expect)

    refused = trial("refused", expect=2)
    found = UNCOMPARED.search(refused.output)
    assert found and int(found[1]) > 0, refused.output
    report = json.loads(trial("allowed", "--allow-unaligned", "--json", expect=0).stdout)
    note = f"{found[1]} tensor-tokens fed by both runs were not compared; first: hidden"
    for result in (report["control"], *report["candidates"]):
        assert result["status"] == "match" and result["reason"].startswith(note), result
    assert report["candidates"][0]["applied"] == ["same-grid"]
