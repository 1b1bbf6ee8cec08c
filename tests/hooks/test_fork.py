"""Capture in programs that fork: children write parts of their own, kept when they leave
through os._exit; worker pools and data loaders end with complete, readable dumps."""

import json
import sys

import pytest

from tdiff.compare import compare_dumps
from tdiff.errors import DumpError
from tdiff.report.console import summary_line
from tdiff.store import open_dump
from tests.helpers import python_script, tdiff_cli, tdiff_process

MODEL = """
import os, sys
import torch, tdiff

# GNU OpenMP hangs in a forked child once the parent ran a parallel region (with or without
# tdiff): one thread, as torch's data loader workers run
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def forward(value):
    with torch.no_grad():
        return float(model(torch.full((2, 8), float(value))).sum())
"""

CHILD_EXITS = MODEL + """
with tdiff.capture(sys.argv[1]):
    forward(1)
    pid = os.fork()
    if pid == 0:
        forward(2)
        tdiff.dump("child.value", torch.arange(5.0))
        {ending}
    assert os.waitpid(pid, 0)[1] == 0
    forward(3)
"""


def _parts(out):
    """Each part's lines, parsed."""
    return {path.name: [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted((out / "manifests").iterdir())}


def _run(source, tmp_path, out, *args, timeout=120):
    result = python_script(source, tmp_path, out, *args, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result


def test_a_forked_child_that_runs_the_model_and_ends_in_os_exit_keeps_its_records(tmp_path):
    for side in ("a", "b"):
        _run(CHILD_EXITS.format(ending="os._exit(0)"), tmp_path, tmp_path / side)
    a, b = open_dump(tmp_path / "a"), open_dump(tmp_path / "b")   # complete: no part cut short
    parts = _parts(tmp_path / "a")
    assert len(parts) == 2
    child = next(lines for lines in parts.values() if any(line.get("name") == "child.value" for line in lines))
    assert child[-1]["type"] == "settled" and not any(line["type"] == "end" for line in child)
    child_records = [line for line in child if line["type"] == "record"]
    assert child[-1]["records"] == len(child_records)
    assert {r["name"] for r in child_records} >= {"(model)", "(model)[0]", "0", "2", "child.value"}
    # the verdict says that a part ended without its end line
    assert any("ended without an end line" in note for note in a.notes)
    report = compare_dumps(a, b)
    assert report.status == "match", summary_line(report)
    assert report.counts()["compared"] == len(a.records)
    verdict = tdiff_cli("compare", tmp_path / "a", tmp_path / "b", expect=0)
    assert "ended without an end line" in " ".join(verdict.output.split())


def test_a_forked_child_that_ends_through_sys_exit_ends_its_part(tmp_path):
    _run(CHILD_EXITS.format(ending="sys.exit(0)"), tmp_path, tmp_path / "a")
    dump = open_dump(tmp_path / "a")
    assert not dump.notes and all(lines[-1]["type"] == "end" for lines in _parts(tmp_path / "a").values())
    assert "child.value" in {r.name for r in dump.records}


def test_a_child_writes_only_its_own_part(tmp_path):
    _run(CHILD_EXITS.format(ending="os._exit(0)"), tmp_path, tmp_path / "a")
    for name, lines in _parts(tmp_path / "a").items():
        header = lines[0]
        assert header["type"] == "header" and name == f"{header['part']}.jsonl"
        # every shard a part's records name is that part's own
        assert all(line["file"].startswith(header["part"]) for line in lines if "file" in line)
        assert sum(line["type"] in ("end", "settled") for line in lines[-1:]) == 1


CUT_SHORT = MODEL + """
def die_inside(module, args, output):
    if os.getpid() != parent:
        os._exit(0)   # in the middle of the child's second forward

parent = os.getpid()
with tdiff.capture(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        forward(2)
        model[1].register_forward_hook(die_inside)
        forward(3)
    assert os.waitpid(pid, 0)[1] == 0
    forward(1)
"""


def test_a_child_cut_short_inside_a_model_call_leaves_the_dump_incomplete(tmp_path):
    _run(CUT_SHORT, tmp_path, tmp_path / "a")
    with pytest.raises(DumpError, match="no end line"):
        open_dump(tmp_path / "a")


NOTHING_RECORDED = MODEL + """
from torch.utils.data import DataLoader

with tdiff.capture(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        os._exit(0)        # a child that records nothing
    assert os.waitpid(pid, 0)[1] == 0
    loader = DataLoader([torch.full((8,), float(i)) for i in range(16)], batch_size=4, num_workers=2)
    for batch in loader:
        with torch.no_grad():
            model(batch)
"""


def test_processes_that_record_nothing_leave_no_part_and_a_data_loader_gives_a_complete_dump(tmp_path):
    _run(NOTHING_RECORDED, tmp_path, tmp_path / "a")
    assert len(_parts(tmp_path / "a")) == 1
    dump = open_dump(tmp_path / "a")
    assert not dump.notes
    assert sorted({r.step for r in dump.records}) == [0, 1, 2, 3]   # four batches, four forwards


POOL_RUNS = MODEL + """
import multiprocessing


if __name__ == "__main__":
    context = multiprocessing.get_context(sys.argv[2])
    for run in range(int(sys.argv[3])):
        with tdiff.capture(f"{sys.argv[1]}/{run}"):
            forward(0)
            with context.Pool(2) as pool:
                assert len(pool.map(forward, range(1, 5))) == 4
            forward(5)
        print(run, flush=True)
"""
RUNS = 20


# spawned workers import torch each (minutes for 20 runs on two cores): slow
@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow),
                                    pytest.param("forkserver", marks=pytest.mark.slow)])
