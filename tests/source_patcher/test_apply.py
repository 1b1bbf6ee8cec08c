"""Applying patches to live functions, and restoring them: real module files, real imports."""

import importlib
import sys
import traceback

import pytest

from tdiff.source_patcher import PatchError, apply_patches, parse_patch_file
from tdiff.source_patcher.source import locate

TARGET = """\
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nowhere import Missing

CACHE = []


def traced(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)
    return wrapper


class Base:
    def scale(self, x):
        return x


class Norm(Base):
    factor = 3

    @traced
    def forward(self, x: Missing, eps=1e-6, *, store=CACHE) -> Missing:
        variance = x * 2
        total = super().scale(variance) + eps
        store.append(total)
        return total

    @staticmethod
    def helper(a, b=2):
        return a + b


def scale(values, *extra, factor=10, **options):
    return [v * factor for v in values]
"""


def patches(text: str):
    return parse_patch_file(text, "test.yaml").patches


def edit(module: str, target: str = "Norm.forward", match: str = "variance = x * 2",
         replacement: str = "variance = x * 20", name: str = "p", extra: str = "") -> str:
    return (f"patches:\n  - name: {name}\n    target: {module}.{target}\n{extra}"
            f"    edits:\n      - match: {match!r}\n        replacement: {replacement!r}\n")


def test_patch_applies_at_import_and_reaches_references_taken_earlier(make_module):
    name = make_module(TARGET)
    session = apply_patches(patches(edit(name)))
    assert name not in sys.modules
    module = importlib.import_module(name)      # the import hook applies the patch
    norm = module.Norm()
    bound = norm.forward                        # taken while patched
    assert bound(1.0, eps=0.0) == 20.0
    session.restore()
    assert bound(1.0, eps=0.0) == 2.0           # the same bound method sees the restore


def test_patch_applies_at_once_to_an_imported_module_and_restore_leaves_it_as_it_was(make_module):
    module = importlib.import_module(make_module(TARGET))
    function = module.Norm.forward.__wrapped__
    early = module.Norm.forward
    before = (function.__code__, function.__defaults__, function.__kwdefaults__, function.__annotations__)
    with apply_patches(patches(edit(module.__name__))):
        assert function.__code__ is not before[0]
        assert module.Norm.forward is early and early.__wrapped__ is function
        assert module.Norm().forward(1.0, eps=0.0) == 20.0
        assert function.__defaults__ is before[1] and function.__kwdefaults__ is before[2]
        assert function.__kwdefaults__["store"] is module.CACHE   # defaults are not re-evaluated
    assert (function.__code__, function.__defaults__, function.__kwdefaults__, function.__annotations__) == before
    assert function.__code__ is before[0] and module.Norm.forward is early
    assert module.Norm().forward(1.0, eps=0.0) == 2.0


def test_changed_signature_takes_the_new_defaults_and_restore_puts_the_old_ones_back(make_module):
    module = importlib.import_module(make_module(TARGET))
    spec = edit(module.__name__, target="scale", match="def scale(values, *extra, factor=10, **options):",
                replacement="def scale(values, *extra, factor=100, **options):")
    with apply_patches(patches(spec)):
        assert module.scale([1]) == [100] and module.scale([1], factor=2) == [2]
    assert module.scale([1]) == [10] and module.scale.__kwdefaults__ == {"factor": 10}


def test_staticmethod_preamble_and_append(make_module):
    module = importlib.import_module(make_module(TARGET))
    spec = f"""\
patches:
  - name: helper
    target: {module.__name__}.Norm.helper
    preamble: "import math"
    edits:
      - match: "return a + b"
        prepend: "b = math.floor(b * 10)"
"""
    with apply_patches(patches(spec)):
        assert module.Norm.helper(1) == 21 and module.Norm().helper(1, 0.25) == 3
    assert module.Norm.helper(1) == 3


def test_replace_with_forwards_every_argument(make_module):
    fixes = make_module("def scale(values, *extra, factor=10, **options):\n"
                        "    return ('fixed', values, extra, factor, options)\n")
    module = importlib.import_module(make_module(TARGET))
    spec = f"patches:\n  - name: r\n    target: {module.__name__}.scale\n    replace_with: {fixes}:scale\n"
    with apply_patches(patches(spec)):
        assert module.scale([1], 2, factor=3, k=4) == ("fixed", [1], (2,), 3, {"k": 4})
        assert module.scale([1]) == ("fixed", [1], (), 10, {})      # the target's own defaults
    assert module.scale([1]) == [10]


def test_replace_with_an_incompatible_signature_is_refused(make_module):
    fixes = make_module("def scale(values):\n    return values\n")
    module = importlib.import_module(make_module(TARGET))
    spec = f"patches:\n  - name: r\n    target: {module.__name__}.scale\n    replace_with: {fixes}:scale\n"
    with pytest.raises(PatchError, match="cannot take the target's arguments"):
        apply_patches(patches(spec))
    assert module.scale([1]) == [10]


