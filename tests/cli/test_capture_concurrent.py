"""Two `tdiff capture --out SAME` at once: the second is refused (exit 2, one line naming the
capture that holds the directory) and deletes nothing; the lock goes with its holder; the
processes of one capture are never refused."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tdiff.store import open_dump
from tests.helpers import REPO, one_error_line, tdiff_process

# waits (up to 30 s) for the test to say "go" before it records: until then the dump holds no record
WAITS_THEN_RECORDS = textwrap.dedent("""
    import pathlib, sys, time, torch, tdiff
    started, go = map(pathlib.Path, sys.argv[1:3])
    started.write_text("")
    deadline = time.time() + 30
    while not go.exists() and time.time() < deadline:
        time.sleep(0.05)
    tdiff.dump("x", torch.arange(4.0))
""")


def _start_capture(out, *command):
    return subprocess.Popen([sys.executable, "-m", "tdiff", "capture", "--out", str(out), "--", *map(str, command)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(path, process, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_second_capture_of_a_dump_being_written_is_refused_and_deletes_nothing(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(WAITS_THEN_RECORDS)
    out, started, go = tmp_path / "d", tmp_path / "started", tmp_path / "go"
    first = _start_capture(out, sys.executable, script, started, go)
    try:
        _wait_for(started, first)   # the first's command runs and has recorded nothing yet
        second = subprocess.run([sys.executable, "-m", "tdiff", "capture", "--out", str(out), "--",
                                 sys.executable, script, tmp_path / "started2", go],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        line = one_error_line(second)
        assert "is being written by another capture" in line and f"pid {first.pid} " in line
        assert "--out" in line   # what to do
        assert not (tmp_path / "started2").exists()   # its command never ran
    finally:
        go.write_text("")
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    dump = open_dump(out)
    assert [r.name for r in dump.records] == ["x"] and not dump.problems


@pytest.mark.slow
def test_of_two_captures_started_at_once_one_runs_and_the_other_is_refused(tmp_path):
    records = "import time, torch, tdiff; tdiff.dump('x', torch.ones(3)); time.sleep(1)"
    out = tmp_path / "d"
    both = [_start_capture(out, sys.executable, "-c", records) for _ in range(2)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in both]
    assert sorted(code for code, _, _ in results) == [0, 2], results
    refused = next(stderr for code, _, stderr in results if code == 2)
    assert refused.strip().startswith("tdiff: error:") and "being written by another capture" in refused
    dump = open_dump(out)
    assert len(dump.parts) == 1 and [r.name for r in dump.records] == ["x"] and not dump.problems


@pytest.mark.slow
def test_the_lock_goes_with_a_capture_that_is_killed(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(WAITS_THEN_RECORDS)
    out, started = tmp_path / "d", tmp_path / "started"
    killed = _start_capture(out, sys.executable, script, started, tmp_path / "never")
    _wait_for(started, killed)
    os.killpg(killed.pid, signal.SIGKILL)   # tdiff capture and its command, with no chance to clean up
    killed.communicate(timeout=60)
    # nothing was recorded: the retry takes the directory over without --force
    retry = tdiff_process("capture", "--out", out, "--", sys.executable, "-c",
                          "import torch, tdiff; tdiff.dump('y', torch.ones(2))")
    assert retry.returncode == 0, retry.stderr
    assert [r.name for r in open_dump(out).records] == ["y"]


STARTS_TWO_AT_ONCE = textwrap.dedent("""
    import subprocess, sys
    child = "import time, torch, tdiff; tdiff.dump('x', torch.ones(2)); time.sleep(0.5)"
    children = [subprocess.Popen([sys.executable, "-c", child]) for _ in range(2)]
    assert [c.wait() for c in children] == [0, 0]
""")


@pytest.mark.slow
def test_the_processes_one_capture_starts_together_all_write_their_parts(tmp_path):
    script = tmp_path / "two.py"
    script.write_text(STARTS_TWO_AT_ONCE)
    result = tdiff_process("capture", "--out", tmp_path / "d", "--", sys.executable, script)
    assert result.returncode == 0, result.stderr
    dump = open_dump(tmp_path / "d")
    assert len(dump.parts) == 2 and len(dump.records) == 2 and not dump.problems
