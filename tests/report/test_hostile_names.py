"""Tensor names and side labels holding line breaks, backticks, pipes, HTML and terminal escapes:
shown as written in Markdown (no injected heading, HTML or broken table), without control
characters on the terminal; a 200,000-character name leaves the verdict in `--gh-comment`."""

import re

import torch

import tdiff
from tdiff.report.markdown import COMMENT_LIMIT
from tests.helpers import tdiff_cli

EVIL = "evil\n# Injected\n<img src=x onerror=alert(1)>|pipe|`tick``x\x1b[31mRED\x1b]0;title\x07[/bold]\u202e"
EVIL_SIDE = "side\n## Side heading <b>x</b>|`[/red]\x1b[2J"


def dumps(tmp_path, name=EVIL, side=EVIL_SIDE):
    for label, scale in (("a", 1.0), ("b", 2.0)):
        with tdiff.capture(tmp_path / label, side=f"{side} {label}"):
            tdiff.dump("fine", torch.ones(3))
            tdiff.dump(name, torch.ones(3) * scale)
    return tmp_path / "a", tmp_path / "b"


def _outside_code(line: str) -> str:
    return re.sub(r"(`+).*?\1", "", line)


def test_markdown_shows_hostile_names_as_written(tmp_path):
    a, b = dumps(tmp_path)
    result = tdiff_cli("report", a, b)
    assert result.exit_code == 1
    text = result.output
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f\u202e]", text)
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert all(line.startswith(("## tdiff:", "### ")) for line in headings), headings
    assert len([h for h in headings if h.startswith("## ")]) == 1 and not [h for h in headings if "Injected" in h]
    for line in text.splitlines():
        outside = _outside_code(line)
        assert not re.search(r"(?<!\\)<(?!/?(details|summary|sub)>|!--)", outside), line  # only tdiff's own tags
    for table in re.findall(r"(?:^\|.*\|\n)+", text, flags=re.MULTILINE):
        rows = table.strip().splitlines()
        cells = [len(re.findall(r"(?<!\\)\|", row)) for row in rows]
        assert len(set(cells)) == 1, rows          # no pipe in a name adds a column
    assert "evil # Injected <img src=x onerror=alert(1)>\\|pipe\\|`tick``x[31mRED]0;title[/bold]" in text


def test_the_terminal_gets_no_control_characters_and_no_markup_from_names(tmp_path):
    a, b = dumps(tmp_path)
    result = tdiff_cli("compare", a, b)
    assert result.exit_code == 1, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output and "\u202e" not in result.output
    assert "[/bold]" in result.output and "[/red]" in result.output   # shown, not taken as markup
    bisect = tdiff_cli("bisect", a, b)
    assert bisect.exit_code == 1 and "\x1b" not in bisect.output and "\x07" not in bisect.output
    assert not [line for line in bisect.output.splitlines() if line.startswith("# Injected")]


def test_an_error_naming_a_hostile_file_is_one_clean_line(tmp_path):
    bad = tmp_path / "dump\n\x1b[31mfake: match"
    bad.mkdir()
    result = tdiff_cli("compare", bad, bad)
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "\x1b" not in result.output


def test_a_200000_character_name_leaves_the_verdict_in_the_gh_comment(tmp_path):
    a, b = dumps(tmp_path, name="n" * 200_000, side="run")
    result = tdiff_cli("report", a, b, "--gh-comment")
    assert result.exit_code == 1
    assert len(result.output) <= COMMENT_LIMIT
    assert "**Diverged:**" in result.output
