"""A capture's options are declared once (tdiff.capture_options.CaptureOptions): `tdiff capture`'s
flags, tdiff.capture's keyword arguments and what reaches a captured child process are its fields,
with its defaults. A fifth declaration that drifts from it fails here."""

import inspect
import json
import sys
from dataclasses import fields

import click
import pytest

import tdiff
from tdiff.capture_options import CaptureOptions, flags
from tdiff.cli import LazyGroup
from tdiff.errors import TdiffError
from tdiff.vocab.parse import parse_size
from tests.helpers import tdiff_process

# a value other than the default for every option, as Python takes it and as `tdiff capture` does
OTHER_VALUES = {
    "side": ("S", "S"), "select": (("^nothing$",), ["^nothing$"]), "exclude": (("^skip$",), ["^skip$"]),
    "layers": ("0-3", "0-3"), "steps": ("0-1", "0-1"), "ops": (("^nothing$",), ["^nothing$"]),
    "params": (True, None), "mode": ("stats", "stats"), "storage": ("h5", "h5"),
    "max_pending_bytes": (3 << 20, "3MiB"), "batch_row": (0, "0"), "graph_budget_bytes": (5 << 20, "5MiB"),
    "force": (True, None), "shard_bytes": (7 << 20, None),
}
# `tdiff capture`'s own options, which are not a capture's: where it runs what, how often, how loudly
COMMAND_ONLY = {"out", "repeat", "quiet", "command"}


def _capture_command() -> click.Command:
    return LazyGroup().get_command(None, "capture")


def test_every_option_has_another_value_here():
    assert set(OTHER_VALUES) == {option.name for option in fields(CaptureOptions)}
    assert all(value != option.default for option in fields(CaptureOptions)
               for value in OTHER_VALUES[option.name][:1])


def test_the_capture_commands_options_are_the_declarations_with_its_defaults():
    command = _capture_command()
    params = {param.name: param for param in command.params}
    assert set(params) - COMMAND_ONLY == {option.name for option, _ in flags()}
    given = command.make_context("capture", ["--out", "d", "--", "true"]).params   # no option given
    for option, flag in flags():
        assert params[option.name].opts == list(flag.names)
        default = given[option.name] if not flag.size else parse_size(given[option.name], flag.name)
        assert default == option.default, option.name


def test_tdiff_capture_takes_each_option_by_its_name_with_its_default():
    signature = inspect.signature(tdiff.capture)
    keywords = {name: p.default for name, p in signature.parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("model", "graft")}
    assert keywords == {option.name: option.default for option in fields(CaptureOptions)}
    assert all(option.name in tdiff.capture.__doc__ for option in fields(CaptureOptions))


def test_tdiff_capture_hands_each_option_to_the_capture(tmp_path):
    given = {name: python for name, (python, _) in OTHER_VALUES.items()}
    with pytest.warns(UserWarning, match="matched no module"), tdiff.capture(tmp_path / "d", **given) as capture:
        assert capture.options == CaptureOptions(**given)
    with pytest.raises(TypeError, match="no_such_option"):
        tdiff.capture(tmp_path / "e", no_such_option=1)


@pytest.mark.parametrize("bad, flag", [({"mode": "fast"}, "--mode"), ({"storage": "npz"}, "--format"),
                                       ({"batch_row": -1}, "--batch-row"), ({"ops": "("}, "--ops"),
                                       ({"graph_budget_bytes": -1}, "--graph-budget")])
def test_a_bad_value_is_refused_naming_its_flag(bad, flag):
    with pytest.raises(TdiffError, match=flag):
        CaptureOptions(**bad)


CHILD = """
import json, torch, tdiff
from tdiff.hooks import active_capture
print(json.dumps(active_capture().options.to_json()))
tdiff.dump("x", torch.ones(2))
"""


def test_every_flag_reaches_the_captured_child_process_as_its_option(tmp_path):
    argv = []
    for option, flag in flags():
        written = OTHER_VALUES[option.name][1]
        values = [] if written is None else written if isinstance(written, list) else [written]
        argv += [flag.name] if written is None else [part for value in values for part in (flag.name, value)]
    result = tdiff_process("capture", "--out", tmp_path / "d", "-q", *argv, "--", sys.executable, "-c", CHILD,
                           timeout=300)
    assert result.returncode == 0, result.stderr
    expected = CaptureOptions(**{option.name: OTHER_VALUES[option.name][0] for option, _ in flags()})
    assert json.loads(result.stdout) == expected.to_json()