def test_pool_runs_end_complete_and_readable(tmp_path, method):
    # each run's pool is ended by terminate() (Pool.__exit__): SIGTERM to idle workers
    result = _run(POOL_RUNS, tmp_path, tmp_path, method, RUNS, timeout=400)   # a hang fails here
    assert result.stdout.split() == [str(run) for run in range(RUNS)]
    for run in range(RUNS):
        dump = open_dump(tmp_path / str(run))   # complete and readable, or it raises
        forwards = [r for r in dump.records if r.name == "(model)"]   # the outermost model's outputs
        if method == "fork":   # the workers recorded their forwards (spawned ones do not capture)
            assert len(dump.parts) >= 2 and len(forwards) == 6
        else:
            assert len(dump.parts) == 1 and len(forwards) == 2


POOL_PROGRAM = MODEL + """
import multiprocessing

if __name__ == "__main__":
    forward(0)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(forward, range(1, 5))
    forward(5)
"""


def test_a_pool_under_tdiff_capture_gives_a_complete_dump(tmp_path):
    # workers inherit SIGTERM's handler, which the pool's terminate() runs in each idle worker
    (tmp_path / "pool.py").write_text(POOL_PROGRAM)
    result = tdiff_process("capture", "--out", tmp_path / "d", "--", sys.executable, tmp_path / "pool.py",
                           timeout=300)
    assert result.returncode == 0, result.stderr
    assert "incomplete" not in result.stderr
    dump = open_dump(tmp_path / "d")
    assert len([r for r in dump.records if r.name == "(model)"]) == 6


@pytest.mark.slow
def test_pool_runs_end_while_other_processes_take_every_core(tmp_path):
    """The 20 pool runs again and again with a busy loop on each core: a hang (once seen under a
    heavy load) fails within the timeout instead of blocking the suite, and the process group of
    the hung program, its pool's workers included, is killed."""
    import os
    import signal
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(POOL_RUNS)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(len(os.sched_getaffinity(0)))]
    try:
        for attempt in range(5):
            out = tmp_path / f"attempt-{attempt}"
            program = subprocess.Popen([sys.executable, str(script), str(out), "fork", str(RUNS)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
            try:
                stdout, stderr = program.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(program.pid, signal.SIGKILL)
                stdout, stderr = program.communicate()
                pytest.fail(f"attempt {attempt} hung after runs {stdout.split()}: {stderr[-2000:]}")
            assert program.returncode == 0, stderr
            assert stdout.split() == [str(run) for run in range(RUNS)]
            for run in range(RUNS):
                open_dump(out / str(run))   # complete and readable, or it raises
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
