"""The compare table on terminals of any width: headers over their own data, names wrapped at
their dots and brackets, the least telling columns left out first (and said so), --wide for all."""

import itertools
import json
import re

import pytest
from click.testing import CliRunner

from tdiff.cli import cli
from tests.stacks.hf_rollout import capture_runs

ALL_COLUMNS = ["#", "tensor", "status", "outside tol.", "ULP at scale", "tokens equal", "max abs", "step:call",
               "cosine", "role"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    capture_runs(root)
    return root


def compare(runs, columns: int, *extra):
    result = CliRunner().invoke(cli, ["compare", str(runs / "trainer"), str(runs / "faulty"), "--atol", "1e-5",
                                      "--top", "0", *extra], env={"COLUMNS": str(columns)}, catch_exceptions=False)
    assert result.exit_code == 1, result.output
    return result.output


def table_rows(output: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows of the first table, each row's cells with its wrapped lines joined."""
    header_lines = [[cell.strip() for cell in line.strip("┃").split("┃")]
                    for line in output.splitlines() if line.startswith("┃")]
    header = [" ".join(filter(None, words)) for words in zip(*header_lines)]   # a label may take two lines
    rows: list[list[str]] = []
    for line in output.splitlines():
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if cells[0]:   # "#": a new row; an empty one continues the row above (a wrapped name)
            rows.append(cells)
        else:
            rows[-1] = [before + after for before, after in zip(rows[-1], cells)]
    return header, rows


def name_lines(output: str) -> list[list[str]]:
    """Each row's tensor name, as the lines the table wrapped it into."""
    names: list[list[str]] = []
    for line in output.splitlines():
        if line.startswith("│"):
            index, name = [cell.strip() for cell in line.strip("│").split("│")][:2]
            names.append([name]) if index else names[-1].append(name)
    return names


def test_token_aligned_headers_sit_over_their_own_data(runs):
    header, rows = table_rows(compare(runs, 400))
    assert header == ALL_COLUMNS
    data = [dict(zip(header, row)) for row in rows]
    assert all(re.fullmatch(r"[a-z_ ]+( <- first)?", row["status"]) for row in data), data[:3]
    assert all(re.fullmatch(r"([\d,]+/[\d,]+)?", row["tokens equal"]) for row in data), data[:3]
    assert any("/" in row["tokens equal"] for row in data)
    assert any(row["status"].endswith(" <- first") for row in data)


@pytest.mark.parametrize("columns", [80, 100, 120, 200])
def test_the_table_fits_the_terminal_and_wraps_names_at_their_dots(runs, columns):
    output = compare(runs, columns)
    table = [line for line in output.splitlines() if line[:1] in "┏┃┡│└"]
    assert max(map(len, table)) <= columns
    header, rows = table_rows(output)
    # the most telling columns stay; the others go from the least telling, in that order
    assert header == ALL_COLUMNS[:len(header)] and len(header) >= 5, header
    names = {c["name"] for c in json.loads(compare(runs, columns, "--json"))["tensors"]}
    assert {row[1] for row in rows} == names   # every name whole, once its wrapped lines are joined
    for lines in name_lines(output):   # a name breaks only after a dot or before a bracket
        for line, after in itertools.pairwise(lines):
            assert line.endswith(".") or after.startswith("["), lines
    if len(header) < len(ALL_COLUMNS):
        assert f"(left out to fit the terminal: {', '.join(ALL_COLUMNS[len(header):])}; --wide or --json " \
               "shows all)" in " ".join(output.split())
    else:
        assert "left out" not in output


def test_wide_shows_every_column_and_whole_names_on_a_narrow_terminal(runs):
    output = compare(runs, 80, "--wide")
    header, _ = table_rows(output)
    assert header == ALL_COLUMNS and "left out" not in output
    assert all(len(lines) == 1 for lines in name_lines(output))   # no name wrapped


def test_names_wrap_between_words_and_cosines_near_one_show_their_distance():
    from tdiff.report.console import fmt_cosine, wrap_name

    assert wrap_name("model.layers.1.self_attn.o_proj[0]", 15) == ["model.layers.1.", "self_attn.", "o_proj[0]"]
    assert wrap_name("model.layers.1.post_attention_layernorm", 24) == ["model.layers.1.",
                                                                        "post_attention_layernorm"]
    assert fmt_cosine(1 - 3e-9, 6) == "1-3e-09" and fmt_cosine(0.5, 6) == "0.500000" and fmt_cosine(1.0, 6) == "1-<1e-15"
