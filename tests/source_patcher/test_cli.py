"""`tdiff patch apply` and `tdiff patch check` as commands: fail closed, reach every process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tdiff.bootstrap import child_environment
from tdiff.launch import patches_env
from tdiff.source_patcher.spec import parse_patch_file, patches_config
from tdiff.store import open_dump
from tests.helpers import tdiff_cli, tdiff_command, tdiff_process

TARGET = """\
def scaled(x):
    factor = 2
    return x * factor
"""

FIXES = """\
patches:
  - name: triple
    target: {module}.scaled
    edits:
      - match: "factor = 2"
        replacement: "factor = 3"
  - name: {second_name}
    target: {module}.scaled
    edits:
      - match: "{second_match}"
        prepend: "x = x + 100"
"""

SPAWNING = """\
import multiprocessing as mp
import sys

import {module}


def work(queue):
    queue.put({module}.scaled(1))


if __name__ == "__main__":
    context = mp.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=work, args=(queue,))
    child.start()
    child_value = queue.get()
    child.join()
    print("parent", {module}.scaled(1), "child", child_value, "exit", child.exitcode)
"""


def project(tmp_path, second_match="return x * factor", second_name="shift"):
    """A module, a patch file for it and a script that spawns a child process."""
    module = f"target_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(TARGET)
    fixes = tmp_path / "fixes.yaml"
    fixes.write_text(FIXES.format(module=module, second_match=second_match, second_name=second_name))
    script = tmp_path / "spawn.py"
    script.write_text(SPAWNING.format(module=module))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return module, fixes, script, env


def test_check_passes_a_current_file_and_names_the_one_stale_patch(tmp_path, monkeypatch):
    module, fixes, _, _ = project(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = tdiff_cli("patch", "check", "--config", fixes, expect=0)
    assert result.output.count("ok ") == 2
    report = json.loads(tdiff_cli("patch", "check", "--config", fixes, "--json", expect=0).output)
    assert report["status"] == "ok" and [p["name"] for p in report["patches"]] == ["triple", "shift"]
    assert all(len(p["sha256"]) == 64 and p["location"].endswith(f"{module}.py:1") for p in report["patches"])

    assert tdiff_cli("patch", "check", "--config", fixes, "--quiet", expect=0).output == ""

    (tmp_path / f"{module}.py").write_text(TARGET.replace("return x * factor", "return factor * x"))
    stale = tdiff_cli("patch", "check", "--config", fixes, expect=2)
    assert "stale         shift" in stale.output
    quiet = tdiff_cli("patch", "check", "--config", fixes, "--quiet", expect=2).output
    assert "stale         shift" in quiet and "ok " not in quiet
    assert ("tdiff: error: 1 of 2 patch(es) no longer apply: patch 'shift' "
            f"({module}.scaled, {fixes} line 7): edit 1: match not found: 'return x * factor'") in stale.output


def test_check_as_a_process_exits_2_naming_the_stale_patch(tmp_path):
    _, fixes, _, env = project(tmp_path, second_match="return x / factor", second_name="gone")
    result = tdiff_process("patch", "check", "--config", fixes, env=env)
    assert result.returncode == 2
    assert "patch 'gone'" in result.stderr and "match not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_patches_reach_a_spawned_subprocess(tmp_path):
    _, fixes, script, env = project(tmp_path)
    plain = subprocess.run([sys.executable, script], capture_output=True, text=True, env={**os.environ, **env})
    assert plain.stdout.split() == ["parent", "2", "child", "2", "exit", "0"]
    result = tdiff_process("patch", "apply", "--config", fixes, "--", sys.executable, script, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["parent", "303", "child", "303", "exit", "0"]
    assert "2 of 2 patch(es) applied in 2 process(es)" in result.stderr
    quiet = tdiff_process("patch", "apply", "--config", fixes, "--quiet", "--", sys.executable, script, env=env)
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_apply_refuses_a_stale_patch_before_running_anything(tmp_path):
    _, fixes, _, env = project(tmp_path, second_match="no such line")
    marker = tmp_path / "ran"
    result = tdiff_process("patch", "apply", "--config", fixes, "--", sys.executable, "-c",
                           f"open({str(marker)!r}, 'w')", env=env)
    assert result.returncode == 2 and not marker.exists()
    assert "patch 'shift'" in result.stderr and "match not found: 'no such line'" in result.stderr


def test_a_process_that_finds_another_version_of_the_target_fails_closed(tmp_path):
    module, fixes, _, env = project(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / f"{module}.py").write_text(TARGET.replace("factor = 2", "factor = 4"))
    code = f"import sys; sys.path.insert(0, {str(other)!r}); import {module}; print('ran unpatched')"
    result = tdiff_process("patch", "apply", "--config", fixes, "--", sys.executable, "-c", code, env=env)
    assert result.returncode == 2
    assert "ran unpatched" not in result.stdout
    assert f"tdiff: error: patch 'triple' ({module}.scaled): edit 1: match not found: 'factor = 2'" in result.stderr


def test_the_bootstrap_fails_closed_on_any_patch_that_cannot_apply(tmp_path):
    patches = parse_patch_file("patches:\n  - name: broken\n    target: json.dumps\n    edits:\n"
                               "      - match: 'no such line'\n        replacement: 'pass'\n", "x.yaml").patches
    env = child_environment(patches_env(patches_config(patches)))
    result = subprocess.run([sys.executable, "-c", "import json; print('ran')"], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 2 and "ran" not in result.stdout
    assert "tdiff: error: patch 'broken' (json.dumps): edit 1: match not found" in result.stderr


@pytest.mark.slow
def test_apply_composes_with_capture_and_exits_with_the_commands_status(tmp_path):
    module, fixes, _, env = project(tmp_path)
    failing = tdiff_process("patch", "apply", "--config", fixes, "--", sys.executable, "-c", "raise SystemExit(3)",
                            env=env)
    assert failing.returncode == 3
    never = tdiff_process("patch", "apply", "--config", fixes, "--", sys.executable, "-c", "pass", env=env)
    assert "0 of 2 patch(es) applied" in never.stderr and "never applied" in never.stderr
    script = tmp_path / "model.py"
    script.write_text(textwrap.dedent(f"""
        import torch, tdiff, {module} as target
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
        tdiff.dump("scaled", torch.tensor([float(target.scaled(1))]))
    """))
    result = tdiff_process("patch", "apply", "--config", fixes, "--", sys.executable, "-m", "tdiff", "capture",
                           "--out", tmp_path / "d", "--", sys.executable, script, env=env)
    assert result.returncode == 0, result.stderr
    dump = open_dump(tmp_path / "d")
    assert [float(dump.load(r)) for r in dump.records if r.name == "scaled"] == [303.0]


def test_unknown_keys_and_bad_yaml_are_usage_errors_with_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("patches:\n  - name: a\n    target: json.dumps\n    replace_with: json:loads\n    pinn: x\n")
    result = tdiff_cli("patch", "apply", "--config", bad, "--", "true", expect=2)
    assert f"{bad} line 5: patch 'a': unknown key 'pinn'" in result.output
    missing = tdiff_cli("patch", "check", "--config", tmp_path / "nope.yaml", expect=2)
    assert "no such file" in missing.output
    builtin = tdiff_cli("patch", "check", "--config", "builtin:nope", expect=2)
    assert "no catalogue entry named 'nope'" in builtin.output


def test_patches_config_round_trips_through_the_environment():
    patches = parse_patch_file("patches:\n  - name: a\n    target: json.dumps\n    replace_with: json:loads\n",
                               "x.yaml").patches
    assert json.loads(child_environment(patches_env(patches_config(patches)))["TDIFF_PATCHES"])["patches"][0] == {
        "name": "a", "target": "json.dumps", "replace_with": "json:loads"}


def test_a_pinned_patch_refuses_a_changed_source(tmp_path, monkeypatch):
    module, fixes, _, env = project(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    pin = json.loads(tdiff_cli("patch", "check", "--config", fixes, "--json", expect=0).output)["patches"][0]["sha256"]
    fixes.write_text(fixes.read_text().replace("    target: ", f"    pin: {pin}\n    target: ", 1))
    tdiff_cli("patch", "check", "--config", fixes, expect=0)
    (tmp_path / f"{module}.py").write_text(TARGET.replace("    factor = 2\n", "    factor = 2  # tuned\n"))
    result = tdiff_process("patch", "apply", "--config", fixes, "--", sys.executable, "-c", "pass", env=env)
    assert result.returncode == 2
    assert f"patch 'triple' ({module}.scaled" in result.stderr and "pin mismatch" in result.stderr


def test_a_target_in_the_current_directory_needs_pythonpath_and_the_message_says_so(tmp_path):
    package = tmp_path / f"local_{tmp_path.name[-8:].replace('-', '_')}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "code.py").write_text(TARGET)
    fixes = tmp_path / "fixes.yaml"
    fixes.write_text(FIXES.format(module=f"{package.name}.code", second_match="return x * factor",
                                  second_name="shift"))
    only_tdiff = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    result = tdiff_command("patch", "check", "--config", fixes, cwd=tmp_path, env=only_tdiff)
    assert result.returncode == 2
    assert (f"package {package.name!r} is not installed (it is in the current directory: run with PYTHONPATH=. "
            "to patch it)") in result.stderr
    here = {"PYTHONPATH": os.pathsep.join([".", os.environ.get("PYTHONPATH", "")])}
    assert tdiff_command("patch", "check", "--config", fixes, cwd=tmp_path, env=here).returncode == 0
