"""tdiff.capture(DIR) refuses what `tdiff capture --out DIR` refuses: an earlier run's dump
(unless force=True) and a directory another capture is writing; the processes of one program
(the ones it starts while capturing, its multiprocessing workers, torchrun's ranks) join it."""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import tdiff
from tdiff.store import open_dump
from tests.helpers import REPO

RECORDS = "import sys, torch, tdiff\nwith tdiff.capture(sys.argv[1]):\n    tdiff.dump(sys.argv[2], torch.ones(2))\n"


def test_a_capture_into_an_earlier_runs_dump_is_refused_unless_forced(tmp_path):
    with tdiff.capture(tmp_path / "d"):
        tdiff.dump("first", torch.ones(2))
    with pytest.raises(tdiff.TdiffError, match=r"already holds a dump; pass force=True to replace it"):
        tdiff.capture(tmp_path / "d").start()
    assert [r.name for r in open_dump(tmp_path / "d").records] == ["first"]
    with tdiff.capture(tmp_path / "d", force=True):
        tdiff.dump("third", torch.ones(2))
    assert [r.name for r in open_dump(tmp_path / "d").records] == ["third"]


def test_a_directory_that_is_not_a_dump_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(tdiff.TdiffError, match="is not a dump"):
        tdiff.capture(tmp_path).start()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


HOLDS = textwrap.dedent("""
    import pathlib, sys, time, torch, tdiff
    out, started, go = map(pathlib.Path, sys.argv[1:4])
    with tdiff.capture(out):
        started.write_text("")
        while not go.exists():
            time.sleep(0.05)
        tdiff.dump("theirs", torch.ones(2))
""")


@pytest.mark.parametrize("force", [False, True])
def test_a_capture_while_another_program_writes_the_directory_is_refused(tmp_path, force):
    script = tmp_path / "holds.py"
    script.write_text(HOLDS)
    out, started, go = tmp_path / "d", tmp_path / "started", tmp_path / "go"
    other = subprocess.Popen([sys.executable, script, out, started, go], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert other.poll() is None and time.monotonic() < deadline, other.communicate()
            time.sleep(0.05)
        with pytest.raises(tdiff.TdiffError, match=rf"is being written by another capture: .*pid {other.pid} "):
            tdiff.capture(out, force=force).start()
        assert "TDIFF_RUN" not in os.environ
    finally:
        go.write_text("")
        _, stderr = other.communicate(timeout=120)
    assert other.returncode == 0, stderr
    assert [r.name for r in open_dump(out).records] == ["theirs"]


def test_the_processes_a_capture_starts_join_its_dump(tmp_path):
    out = tmp_path / "d"
    with tdiff.capture(out):
        tdiff.dump("parent", torch.ones(2))
        child = subprocess.run([sys.executable, "-c", RECORDS, out, "child"], cwd=REPO, capture_output=True, text=True)
        assert child.returncode == 0, child.stderr
    dump = open_dump(out)
    assert sorted(r.name for r in dump.records) == ["child", "parent"] and len(dump.parts) == 2


def _record_in_worker(out: str, name: str) -> None:
    with tdiff.capture(out):
        tdiff.dump(name, torch.ones(2))


@pytest.mark.slow
def test_spawned_workers_of_one_program_share_a_dump_when_the_program_does_not_capture(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        pool.starmap(_record_in_worker, [(str(tmp_path / "d"), f"w{k}") for k in range(4)])
    dump = open_dump(tmp_path / "d")
    assert sorted(r.name for r in dump.records) == ["w0", "w1", "w2", "w3"] and not dump.problems


RANK = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, tdiff
    dist.init_process_group("gloo")
    with tdiff.capture(sys.argv[1]):
        tdiff.dump("x", torch.full((2,), float(dist.get_rank())))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_torchrun_ranks_share_a_dump(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun is not None
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    command = [torchrun, "--standalone", "--nproc-per-node", "2", script, tmp_path / "d"]
    first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    dump = open_dump(tmp_path / "d")
    assert sorted(r.rank for r in dump.records) == [0, 1] and not dump.problems
    # the next job into the same directory is another run: its ranks are refused
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert second.returncode != 0 and "already holds a dump" in second.stderr


def test_a_dump_another_process_of_the_run_is_making_is_not_taken_for_something_else(tmp_path):
    """Its folders are there, its header not yet: not 'a directory that is not a dump'."""
    (tmp_path / "d" / "manifests").mkdir(parents=True)
    (tmp_path / "d" / "data").mkdir()
    (tmp_path / "d" / ".tdiff-dump.json.4242.a1b2c3.tmp").write_text("")
    with tdiff.capture(tmp_path / "d"):
        tdiff.dump("x", torch.ones(2))
    assert [r.name for r in open_dump(tmp_path / "d").records] == ["x"]
