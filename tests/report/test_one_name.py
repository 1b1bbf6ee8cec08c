"""One name for one thing across commands: --quiet everywhere, --layers RANGES (alias --layer)
wherever layers are chosen, --select/--exclude/--align/--json on compare, bisect and report,
--workdir (alias --work) wherever a work directory is taken, and bisect's boundary kind in
compare's JSON and the report's tables."""

import json

import click

from tdiff.cli import COMMANDS, LazyGroup
from tests.helpers import tdiff_cli
from tests.report.test_markdown import PLANTED, table_rows


def leaf_commands():
    """(name, click command) of every command that runs something, subcommands included."""
    for name in COMMANDS:
        command = LazyGroup().get_command(None, name)
        if isinstance(command, click.Group):
            yield from ((f"{name} {sub}", command.commands[sub]) for sub in command.commands)
        else:
            yield name, command


def options_of(command) -> dict:
    return {param.name: param.opts for param in command.params if isinstance(param, click.Option)}


def test_every_command_has_quiet_and_one_workdir_flag():
    commands = dict(leaf_commands())
    assert [name for name, command in commands.items() if ["--quiet", "-q"] not in options_of(command).values()] \
        == []
    takes_workdir = {name: opts for name, command in commands.items() for opts in options_of(command).values()
                     if "--workdir" in opts or "--work" in opts}
    assert takes_workdir == {"bisect": ["--workdir", "--work"], "patch try": ["--workdir", "--work"]}
    for name in ("compare", "bisect", "report", "capture", "patch try"):   # one spelling, the other an alias
        assert options_of(commands[name])["layers"] == ["--layers", "--layer"]
    for name in ("compare", "bisect", "report"):
        assert {"select", "exclude", "align", "as_json"} <= set(options_of(commands[name]))


def test_layers_takes_ranges_on_every_command_that_compares(demo_dumps):
    a, b, _ = demo_dumps
    compared = json.loads(tdiff_cli("compare", a, b, "--layers", "0-1", "--json", expect=1).output)
    assert {t["layer"] for t in compared["tensors"]} == {0, 1}
    assert json.loads(tdiff_cli("compare", a, b, "--layers", "0", "--json", expect=0).output)["status"] == "match"
    # bisect: layer 0 alone matches; with layer 1 the planted norm is named
    assert json.loads(tdiff_cli("bisect", a, b, "--layers", "0", "--json", expect=0).output)["status"] == "match"
    found = json.loads(tdiff_cli("bisect", a, b, "--layer", "0-1", "--json", expect=1).output)["first_divergence"]
    assert found["module"] == PLANTED
    line = tdiff_cli("bisect", a, b, "--layers", "7", expect=2).stderr.strip()
    assert line == "tdiff: error: nothing to compare: no tensor is left by --layers 7"


def test_report_selects_excludes_aligns_and_prints_json_as_compare_does(demo_dumps):
    a, b, _ = demo_dumps
    args = ["--select", r"^model\.layers\.1\.", "--exclude", "mlp", "--align", "names"]
    compared = json.loads(tdiff_cli("compare", a, b, *args, "--json", expect=1).output)
    reported = json.loads(tdiff_cli("report", a, b, *args, "--json", expect=1).output)
    assert reported["summary"] == compared["summary"]
    assert {t["name"] for t in compared["tensors"]} and all(
        t["name"].startswith("model.layers.1.") and "mlp" not in t["name"] for t in compared["tensors"])
    assert json.loads(tdiff_cli("report", a, b, "--format", "json", expect=1).output)["summary"] != reported["summary"]


def test_report_layer_keeps_the_tensors_of_that_layer_as_compare_does(demo_dumps):
    a, b, _ = demo_dumps
    compared = json.loads(tdiff_cli("compare", a, b, "--layer", 1, "--json", expect=1).output)   # the alias
    reported = json.loads(tdiff_cli("report", a, b, "--layer", 1, "--format", "json", expect=1).output)
    assert {t["layer"] for t in compared["tensors"]} == {1}
    assert reported["summary"] == compared["summary"]
    assert {row["layer"] for row in reported["boundaries"]} == {1}


def test_compare_json_and_report_tables_name_the_kind_bisect_names(demo_dumps):
    a, b, _ = demo_dumps
    bisected = json.loads(tdiff_cli("bisect", a, b, "--json", expect=1).output)["first_divergence"]
    compared = json.loads(tdiff_cli("compare", a, b, "--json", expect=1).output)
    assert bisected["module"] == compared["first_divergence"]["module"] == PLANTED
    assert compared["first_divergence"]["kind"] == bisected["kind"] == "norm"
    outputs = {t["module"]: t["kind"] for t in compared["tensors"] if t["role"] == "output"}
    assert outputs["model.layers.0.self_attn"] == "attention" and outputs["model.layers.0.mlp"] == "mlp"
    assert [t["kind"] for t in compared["tensors"] if t["name"] == "logprobs"] == ["logprobs"]

    markdown = tdiff_cli("report", a, b, expect=1).output
    assert f"`{PLANTED}` (output, layer 1, kind norm" in markdown
    boundaries = table_rows(markdown, "| layer | boundary | kind |")
    assert ["1", "`post_attention_layernorm` ◀ first", "norm"] in [row[:3] for row in boundaries]
    tensors = table_rows(markdown, r"| \# | tensor | kind |")
    assert [row[2] for row in tensors if row[1] == f"`{PLANTED}`"] == ["norm"]