@pytest.mark.parametrize("spec_args, reason", [
    (dict(match="variance = x * 3"), "edit 1: match not found: 'variance = x * 3'"),
    (dict(match="return", replacement="return 0"), "edit 1: match not found"),
    (dict(replacement="variance = (x * 20"), "the edited source does not compile"),
    (dict(target="Norm.missing"), "'missing' is not defined in Norm"),
    (dict(target="Norm.scale"), "'scale' is not defined in Norm"),     # inherited: name where it is defined
    (dict(target="Nowhere.forward"), "'Nowhere' is not defined"),
])
def test_patches_that_cannot_apply_fail_closed_and_change_nothing(make_module, spec_args, reason):
    module = importlib.import_module(make_module(TARGET))
    code = module.Norm.forward.__wrapped__.__code__
    with pytest.raises(PatchError) as error:
        apply_patches(patches(edit(module.__name__, **spec_args)))
    assert reason in error.value.reason and "'p'" in str(error.value)
    assert module.Norm.forward.__wrapped__.__code__ is code


def test_a_match_found_twice_is_refused(make_module):
    name = importlib.import_module(make_module("def f(x):\n    x = x + 1\n    x = x + 1\n    return x\n")).__name__
    with pytest.raises(PatchError, match=r"match found 2 times \(lines 2, 3\)"):
        apply_patches(patches(edit(name, target="f", match="x = x + 1", replacement="x = x + 2")))


def test_nothing_is_half_applied_when_one_patch_of_a_module_fails(make_module):
    module = importlib.import_module(make_module(TARGET))
    good = edit(module.__name__, name="good")
    bad = edit(module.__name__, target="scale", match="no such line", name="bad").split("patches:\n")[1]
    code = module.Norm.forward.__wrapped__.__code__
    with pytest.raises(PatchError, match="'bad'"):
        apply_patches(patches(good + bad))
    assert module.Norm.forward.__wrapped__.__code__ is code


def test_a_missing_module_fails_closed(make_module):
    with pytest.raises(PatchError, match="package 'tdiff_no_such_package' is not installed"):
        apply_patches(patches("patches:\n  - name: p\n    target: tdiff_no_such_package.mod.f\n"
                              "    replace_with: os:getcwd\n"))
    missing_module = edit("tdiff.no_such_module", target="f")
    with pytest.raises(PatchError, match="'no_such_module' is not defined in tdiff"):
        apply_patches(patches(missing_module))


def test_pinned_patch_applies_to_its_source_and_refuses_a_changed_one(make_module, tmp_path):
    name = make_module(TARGET)
    pin = locate("p", f"{name}.Norm.forward").sha256
    spec = edit(name, extra=f"    pin: {pin}\n")
    with apply_patches(patches(spec)):
        assert importlib.import_module(name).Norm().forward(1.0, eps=0.0) == 20.0
    sys.modules.pop(name)
    changed = TARGET.replace("total = super().scale(variance) + eps", "total = super().scale(variance) - 2 * eps")
    make_module(changed, name=name)
    importlib.invalidate_caches()
    apply_patches(patches(spec))
    with pytest.raises(PatchError) as error:
        importlib.import_module(name)   # fails closed as the module loads
    assert name not in sys.modules
    assert "pin mismatch" in error.value.reason and pin in error.value.reason


def test_patches_stack_on_one_function_and_restore_in_reverse(make_module):
    module = importlib.import_module(make_module(TARGET))
    first = apply_patches(patches(edit(module.__name__, name="first")))
    second = apply_patches(patches(edit(module.__name__, name="second", match="variance = x * 20",
                                        replacement="variance = x * 200")))
    assert module.Norm().forward(1.0, eps=0.0) == 200.0
    with pytest.raises(RuntimeError, match="'second' was applied"):
        first.restore()
    second.restore()
    assert module.Norm().forward(1.0, eps=0.0) == 20.0
    first.restore()
    assert module.Norm().forward(1.0, eps=0.0) == 2.0


def test_a_restored_session_does_not_patch_a_module_imported_later(make_module):
    name = make_module(TARGET)
    apply_patches(patches(edit(name))).restore()
    assert importlib.import_module(name).Norm().forward(1.0, eps=0.0) == 2.0


def test_tracebacks_show_the_patched_source(make_module):
    module = importlib.import_module(make_module(TARGET))
    with apply_patches(patches(edit(module.__name__, replacement="variance = x / 0"))):
        with pytest.raises(ZeroDivisionError) as error:
            module.Norm().forward(1.0)
        text = "".join(traceback.format_exception(error.value))
    assert "<tdiff patch p:" in text and "variance = x / 0" in text
