"""Patch files written for SGLang's own source patcher (sglang.srt.debug_utils.source_patcher, the
YAML Miles passes in DUMPER_SOURCE_PATCHER_CONFIG) are read as they are: no names, match-only
edits that delete, blank actions, preambles. The same file is checked against SGLang's own config
model and applied by SGLang's patcher and by tdiff's, which must leave the same function."""

import importlib

import pytest
import yaml

from tdiff.source_patcher import apply_patches, parse_patch_file
from tests.helpers import tdiff_cli

sglang_patcher = pytest.importorskip("sglang.srt.debug_utils.source_patcher")

TARGET = """\
def scaled(x):
    factor = 2
    x = x + 1
    x = x * factor
    return x


def shifted(x):
    offset = 10
    if x > 0:
        x = x - 1
    return x + offset
"""

# SGLang's format, written like its pr_fix_toggle.py: `replacement: ""`, an append beside a blank
# replacement, a match-only edit, a preamble
SGLANG_FILE = """\
patches:
  - target: {module}.scaled
    edits:
      - match: |
          x = x + 1
        replacement: ""
      - match: |
          factor = 2
        replacement: |
          factor = scale_of(x)
    preamble: |
      from math import floor as scale_of
  - target: {module}.shifted
    edits:
      - match: |
          if x > 0:
              x = x - 1
      - match: "offset = 10"
        append: |
          offset = offset * 3
        replacement: ""
"""
# a second patch of one target: tdiff applies it to the text the first left (SGLang's patcher
# re-reads the original source for each patch, so there the last patch of a target wins)
SECOND_PATCH = """\
  - target: {module}.scaled
    edits:
      - match: "return x"
        prepend: |
          x = x - 0.5
"""


@pytest.fixture
def sglang_file(make_module, tmp_path):
    module = make_module(TARGET)
    path = tmp_path / "dumper_patches.yaml"
    path.write_text(SGLANG_FILE.format(module=module))
    return module, path


def results(module: str) -> list:
    mod = importlib.import_module(module)
    return [(mod.scaled(x), mod.shifted(x)) for x in (-2, 0, 3, 7.5)]


def test_the_file_is_sglangs_format_and_tdiff_reads_it(sglang_file):
    module, path = sglang_file
    text = path.read_text() + SECOND_PATCH.format(module=module)
    sglang_patcher.PatchConfig(**yaml.safe_load(text))   # SGLang's own config model accepts it
    parsed = parse_patch_file(text, str(path))
    assert [p.name for p in parsed.patches] == [f"{module}.scaled", f"{module}.shifted", f"{module}.scaled#2"]
    deleted, replaced = parsed.patches[0].edits
    assert (deleted.action, deleted.text, replaced.action) == ("replacement", "", "replacement")
    assert parsed.patches[0].preamble.strip() == "from math import floor as scale_of"
    assert [(e.action, e.text) for e in parsed.patches[1].edits] == [("replacement", ""),
                                                                     ("append", "offset = offset * 3\n")]


def test_tdiff_and_sglangs_patcher_leave_the_same_functions(sglang_file):
    module, path = sglang_file
    original = results(module)
    with apply_patches(parse_patch_file(path.read_text(), str(path)).patches):
        by_tdiff = results(module)
    assert results(module) == original  # restored
    states = sglang_patcher.apply_patches_from_config(path.read_text())
    try:
        by_sglang = results(module)
    finally:
        for state in reversed(states):
            state.restore()
    assert by_tdiff == by_sglang != original
    assert by_tdiff[3] == (7.5 * 7, 7.5 + 30)   # floor(7.5) * 7.5, no decrement, offset tripled


def test_a_second_patch_of_a_target_keeps_the_first_ones_preamble(sglang_file):
    module, path = sglang_file
    text = path.read_text() + SECOND_PATCH.format(module=module)
    with apply_patches(parse_patch_file(text, str(path)).patches):
        assert importlib.import_module(module).scaled(7.5) == 7.5 * 7 - 0.5


def test_patch_check_accepts_the_file(sglang_file):
    module, path = sglang_file
    path.write_text(path.read_text() + SECOND_PATCH.format(module=module))
    result = tdiff_cli("patch", "check", "--config", path, expect=0)
    assert f"ok            {module}.scaled#2  {module}.scaled" in result.output
