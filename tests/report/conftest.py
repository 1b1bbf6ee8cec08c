"""Dumps the report tests share: the bundled demo captured by the real `tdiff capture`."""

import sys

import pytest

from tests.helpers import DEMO, tdiff_process


@pytest.fixture(scope="session")
def demo_dumps(tmp_path_factory):
    """(reference, planted, reference again) dumps of examples/demo/run.py."""
    root = tmp_path_factory.mktemp("demo")
    for side, extra in (("a", []), ("b", ["--planted"]), ("a2", [])):
        result = tdiff_process("capture", "--quiet", "--out", root / side, "--side", side, "--",
                               sys.executable, DEMO, *extra)
        assert result.returncode == 0, result.stderr
    return root / "a", root / "b", root / "a2"
