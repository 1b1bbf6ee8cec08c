"""tdiff.launch: the capture configuration through a child's environment, and the command runner."""

import json
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

import pytest

from tdiff.bootstrap import CAPTURE_ENV
from tdiff.capture_options import CaptureOptions
from tdiff.errors import TdiffError
from tdiff.launch import TAIL_CHARS, CaptureConfig, GraftSpec, exit_status, failure, log_tail, run_command
from tdiff.store import open_dump
from tdiff.store.manifest import DUMP_FILE

EVERY_FIELD = CaptureConfig(
    out=Path("dumps/b"),
    options=CaptureOptions(side="B2", mode="stats", storage="h5", select=("^a$", "b"), exclude=("c",),
                           layers="0-3,7", steps="1", batch_row=2, max_pending_bytes=1 << 20,
                           graph_budget_bytes=3 << 20, ops=(r"^m\.layers\.1$",), params=True, force=True,
                           shard_bytes=5 << 20),
    graft=GraftSpec(dump="/d/a", module="m.layers.1", module_b="m.layers.1", step=1, call=0))


def test_every_field_round_trips_through_the_environment_with_out_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    read = CaptureConfig.from_env(EVERY_FIELD.to_env())
    assert read.out == tmp_path / "dumps" / "b"
    assert read == replace(EVERY_FIELD, out=tmp_path / "dumps" / "b")


def test_the_environment_holds_every_option_by_its_name(tmp_path):
    config = CaptureConfig(out=tmp_path / "d", options=CaptureOptions(side="A1"))
    payload = json.loads(config.to_env()[CAPTURE_ENV])
    assert payload == {"out": str(tmp_path / "d"), **CaptureOptions(side="A1").to_json()}
    assert set(payload) == {"out"} | {option.name for option in fields(CaptureOptions)}
    assert CaptureConfig.from_env(config.to_env()) == config


def test_a_child_process_makes_the_capture_the_environment_describes(tmp_path):
    """What a child process does with it (tdiff.child_startup)."""
    from tdiff.hooks.capture import Capture

    config = CaptureConfig.from_env(EVERY_FIELD.to_env())
    capture = Capture(config.out, config.options, graft=asdict(config.graft), launched=True)
    assert capture.options == EVERY_FIELD.options and capture.side == "B2"
    assert capture.graft is not None and capture.graft.module == "m.layers.1"


def test_an_environment_without_a_capture_arms_none():
    assert CaptureConfig.from_env({}) is None
    assert CaptureConfig.from_env({CAPTURE_ENV: ""}) is None


def test_a_child_process_reads_the_configuration_and_the_dump_records_how_it_ended(tmp_path):
    config = CaptureConfig(out=tmp_path / "d", options=CaptureOptions(side="A1", mode="stats", select=("^x$",),
                                                                       steps="0"))
    log = tmp_path / "run.log"
    code = ("import os, sys; from tdiff.launch import CaptureConfig; "
            "print(CaptureConfig.from_env(os.environ)); sys.exit(3)")
    assert run_command([sys.executable, "-c", code], capture=config, log=log) == 3
    assert log.read_text().strip() == repr(config)
    header = json.loads((tmp_path / "d" / DUMP_FILE).read_text())
    assert (header["side"], header["mode"], header["exit_code"]) == ("A1", "stats", 3)
    assert header["command"] == [sys.executable, "-c", code]


@pytest.mark.slow
def test_a_captured_child_records_what_the_configuration_selects(tmp_path):
    code = ("import torch, tdiff\n"
            "for step in range(2):\n"
            "    tdiff.dump('x', torch.ones(2) * step)\n"
            "    tdiff.dump('y', torch.ones(2))\n"
            "    tdiff.step()\n")
    config = CaptureConfig(out=tmp_path / "d", options=CaptureOptions(side="A1", mode="stats", exclude=("^y$",),
                                                                       steps="1"))
    assert run_command([sys.executable, "-c", code], capture=config, log=tmp_path / "run.log") == 0
    dump = open_dump(tmp_path / "d")
    assert {(r.name.split("/")[0], r.step) for r in dump.records} == {("x", 1)}
    assert all(not r.has_data for r in dump.records)  # stats mode


def test_patches_reach_the_child_through_their_own_variable(tmp_path):
    log = tmp_path / "run.log"
    code = "import json, os; print(json.loads(os.environ['TDIFF_PATCHES'])['patches'])"
    assert run_command([sys.executable, "-c", code], patches={"patches": []}, log=log) == 0
    assert log.read_text().strip() == "[]"
    assert not (tmp_path / DUMP_FILE).exists()


def test_exit_mapping_keeps_a_status_and_maps_a_signal_as_a_shell_does(tmp_path):
    assert run_command(["/bin/sh", "-c", "exit 3"]) == 3
    killed = run_command(["/bin/sh", "-c", "kill -9 $$"], log=tmp_path / "log")
    assert killed == -9
    assert [exit_status(status) for status in (0, 3, killed)] == [0, 3, 128 + 9]
    assert failure(killed, tmp_path / "log") == "the command was killed by signal 9"


def test_a_command_that_cannot_start_is_bad_input(tmp_path):
    with pytest.raises(TdiffError, match="command not found: no-such-command-xyz"):
        run_command(["no-such-command-xyz"])
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(TdiffError, match="command is not executable"):
        run_command([str(script)])


def test_the_log_tail_prefers_the_last_error_a_tdiff_child_reported(tmp_path):
    log = tmp_path / "log"
    log.write_text("tdiff: error: patch 'p' (m.f): edit 1: match not found\nTraceback ...\n  later noise  \n\n")
    assert log_tail(log) == "tdiff: error: patch 'p' (m.f): edit 1: match not found"
    log.write_text("first\n  last words  \n\n")
    assert log_tail(log) == "last words"
    assert failure(1, log) == "the command exited with code 1: last words"


def test_the_log_tail_is_cut_and_an_empty_log_says_only_how_the_command_ended(tmp_path):
    log = tmp_path / "log"
    log.write_text("z" * (TAIL_CHARS * 3))
    assert log_tail(log) == "z" * TAIL_CHARS
    log.write_text("\n \n")
    assert failure(2, log) == "the command exited with code 2"
