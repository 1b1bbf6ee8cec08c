"""A bug in tdiff itself exits 3 (never 1, which means "diverged"), with one line on stderr naming
the file in the temporary directory that holds the traceback."""

import re
import sys
import tempfile
from pathlib import Path

import torch

import tdiff
import tdiff.cli.capture
import tdiff.compare.engine
from tests.helpers import tdiff_cli


def _crash(*args, **kwargs):
    raise ZeroDivisionError("planted bug")


def _dump(path):
    with tdiff.capture(path):
        tdiff.dump("x", torch.arange(4.0))
    return path


def _traceback_file(output: str) -> Path:
    (line,) = [line for line in output.splitlines() if line.startswith("tdiff:")]
    match = re.search(r"traceback is in (\S+)$", line)
    assert match, line
    return Path(match.group(1))


def test_a_bug_in_compare_exits_3_and_saves_the_traceback(tmp_path, monkeypatch):
    a, b = _dump(tmp_path / "a"), _dump(tmp_path / "b")
    monkeypatch.setattr(tdiff.compare.engine, "compare_dumps", _crash)
    result = tdiff_cli("compare", a, b)
    assert result.exit_code == 3
    assert "Traceback" not in result.output and "bug in tdiff" in result.output
    saved = _traceback_file(result.output)
    try:
        assert saved.parent == Path(tempfile.gettempdir())
        text = saved.read_text()
        assert "Traceback" in text and "ZeroDivisionError: planted bug" in text
    finally:
        saved.unlink()


def test_a_bug_in_capture_exits_3_while_the_command_keeps_its_own_status(tmp_path, monkeypatch):
    failing = tdiff_cli("capture", "--out", tmp_path / "failed", "--", sys.executable, "-c",
                        "import sys; sys.exit(1)")
    assert failing.exit_code == 1  # the wrapped command's own status, passed through
    monkeypatch.setattr(tdiff.cli.capture, "_summarize", _crash)
    result = tdiff_cli("capture", "--out", tmp_path / "ok", "--", sys.executable, "-c", "pass")
    assert result.exit_code == 3
    _traceback_file(result.output).unlink()
