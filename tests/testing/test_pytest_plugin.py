"""The pytest plugin: pytest loads it through the `pytest11` entry point of the installed
distribution, and its fixture `tdiff_capture` captures blocks that `assert_match` then gates.
Each test runs a real pytest in a subprocess on a test file of its own."""

import subprocess
import sys
import zipfile

import pytest

from tests.helpers import REPO, built_wheel

GATED_TESTS = '''
import torch

import tdiff
from tdiff.testing import assert_match


def run(tdiff_capture, name, scale):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with torch.no_grad():
        model[2].weight *= scale
    with tdiff_capture(name, model=model) as path, torch.no_grad():
        tdiff.dump("logprobs", torch.log_softmax(model(torch.ones(3, 8)), -1))
    return path


def test_same_program_passes(tdiff_capture):
    assert_match(run(tdiff_capture, "a", 1.0), run(tdiff_capture, "b", 1.0))


def test_changed_weight_fails(tdiff_capture):
    assert_match(run(tdiff_capture, "a", 1.0), run(tdiff_capture, "b", 1.5))
'''


def run_pytest(test_dir, *args, pythonpath, autoload=True):
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(pythonpath)}
    if not autoload:   # only the plugins -p names (an installed tdiff would register this one twice)
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(test_dir)],
                          cwd=test_dir, capture_output=True, text=True, timeout=600, env=env)


def check_gated_run(result):
    assert "1 failed, 1 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]
    failure = result.stdout.split("test_changed_weight_fails", 1)[1]
    assert "AssertionError: diverged: introduced at 2 (linear)" in failure, failure[-3000:]


@pytest.mark.slow
def test_the_fixture_captures_blocks_that_assert_match_gates(tmp_path):
    (tmp_path / "test_gated.py").write_text(GATED_TESTS)
    check_gated_run(run_pytest(tmp_path, "-p", "tdiff.testing.pytest_plugin", pythonpath=REPO, autoload=False))


@pytest.mark.slow
def test_the_installed_distribution_registers_the_plugin_for_pytest(tmp_path):
    wheel = built_wheel(tmp_path)
    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)   # a wheel unpacked on the path is an installed distribution
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_gated.py").write_text(GATED_TESTS)
    check_gated_run(run_pytest(tests, pythonpath=installed))   # no -p: found through the entry point
