"""tdiff capture as a real command: subprocess bootstrap, spawned children, exit codes."""

import json
import sys
import textwrap

import pytest

from tdiff.store import open_dump
from tests.helpers import DEMO, tdiff_cli, tdiff_process


@pytest.mark.slow
def test_demo_runs_compare_equal_and_the_planted_module_is_named(tmp_path):
    for side, extra in (("a", []), ("a2", []), ("b", ["--planted"])):
        result = tdiff_process("capture", "--out", tmp_path / side, "--", sys.executable, DEMO, *extra)
        assert result.returncode == 0, result.stderr
        assert "captured" in result.stderr
    same = tdiff_process("compare", tmp_path / "a", tmp_path / "a2")
    assert same.returncode == 0, same.stdout + same.stderr
    different = tdiff_process("compare", tmp_path / "a", tmp_path / "b", "--json")
    assert different.returncode == 1, different.stderr
    first = json.loads(different.stdout)["first_divergence"]
    assert first["module"] == "model.layers.1.post_attention_layernorm" and first["role"] == "output"


SPAWNING = textwrap.dedent("""
    import multiprocessing as mp
    import torch

    def work(scale):
        torch.nn.Linear(4, 4)(torch.full((2, 4), scale))

    if __name__ == "__main__":
        work(1.0)
        child = mp.get_context("spawn").Process(target=work, args=(2.0,))
        child.start(); child.join()
        assert child.exitcode == 0
""")


@pytest.mark.slow
def test_every_python_process_the_command_spawns_captures(tmp_path):
    script = tmp_path / "spawn.py"
    script.write_text(SPAWNING)
    result = tdiff_process("capture", "--out", tmp_path / "d", "--", sys.executable, script)
    assert result.returncode == 0, result.stderr
    dump = open_dump(tmp_path / "d")
    assert len(dump.parts) == 2
    assert {p.header["pid"] for p in dump.parts} == {p.header["pid"] for p in dump.parts} and len(
        {p.name for p in dump.parts}) == 2
    inputs = sorted(float(dump.load(r)[0, 0]) for r in dump.records if r.role == "input")
    assert inputs == [1.0, 2.0]


