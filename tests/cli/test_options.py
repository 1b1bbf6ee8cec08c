"""tdiff.cli.options: an option family has one declaration, whichever commands take it, and one
conversion."""

import json
import os

import click
import pytest

from tdiff.cli import COMMANDS, LazyGroup
from tdiff.cli.options import capture_options_from
from tdiff.errors import TdiffError

# the commands of each shared family; --select/--exclude name two families: the tensors a command
# compares, and the modules a capture records
FAMILIES = {
    ("--mapping",): {"compare", "bisect", "report"},
    ("--allow-incomplete",): {"compare", "bisect", "report"},
    ("--json",): {"compare", "bisect", "report", "patch check", "patch try"},
    ("--quiet",): set(COMMANDS) - {"patch"} | {"patch apply", "patch check", "patch try"},
    ("--exact", "--atol", "--rtol"): {"compare", "bisect", "report", "patch try"},
    ("--layers", "--layer"): {"compare", "bisect", "report", "capture", "patch try"},
    ("--align",): {"compare", "bisect", "report"},
    ("--workdir",): {"bisect", "patch try"},
    ("--batch-row",): {"capture", "patch try"},
    ("--steps",): {"capture", "patch try", "bisect"},
    ("--config",): {"patch apply", "patch check"},
    ("--jobs",): {"compare", "bisect", "report", "patch try"},
}
SELECTIONS = {"tensors": {"compare", "bisect", "report"}, "modules": {"capture", "patch try"}}


def leaf_commands() -> dict:
    commands = {}
    for name in COMMANDS:
        command = LazyGroup().get_command(None, name)
        if isinstance(command, click.Group):
            commands.update({f"{name} {sub}": command.commands[sub] for sub in command.commands})
        else:
            commands[name] = command
    return commands


def declaration(command, flag: str):
    """All of an option but its help, or None when ``command`` does not take ``flag``."""
    option = next((p for p in command.params if isinstance(p, click.Option) and flag in p.opts), None)
    if option is None:
        return None
    return (option.name, tuple(option.opts), json.dumps(option.type.to_info_dict(), sort_keys=True, default=str), option.metavar, option.multiple,
            option.is_flag, option.default, option.required)


def test_jobs_default_to_the_cores_this_process_may_use():
    for name, command in leaf_commands().items():
        jobs = next((p for p in command.params if "--jobs" in p.opts), None)
        if jobs is not None:   # issue 32: not os.cpu_count(), which counts cores a pinned process cannot run on
            assert jobs.default == len(os.sched_getaffinity(0)), name


@pytest.mark.parametrize("flags", list(FAMILIES), ids=lambda flags: flags[0])
def test_a_shared_option_is_declared_alike_on_every_command_that_takes_it(flags):
    commands = leaf_commands()
    for flag in flags:
        declared = {name: declaration(command, flag) for name, command in commands.items()}
        takers = {name for name, found in declared.items() if found is not None}
        assert takers == FAMILIES[flags], flag
        assert len({declared[name] for name in takers}) == 1, flag


@pytest.mark.parametrize("flag", ["--select", "--exclude"])
def test_select_and_exclude_are_declared_alike_within_each_family(flag):
    commands = leaf_commands()
    for family in SELECTIONS.values():
        assert len({declaration(commands[name], flag) for name in family}) == 1
    helps = {name: next(p.help for p in commands[name].params if flag in getattr(p, "opts", ()))
             for family in SELECTIONS.values() for name in family}
    assert all("tensors" in helps[name] for name in SELECTIONS["tensors"])
    assert all("modules" in helps[name] for name in SELECTIONS["modules"])


@pytest.mark.parametrize("selection, flag", [
    ({"select": ["("]}, "--select"),
    ({"exclude": ["[a"]}, "--exclude"),
    ({"layers": "3-1"}, "--layers"),
    ({"steps": "x"}, "--steps"),
])
def test_a_bad_capture_selection_is_refused_naming_its_flag(selection, flag):
    with pytest.raises(TdiffError, match=flag):
        capture_options_from(selection)
    capture_options_from({key: ([r"^a\.b$"] if key in ("select", "exclude") else "0-2") for key in selection})
