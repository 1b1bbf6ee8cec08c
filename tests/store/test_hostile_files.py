"""Crafted files in place of a dump's: a FIFO, a device, a symlink to /dev/zero, deep nesting,
values with odd keys, an unreadable directory. Each is exit 2 with one line, in bounded time and
memory (the tdiff process runs with bounded data memory and a timeout)."""

import json
import os
import sys

import pytest
import torch

import tdiff
from tdiff.store.manifest import DUMP_FILE, MANIFEST_DIR
from tests.helpers import one_error_line, tdiff_bounded

# every test runs tdiff as a memory-bounded subprocess (about 2 s each)
pytestmark = pytest.mark.slow


def make_dump(path):
    with tdiff.capture(path):
        tdiff.dump("x", torch.arange(8.0))
    return path


def dumper_files(path, value=None, meta=()):
    """SGLang dumper output as its dumper writes it: one torch.save file per value."""
    path.mkdir()
    torch.save({"value": torch.arange(4.0) if value is None else value, "meta": {"name": "hidden", **dict(meta)}},
               path / "step=0___rank=0___dump_index=0___name=hidden.pt")
    return path


def replace_with(path, kind):
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


# a FIFO in the dump is no regular file; a link to /dev/zero is refused first as a file outside the dump
REFUSED_AS = {"fifo": "not a regular file", "dev-zero": "tdiff reads only files inside the dump"}


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_manifest_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    good, bad = make_dump(tmp_path / "good"), make_dump(tmp_path / "bad")
    (manifest,) = (bad / MANIFEST_DIR).iterdir()
    replace_with(manifest, kind)
    line = one_error_line(tdiff_bounded("compare", good, bad))
    assert manifest.name in line and REFUSED_AS[kind] in line


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_dump_header_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    good, bad = make_dump(tmp_path / "good"), make_dump(tmp_path / "bad")
    replace_with(bad / DUMP_FILE, kind)
    assert REFUSED_AS[kind] in one_error_line(tdiff_bounded("compare", good, bad))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_an_sglang_dumper_file_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    good = dumper_files(tmp_path / "good")
    bad = dumper_files(tmp_path / "bad")
    (file,) = bad.iterdir()
    replace_with(file, kind)
    line = one_error_line(tdiff_bounded("compare", good, bad, "--allow-incomplete"))
    assert file.name in line and "not a regular file" in line


def test_a_manifest_line_nested_beyond_the_parser_is_refused(tmp_path):
    good, bad = make_dump(tmp_path / "good"), make_dump(tmp_path / "bad")
    (manifest,) = (bad / MANIFEST_DIR).iterdir()
    lines = manifest.read_text().splitlines()
    record = json.loads(lines[1])
    lines[1] = json.dumps(record)[:-1] + ', "attrs": {"deep": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    manifest.write_text("\n".join(lines) + "\n")
    line = one_error_line(tdiff_bounded("compare", good, bad))
    assert f"{manifest.name} line 2" in line


def test_a_deeply_nested_sglang_value_is_refused(tmp_path):
    value = torch.arange(4.0)
    for _ in range(3000):  # deeper than Python's default recursion limit
        value = [value]
    good = dumper_files(tmp_path / "good")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # for torch.save to write it
    try:
        bad = dumper_files(tmp_path / "bad", value)
    finally:
        sys.setrecursionlimit(limit)
    line = one_error_line(tdiff_bounded("compare", good, bad, "--allow-incomplete"))
    assert "nested" in line


@pytest.mark.parametrize("value, meta", [({1: torch.arange(4.0), (2, 3): torch.ones(2)}, {}),
                                         ({"a": torch.arange(4.0)}, {(1, 2): "x", 3: "y"})])
def test_an_sglang_value_or_meta_with_non_string_keys_is_refused(tmp_path, value, meta):
    good = dumper_files(tmp_path / "good", {"a": torch.arange(4.0)})
    bad = dumper_files(tmp_path / "bad", value, meta)
    line = one_error_line(tdiff_bounded("compare", good, bad, "--allow-incomplete"))
    assert "has a key" in line


@pytest.mark.parametrize("unreadable", [MANIFEST_DIR, "data", "."])
def test_an_unreadable_dump_directory_is_refused(tmp_path, unreadable):
    good, bad = make_dump(tmp_path / "good"), make_dump(tmp_path / "bad")
    (bad / unreadable).chmod(0o000)
    try:
        line = one_error_line(tdiff_bounded("compare", good, bad, unprivileged=True))
    finally:
        (bad / unreadable).chmod(0o755)
    assert "Permission denied" in line


@pytest.mark.parametrize("kind", ["fifo", "nested"])
def test_patch_results_that_are_a_fifo_or_nested_too_deeply_are_refused(tmp_path, kind):
    a, b = make_dump(tmp_path / "a"), make_dump(tmp_path / "b")
    results = tmp_path / "results.json"
    if kind == "fifo":
        os.mkfifo(results)
    else:
        results.write_text("[" * 100_000 + "]" * 100_000)
    line = one_error_line(tdiff_bounded("report", a, b, "--patch-results", results))
    assert "--patch-results" in line
