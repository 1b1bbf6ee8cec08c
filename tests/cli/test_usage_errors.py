"""Usage errors: an option before `--` is tdiff's, so a mistyped one is refused, named with click's
suggestion, before anything is created; a mistyped command is suggested its name. The error's one
`tdiff: error:` line comes first, then how to use the command."""

import sys

import pytest

from tests.helpers import tdiff_cli

SCRIPT = "import sys, torch, tdiff; tdiff.dump('argv', torch.tensor([len(sys.argv)]))"


def usage_error(*args) -> str:
    result = tdiff_cli(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith("tdiff: error: ") and lines[1].startswith("Usage: "), result.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "typo", "meant"), [
    (["capture", "--out", "{out}", "--mdoe", "stats"], "--mdoe", "--mode"),
    (["capture", "--otu", "{out}"], "--otu", "--out"),
    (["patch", "apply", "--confg", "builtin"], "--confg", "--config"),
    (["patch", "try", "--candidates", "builtin", "--basline", "{out}"], "--basline", "--baseline"),
])
def test_a_mistyped_option_before_the_command_is_named_and_creates_nothing(tmp_path, monkeypatch, args, typo,
                                                                             meant):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "dump"
    line = usage_error(*[a.format(out=out) for a in args], "--", sys.executable, "-c", SCRIPT)
    assert f"'{typo}'" in line and f"'{meant}'" in line
    assert list(tmp_path.iterdir()) == []   # no dump folder, no tdiff-try-* work folder


def test_options_after_the_double_dash_are_the_commands(tmp_path):
    out = tmp_path / "dump"
    tdiff_cli("capture", "--out", out, "-q", "--", sys.executable, "-c", SCRIPT, "--mdoe", "-x", expect=0)
    from tdiff.store import open_dump

    dump = open_dump(out)
    (record,) = dump.records
    assert dump.load(record).tolist() == [3]   # -c's "-c", "--mdoe", "-x": the script's argv


@pytest.mark.parametrize(("args", "meant"), [(["compre", "a", "b"], "compare"), (["patch", "aply"], "apply"),
                                             (["reprot"], "report")])
def test_a_mistyped_command_is_suggested_its_name(args, meant):
    line = usage_error(*args)
    assert f"No such command '{args[-1] if args[0] == 'patch' else args[0]}'" in line and f"'{meant}'" in line
