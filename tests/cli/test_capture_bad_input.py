"""tdiff capture on a hostile --out: a symbolic link with --force, a disk that fills up while the
command's exit status is recorded. One line, exit 2, and no temporary file left behind."""

import json
import resource
import signal
import sys

import torch

import tdiff
from tdiff.store.manifest import DUMP_FILE, create_dump
from tests.helpers import one_error_line, tdiff_bounded, tdiff_cli


def test_force_on_a_symlinked_out_is_refused_and_removes_nothing(tmp_path):
    real = tmp_path / "real"
    with tdiff.capture(real):
        tdiff.dump("x", torch.arange(3.0))
    link = tmp_path / "link"
    link.symlink_to(real)
    result = tdiff_cli("capture", "--out", link, "--force", "--", sys.executable, "-c", "pass")
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert "symbolic link" in line and str(real) in line
    assert link.is_symlink() and (real / DUMP_FILE).is_file()


def test_a_full_disk_while_recording_the_exit_status_is_one_line_and_leaves_no_tmp(tmp_path):
    command = [sys.executable, "-c", "pass"]   # imports no torch: only tdiff writes the header
    probe = tmp_path / "probe"
    create_dump(probe, {"side": "out", "mode": "full", "storage": "safetensors", "command": command})
    header = (probe / DUMP_FILE).stat().st_size
    # room for the header, not for the exit status and duration added to it (~30 bytes)
    limit = header + 12

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out"
    line = one_error_line(tdiff_bounded("capture", "--out", out, "--", *command, preexec_fn=small_files))
    assert DUMP_FILE in line and "exit_code" in line
    assert "exit_code" not in json.loads((out / DUMP_FILE).read_text())
    assert not [p.name for p in out.rglob("*.tmp")]
