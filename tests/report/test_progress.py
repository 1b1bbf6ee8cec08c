"""Progress bars: drawn on an interactive stderr only, hidden by --quiet, plain under NO_COLOR."""

import re
import sys

import pytest
import torch

import tdiff
from tdiff.report.progress import progress_bar, progress_enabled
from tests.helpers import tdiff_cli, tdiff_process

SGR = re.compile(r"\x1b\[([0-9;]*)m")


def colours(text: str) -> list[str]:
    """The colour codes (not bold or italic) among the text's ANSI styles."""
    return [p for params in SGR.findall(text) for p in params.split(";")
            if p and (30 <= int(p) <= 49 or 90 <= int(p) <= 107)]


def dumps(tmp_path):
    for side, scale in (("a", 1.0), ("b", 2.0)):
        with tdiff.capture(tmp_path / side):
            for i in range(5):
                tdiff.dump(f"t{i}", torch.ones(3) * scale)
    return tmp_path / "a", tmp_path / "b"


def test_no_progress_when_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    for name in ("TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)
    a, b = dumps(tmp_path)
    result = tdiff_cli("compare", a, b, expect=1)
    assert "comparing" not in result.stderr
    process = tdiff_process("compare", a, b)
    assert process.returncode == 1 and "comparing" not in process.stderr and "\x1b[" not in process.stdout


@pytest.mark.slow
def test_forced_progress_is_drawn_and_quiet_hides_it(tmp_path):
    a, b = dumps(tmp_path)
    forced = {"TTY_COMPATIBLE": "1"}  # rich's switch: treat the output as a terminal
    process = tdiff_process("compare", a, b, "--json", env=forced)
    assert process.returncode == 1 and "comparing" in process.stderr
    assert process.stdout.lstrip().startswith("{")  # the bar never mixes into the results
    quiet = tdiff_process("compare", a, b, "--json", "--quiet", env=forced)
    assert quiet.returncode == 1 and quiet.stderr == ""
    report = tdiff_process("report", a, b, "-o", tmp_path / "r.md", env=forced)
    assert "comparing" in report.stderr and "tdiff: wrote" in report.stderr


def test_no_color_draws_bars_without_colour(tmp_path):
    a, b = dumps(tmp_path)
    process = tdiff_process("compare", a, b, env={"TTY_COMPATIBLE": "1", "NO_COLOR": "1"})
    assert "comparing" in process.stderr and "first" in process.stdout
    assert colours(process.stderr) == [] and colours(process.stdout) == []
    coloured = tdiff_process("compare", a, b, env={"TTY_COMPATIBLE": "1"})
    assert colours(coloured.stdout) and colours(coloured.stderr)  # the same run, colour allowed


def test_progress_helper_is_silent_when_quiet(capsys, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    assert progress_enabled(quiet=False) and not progress_enabled(quiet=True)
    with progress_bar("working", quiet=True) as advance:
        advance(1, 2)
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_capture_quiet_keeps_only_warnings(tmp_path):
    script = tmp_path / "run.py"
    script.write_text("import torch\ntorch.nn.Linear(2, 2)(torch.ones(1, 2))\n")
    loud = tdiff_process("capture", "--out", tmp_path / "a", "--", sys.executable, script)
    assert loud.returncode == 0 and "tdiff: captured" in loud.stderr
    quiet = tdiff_process("capture", "--quiet", "--out", tmp_path / "b", "--", sys.executable, script)
    assert quiet.returncode == 0 and quiet.stderr == ""
