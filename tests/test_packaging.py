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
    licence = next(n for n in names if n.endswith((".dist-info/licenses/LICENSE", ".dist-info/LICENSE")))
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(licence).decode() == (REPO / "LICENSE").read_text()


def test_the_readme_installs_from_a_clone_until_the_distribution_pyproject_names_is_published():
    name = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"]
    readme = (REPO / "README.md").read_text()
    install = readme[readme.index("## Installing elsewhere"):].split("\n## ", 1)[0]
    commands = re.search(r"```bash\n(.*?)```", install, re.DOTALL).group(1)
    # unpublished, the distribution installs from a clone; the README names it for later
    assert re.search(r'^pip install "\.\[hf,megatron\]"', commands, re.MULTILINE), commands
    assert name not in commands and f'pip install "{name}[hf,megatron]"' in install
    assert name != "tdiff" and "`pip install tdiff` installs that, not this" in install


def test_the_licence_pyproject_declares_is_shipped():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert declared == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    assert "END OF TERMS AND CONDITIONS" in text and "Copyright 2026 the tdiff authors" in text
    assert "Licensed under the Apache License, Version 2.0" in text
