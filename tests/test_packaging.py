"""The distribution: built from a fresh clone it is `torch-tdiff` (PyPI's `tdiff` is an unrelated
project), it installs the import package `tdiff` and the `tdiff` command, and the README's install
section names it."""

import re
import tomllib
import zipfile

from tdiff.version import __version__
from tests.helpers import REPO, built_wheel


def test_the_wheel_is_torch_tdiff_with_the_tdiff_package_and_command(tmp_path):
    wheel = built_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert re.search(r"^Name: torch-tdiff$", metadata, re.MULTILINE)
    assert re.search(rf"^Version: {re.escape(__version__)}$", metadata, re.MULTILINE)   # tdiff/version.py's
    assert "tdiff/cli/__init__.py" in names and "tdiff/source_patcher/catalogue.yaml" in names
    assert re.search(r"^tdiff = tdiff\.cli:main$", entry_points, re.MULTILINE)


def test_the_readme_installs_the_distribution_pyproject_names():
    name = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"]
    readme = (REPO / "README.md").read_text()
    install = readme[readme.index("## Installing elsewhere"):]
    assert re.search(rf'pip install "{re.escape(name)}\[', install), install[:600]
    assert name != "tdiff"  # on PyPI that name installs a text-diff tool
