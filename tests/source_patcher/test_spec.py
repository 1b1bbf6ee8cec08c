"""Patch specs: the YAML format, validated with the line at fault."""

import pytest

from tdiff.errors import TdiffError
from tdiff.source_patcher.spec import parse_patch_file, patches_config, patches_from_config

GOOD = """\
patches:
  - name: fp32-variance
    target: pkg.mod.Norm.forward
    pin: 9f2c9f2c9f2c9f2c9f2c9f2c9f2c9f2c9f2c9f2c9f2c9f2c9f2c9f2c9f2c9f2c
    preamble: "import torch"
    edits:
      - match: "variance = x.pow(2).mean(-1)"
        replacement: "variance = x.float().pow(2).mean(-1)"
      - match: "return y"
        prepend: "y = y.float()"
  - name: other
    target: pkg.mod.function
    replace_with: mypkg.fixes:function
  - name: overrides
    target: torch
    activate: mypkg.fixes:enable
combinations:
  - [fp32-variance, other]
"""


def test_a_valid_file_parses_into_patches_and_candidates():
    parsed = parse_patch_file(GOOD, "fixes.yaml")
    first, second, third = parsed.patches
    assert first.mode == "edits" and first.edits[1].action == "prepend" and first.preamble == "import torch"
    assert first.origin == "fixes.yaml line 2"
    assert second.mode == "replace_with" and third.mode == "activate"
    names = [c.name for c in parsed.candidates()]
    assert names == ["fp32-variance", "other", "overrides", "fp32-variance+other"]
    assert patches_from_config(patches_config(parsed.patches)) == [
        p.__class__(**{**p.__dict__, "origin": "TDIFF_PATCHES", "edits": tuple(
            e.__class__(**{**e.__dict__, "line": None}) for e in p.edits)}) for p in parsed.patches]


@pytest.mark.parametrize("text, message", [
    ("patches:\n  - name: a\n    target: m.f\n    edits: [{match: x, replacment: y}]\n",
     "fixes.yaml line 4: patch 'a' edit 1: unknown key 'replacment'"),
    ("patches:\n  - name: a\n    target: m.f\n    edtis: []\n", "fixes.yaml line 4: patch 'a': unknown key 'edtis'"),
    ("patches:\n  - name: a\n    target: m.f\n    replace_with: 3\n",
     "fixes.yaml line 4: patch 'a': 'replace_with' must be text, not a number"),
    ("patches:\n  - name: a\n    target: [m, f]\n", "fixes.yaml line 3: patch 'a': 'target' must be text, not a list"),
    ("patches:\n  - name: a\n    target: m.f\n    replace_with: x:y\n  - name: a\n    target: m.g\n    replace_with: x:y\n",
     "patch name 'a' is used twice"),
    ("patches:\n  - name: a\n    target: m.f\n", "give exactly one of edits, replace_with or activate"),
    ("patches:\n  - name: a\n    target: m.f\n    edits: [{match: x, replacement: y, append: z}]\n",
     "edit 1: give exactly one of replacement, prepend or append (found replacement, append)"),
    ("patches:\n  - name: a\n    target: m.f\n    pin: abc\n    replace_with: x:y\n", "line 4: patch 'a': 'pin' is 'abc'"),
    ("patches:\n  - name: a\n    target: m\n    replace_with: x:y\n", "names a module"),
    ("patches:\n  - name: a\n    target: m.f\n    target: m.g\n", "line 4: not valid YAML: duplicate key 'target' (first on line 3)"),
    ("patches:\n  - name: a\n   target: m.f\n", "fixes.yaml line 3: not valid YAML"),
    ("patches: {name: a}\n", "'patches' must be a non-empty list"),
    ("patches:\n  - name: a\n    target: m.f\n    replace_with: x:y\ncombinations: [[a, b]]\n", "unknown patch(es): b"),
    ("- just a list\n", "the file must be a mapping"),
])
def test_mistakes_name_the_line_at_fault(text, message):
    with pytest.raises(TdiffError) as error:
        parse_patch_file(text, "fixes.yaml")
    assert message in str(error.value)


def test_yaml_is_read_with_the_safe_loader():
    with pytest.raises(TdiffError, match="not valid YAML"):
        parse_patch_file("patches: !!python/object/apply:os.system ['true']\n", "evil.yaml")
