"""tdiff.__version__ lives in tdiff/version.py: what writes it (dump headers, reports, --version)
imports that leaf, never the root package, whose capture API (tdiff.capture) is tdiff.hooks."""

import grimp

import tdiff
from tdiff.version import __version__


def test_the_root_package_gives_the_version_of_its_own_module():
    assert tdiff.__version__ == __version__


def test_no_module_of_tdiff_but_the_pytest_plugin_imports_the_root_package():
    """So tdiff and tdiff.hooks import each other in no loop, and reading dumps (which never needs
    the capture API the root package loads) does not reach tdiff.hooks through it."""
    graph = grimp.build_graph("tdiff")
    assert graph.find_modules_that_directly_import("tdiff") <= {"tdiff.testing.pytest_plugin"}
    hooks = graph.find_descendants("tdiff.hooks") | {"tdiff.hooks"}
    assert not [module for module in hooks if graph.chain_exists(importer=module, imported="tdiff")]