KILLED = textwrap.dedent("""
    import os, signal, time, torch
    layer = torch.nn.Linear(4, 4)
    layer(torch.ones(2, 4))
    layer(torch.ones(2, 4))  # the second forward starts step 1, which writes out step 0
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.slow
def test_a_run_that_dies_leaves_an_incomplete_dump_that_compare_refuses(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    result = tdiff_process("capture", "--out", tmp_path / "d", "--", sys.executable, script)
    assert result.returncode == 128 + 9
    assert "was killed by signal 9" in result.stderr and "incomplete" in result.stderr
    refused = tdiff_cli("compare", tmp_path / "d", tmp_path / "d", expect=2)
    assert "incomplete" in refused.output and "--allow-incomplete" in refused.output
    allowed = tdiff_cli("compare", tmp_path / "d", tmp_path / "d", "--allow-incomplete", expect=0)
    assert "side A incomplete" in allowed.output


def test_nothing_captured_is_an_error(tmp_path):
    result = tdiff_cli("capture", "--out", tmp_path / "d", "--", sys.executable, "-c", "print('no model')",
                       expect=2)
    assert "dump has no tensors" in result.output


def test_command_errors_and_existing_dumps(tmp_path):
    assert "command not found" in tdiff_cli("capture", "--out", tmp_path / "x", "--", "no-such-cmd-xyz",
                                            expect=2).output
    failing = tdiff_cli("capture", "--out", tmp_path / "f", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert failing.exit_code == 3
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "file").write_text("x")
    assert "is not a dump" in tdiff_cli("capture", "--out", tmp_path / "plain", "--", "true", expect=2).output
    recorded = tdiff_cli("capture", "--out", tmp_path / "r", "--", sys.executable, "-c", RECORDS_THEN_FAILS)
    assert recorded.exit_code == 1
    assert "already holds a dump" in tdiff_cli("capture", "--out", tmp_path / "r", "--", "true", expect=2).output


RECORDS_THEN_FAILS = "import torch, tdiff; tdiff.dump('x', torch.ones(2)); raise SystemExit(1)"
RECORDS = "import torch, tdiff; tdiff.dump('x', torch.ones(2))"


@pytest.mark.slow
def test_a_dump_without_records_is_replaced_by_the_retry_without_force(tmp_path):
    out = tmp_path / "d"
    failed = tdiff_cli("capture", "--out", out, "--", sys.executable, "-c", "raise SystemExit(3)")
    assert failed.exit_code == 3 and "nothing was captured" in failed.output
    tdiff_cli("capture", "--out", out, "--", sys.executable, "-c", RECORDS, expect=0)
    assert [r.name for r in open_dump(out).records] == ["x"]
    # a dump holding records stays unless --force, even an incomplete one
    assert "already holds a dump" in tdiff_cli("capture", "--out", out, "--", "true", expect=2).output
    [manifest] = (out / "manifests").iterdir()
    manifest.write_text("".join(manifest.read_text().splitlines(keepends=True)[:-1]))  # its end line lost
    assert open_dump(out, allow_incomplete=True).problems
    assert "already holds a dump" in tdiff_cli("capture", "--out", out, "--", "true", expect=2).output
    tdiff_cli("capture", "--out", out, "--force", "--", sys.executable, "-c", RECORDS, expect=0)

    repeats = tmp_path / "rep"
    failing_repeats = tdiff_cli("capture", "--out", repeats, "--repeat", 2, "--", sys.executable, "-c",
                                "raise SystemExit(3)")
    assert failing_repeats.exit_code == 3
    tdiff_cli("capture", "--out", repeats, "--repeat", 2, "--", sys.executable, "-c", RECORDS, expect=0)
    assert "already holds a dump" in tdiff_cli("capture", "--out", repeats, "--repeat", 2, "--", "true",
                                               expect=2).output



def test_files_the_command_wrote_into_a_failed_dump_are_kept_without_force(tmp_path):
    """A dump without records is replaced by the retry, but not the files the command put next to
    it (its log, say): those only go with --force."""
    out = tmp_path / "d"
    assert tdiff_cli("capture", "--out", out, "--", sys.executable, "-c", "raise SystemExit(3)").exit_code == 3
    (out / "logs").mkdir()
    (out / "logs" / "run.log").write_text("why the run failed")
    refused = tdiff_cli("capture", "--out", out, "--", sys.executable, "-c", RECORDS, expect=2)
    assert "logs" in refused.output and "--force" in refused.output
    assert (out / "logs" / "run.log").read_text() == "why the run failed"
    tdiff_cli("capture", "--out", out, "--force", "--", sys.executable, "-c", RECORDS, expect=0)
    assert not (out / "logs").exists()

    repeats = tmp_path / "rep"
    assert tdiff_cli("capture", "--out", repeats, "--repeat", 2, "--", sys.executable, "-c",
                     "raise SystemExit(3)").exit_code == 3
    (repeats / "run-1" / "notes.txt").write_text("kept")
    tdiff_cli("capture", "--out", repeats, "--repeat", 2, "--", sys.executable, "-c", RECORDS, expect=2)
    assert (repeats / "run-1" / "notes.txt").read_text() == "kept"

def test_bad_options_exit_2_before_the_command_runs(tmp_path):
    for option, message in ((["--layers", "x"], "--layers"), (["--select", "("], "--select"),
                            (["--max-pending", "lots"], "--max-pending")):
        result = tdiff_cli("capture", "--out", tmp_path / "d", *option, "--", "true", expect=2)
        assert message in result.output
        assert not (tmp_path / "d").exists()
