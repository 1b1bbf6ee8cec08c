"""Disk full or a vanished directory during capture: a clear error, an incomplete dump, and the
model's own run unharmed."""

import sys
import textwrap

import pytest

from tests.helpers import python_script, tdiff_cli

FILE_SIZE_LIMITED = textwrap.dedent("""
    import resource, signal, sys
    import torch, tdiff

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    x = torch.randn(64, 256)
    with torch.no_grad():
        expected = model(x)
    # a quota-like limit: no file of this process may grow past 300 kB (writes fail with EFBIG)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
    with torch.no_grad(), tdiff.capture(sys.argv[1], shard_bytes=1 << 20, storage=sys.argv[2]):
        for _ in range(3):
            out = model(x)
    assert torch.equal(out, expected), "the model's own result changed"
    print("model ok")
""")


@pytest.mark.parametrize("storage", ["safetensors", "h5"])
def test_a_full_disk_marks_the_dump_incomplete_and_the_model_runs_on(tmp_path, storage):
    result = python_script(FILE_SIZE_LIMITED, tmp_path, tmp_path / "d", storage)
    assert result.returncode == 0, result.stderr
    assert "model ok" in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("tdiff:")]
    assert len(errors) == 1 and "File too large" in errors[0] and "marked incomplete" in errors[0]
    assert not list((tmp_path / "d" / "data").glob(".*.tmp"))   # the shard cut short is removed
    refused = tdiff_cli("compare", tmp_path / "d", tmp_path / "d", "--allow-incomplete", expect=2)
    assert "capture failed" in refused.output and "File too large" in refused.output


def test_a_directory_removed_during_capture_marks_the_dump_incomplete(tmp_path):
    import shutil

    import torch

    import tdiff

    model = torch.nn.Linear(8, 8)
    with tdiff.capture(tmp_path / "d"):
        model(torch.ones(2, 8))
        shutil.rmtree(tmp_path / "d" / "data")
        out = model(torch.ones(2, 8))  # step 1: writing step 0's shard now fails
        assert torch.equal(out, model(torch.ones(2, 8)))
        tdiff.dump("late", torch.ones(1))
    refused = tdiff_cli("compare", tmp_path / "d", tmp_path / "d", "--allow-incomplete", expect=2)
    assert "capture failed" in refused.output and "No such file or directory" in refused.output


def test_an_unwritable_output_path_is_a_usage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = tdiff_cli("capture", "--out", blocker / "dump", "--", sys.executable, "-c", "pass", expect=2)
    assert "Traceback" not in result.output and str(blocker) in result.output
