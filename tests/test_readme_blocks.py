"""Every code block of the README is run by a test, or listed here with why it cannot run on this
machine; the Python examples and the patch and report blocks run here, as written; the README's
links into docs/ land on a heading of the page they name."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, fresh_clone, installed_tdiff

README = (REPO / "README.md").read_text()
CLI_REFERENCE = "<!-- cli-reference:begin -->"

# block (its section and first line) -> the test that runs it, or why it cannot run here
RUN_ELSEWHERE = {
    ("## Set-up: two commands", "scripts/demo.sh"): "not here: sets up a .venv and runs the whole suite "
                                                    "(.ci/run runs it on every change)",
    ("## Five-minute walkthrough", ". .venv/bin/activate"): "tests/test_readme_walkthrough.py",
    ("## Five-minute walkthrough", "# 3. bisect"): "tests/test_readme_walkthrough.py",
    ("## Five-minute walkthrough", "# 5. try candidate fixes"): "tests/test_readme_walkthrough.py",
    ("## Comparing across frameworks", "tdiff capture --out dumps/hf"): "not here: a template; run_hf.py and "
        "train_step.py stand for the user's scripts (tests/align run HF against Megatron TP=2 on real stacks)",
    ("## Rollout against training", "tdiff capture --out dumps/engine"): "tests/test_readme_rollout.py",
    ("### SGLang engine against a Megatron trainer", ". .venv/bin/activate"):
        "tests/test_readme_rollout_stacks.py",
    ("### A parity gate for CI", "from tdiff.testing import assert_match"): "tests/test_readme_rollout_stacks.py",
    ("## Installing elsewhere", 'pip install ".[hf,megatron]"'): "not here: installs into the environment; "
        "tests/test_packaging.py builds the same distribution from a fresh clone",
}
RUN_HERE = {
    ("## Five-minute walkthrough", "import torch"): "test_the_python_capture_example_runs_as_written",
    ("### A parity gate for CI", "import torch"): "test_the_pytest_fixture_example_runs_as_written",
    ("## Reports for pull requests", "tdiff report dumps/a dumps/b > report.md"):
        "test_the_report_and_patch_blocks_run_as_written",
    ("## Trying fixes: source patches", "# CI after an upgrade"): "test_the_report_and_patch_blocks_run_as_written",
}


def code_blocks(language: str | None = None) -> list[tuple[str, str, str]]:
    """(section, language, text) of each fenced block before the generated CLI reference; blocks
    without a language are sample output."""
    text = README[:README.index(CLI_REFERENCE)]
    blocks = []
    for match in re.finditer(r"```(\w*)\n(.*?)```", text, re.DOTALL):
        section = re.findall(r"^##+ .*$", text[:match.start()], re.MULTILINE)[-1]
        if language is None or match.group(1) == language:
            blocks.append((section, match.group(1), match.group(2)))
    return blocks


def block(section: str, first: str) -> str:
    return next(text for where, language, text in code_blocks() if where == section and text.startswith(first))


def test_every_code_block_is_run_by_a_test_or_says_why_not():
    claimed = {**RUN_ELSEWHERE, **RUN_HERE}
    code = [(section, text) for section, language, text in code_blocks() if language]
    for section, text in code:
        keys = [key for key in claimed if key[0] == section and text.startswith(key[1])]
        assert len(keys) == 1, f"no test runs this README block of {section!r}: {text[:200]!r}"
    assert len(code) == len(claimed)   # no stale entry either
    for where in RUN_ELSEWHERE.values():
        assert where.startswith("not here: ") or (REPO / where).is_file()


def run_python(source: str, cwd, *args):
    return subprocess.run([sys.executable, *args], input=source if not args else None, cwd=cwd, text=True,
                          capture_output=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def test_the_python_capture_example_runs_as_written(tmp_path):
    result = run_python(block("## Five-minute walkthrough", "import torch"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    from tdiff.store import open_dump

    dump = open_dump(tmp_path / "dumps" / "python")
    assert any(r.name == "logprobs" for r in dump.records)
    assert {r.module for r in dump.records if r.module.startswith("model.layers.")} >= {"model.layers.3.mlp"}


def test_the_pytest_fixture_example_runs_as_written(tmp_path):
    (tmp_path / "test_example.py").write_text(block("### A parity gate for CI", "import torch"))
    result = run_python("", tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_example.py")
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


def commands(text: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in text.replace("\\\n", " ").splitlines()
            if line.strip() and not line.strip().startswith("#")]


@pytest.mark.slow
def test_the_report_and_patch_blocks_run_as_written(tmp_path):
    clone = fresh_clone(tmp_path / "clone")
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(installed_tdiff()), os.environ["PATH"]]),
           "PYTHONPATH": str(clone)}

    def run(command: str, status: int):
        result = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                                timeout=900)
        assert result.returncode == status, (command, result.stdout[-3000:], result.stderr[-3000:])

    # the walkthrough's dumps, which these blocks start from
    run("tdiff capture --out dumps/a -q -- python examples/demo/run.py", 0)
    run("tdiff capture --out dumps/b -q -- python examples/demo/run.py --planted", 0)
    for command in commands(block("## Reports for pull requests", "tdiff report")):
        if "gh pr comment" in command:   # needs GitHub: the Markdown it would post instead
            command = command.split("|")[0]
        run(command, 1)
    assert (clone / "report.html").read_text().startswith("<!DOCTYPE html>")
    status = {"check": 0, "apply": 0, "compare": 0}   # as the block's comments say
    for command in commands(block("## Trying fixes: source patches", "# CI after an upgrade")):
        run(command, status[re.search(r"\btdiff (?:patch )?(\w+)", command).group(1)])


def heading_slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", markdown, re.MULTILINE)}


def test_links_into_the_docs_land_on_a_heading():
    links = re.findall(r"\]\((docs/[\w.]+\.md)#([\w-]+)\)", README)
    assert ("docs/GPU.md", "7-cuda-graphs") in links and ("docs/GPU.md", "8-torchcompile") in links
    for page, anchor in links:
        assert anchor in heading_slugs((REPO / page).read_text()), (page, anchor)
