"""Every YAML file tdiff reads (patch files, mapping files) refuses an alias bomb before expanding
it: exit 2, one line, in bounded time and memory (bounded data memory, a timeout)."""

import pytest
import torch

import tdiff
from tdiff.bounded_yaml import load
from tdiff.errors import TdiffError
from tests.helpers import one_error_line, tdiff_bounded


def alias_bomb(levels: int = 9) -> str:
    """A flow list whose entry n lists entry n-1 ten times: 10**levels values from a few hundred bytes."""
    entries = ["&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    entries += [f"&l{n} [" + ", ".join([f"*l{n - 1}"] * 10) + "]" for n in range(1, levels + 1)]
    return "[" + ", ".join(entries) + "]"


def test_a_patch_file_alias_bomb_is_refused(tmp_path):
    config = tmp_path / "fixes.yaml"
    config.write_text("patches:\n  - {name: a, target: m, activate: 'm:f'}\n  - {name: b, target: m, activate: 'm:g'}\n"
                      f"combinations:\n  - [a, b, {alias_bomb()}]\n")
    line = one_error_line(tdiff_bounded("patch", "check", "--config", config))
    assert len(line) < 500
    assert "fixes.yaml" in line and "aliases expand" in line


def test_a_mapping_file_alias_bomb_is_refused(tmp_path):
    for side in ("a", "b"):
        with tdiff.capture(tmp_path / side):
            tdiff.dump("x", torch.arange(4.0))
    mapping = tmp_path / "map.yaml"
    mapping.write_text(f"side: {alias_bomb()}\nrules: [{{match: x, boundary: logits}}]\n")
    line = one_error_line(tdiff_bounded("compare", tmp_path / "a", tmp_path / "b", "--mapping", mapping))
    assert len(line) < 500
    assert "map.yaml" in line and "aliases expand" in line


def test_shared_aliases_within_the_bound_still_load():
    data = load(alias_bomb(levels=3), "ok.yaml")  # 1111 values once expanded: fine
    assert len(data[3]) == 10 and data[3][0] is data[2]


@pytest.mark.parametrize("text, message", [("&a [*a]", "contains it"), ("[" * 50_000, "nested too deeply")])
def test_recursive_and_deeply_nested_documents_are_one_line(text, message):
    with pytest.raises(TdiffError, match=message):
        load(text, "x.yaml")
