"""A capture whose program failed is incomplete: an exception inside ``with tdiff.capture(...)``,
or a process ended by SIGTERM even when its launcher exits 0."""

import sys
import textwrap

import pytest
import torch

import tdiff
from tdiff.errors import DumpError
from tdiff.store import open_dump
from tests.helpers import tdiff_cli, tdiff_process


def test_an_exception_inside_the_capture_marks_the_dump_incomplete(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), tdiff.capture(tmp_path / "a"):
        tdiff.dump("x", torch.arange(4.0))
        raise RuntimeError("boom")
    with pytest.raises(DumpError, match="incomplete.*raised RuntimeError"):
        open_dump(tmp_path / "a")
    assert [r.name for r in open_dump(tmp_path / "a", allow_incomplete=True).records] == ["x"]
    with tdiff.capture(tmp_path / "b"):
        tdiff.dump("x", torch.arange(4.0))
    result = tdiff_cli("compare", tmp_path / "a", tmp_path / "b")
    assert result.exit_code == 2 and "raised RuntimeError" in result.output


def test_sys_exit_0_inside_the_capture_is_a_clean_end(tmp_path):
    with pytest.raises(SystemExit), tdiff.capture(tmp_path / "a"):
        tdiff.dump("x", torch.arange(4.0))
        sys.exit(0)
    assert open_dump(tmp_path / "a").complete


WORKER = textwrap.dedent("""
    import time
    import torch
    import tdiff

    tdiff.dump("x", torch.arange(4.0))
    print("ready", flush=True)
    time.sleep(120)
""")

LAUNCHER = textwrap.dedent("""
    import subprocess, sys

    worker = subprocess.Popen([sys.executable, sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"
    worker.terminate()          # SIGTERM, as engines end their workers
    worker.wait()
    sys.exit(0)                 # the launcher itself succeeds
""")


def test_a_process_ended_by_sigterm_marks_the_dump_incomplete_though_its_launcher_exits_0(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    out = tmp_path / "dump"
    result = tdiff_process("capture", "--out", out, "--", sys.executable, tmp_path / "launcher.py",
                           tmp_path / "worker.py", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "incomplete" in result.stderr and "SIGTERM" in result.stderr
    with pytest.raises(DumpError, match="ended by SIGTERM"):
        open_dump(out)
    assert [r.name for r in open_dump(out, allow_incomplete=True).records] == ["x"]
