"""The Markdown report: the culprit and the tables, the size limit, bisect and patch sections."""

import json
import re
from dataclasses import replace

import numpy as np
import torch

import tdiff
from tdiff.bisect import bisect_dumps
from tdiff.compare.engine import compare_dumps
from tdiff.compare.metrics import ulp_at, ulp_distance
from tdiff.report.console import fmt_number
from tdiff.report.markdown import COMMENT_LIMIT, GH_MARKER, render_markdown
from tdiff.report.model import build_report
from tdiff.source_patcher.trial import TrialDivergence, TrialReport, TrialResult
from tdiff.store import open_dump
from tests.helpers import tdiff_cli

PLANTED = "model.layers.1.post_attention_layernorm"


def planted_pair(demo_dumps) -> tuple[torch.Tensor, torch.Tensor]:
    """The planted norm's output in the reference and the planted run, read from the dumps."""
    a, b, _ = demo_dumps
    return tuple(dump.load(next(r for r in dump.records if r.name == PLANTED and r.role == "output"))
                 for dump in (open_dump(a), open_dump(b)))


def planted_figures(demo_dumps) -> dict:
    """What the report should say about the planted norm, computed here from its tensors: bf16
    kernels differ between CPUs (AVX2, AVX-512), so these figures are never literals."""
    ta, tb = planted_pair(demo_dumps)
    differs = ta.view(torch.int16) != tb.view(torch.int16)
    return {"mismatched": int(differs.sum()), "numel": ta.numel(),
            "percent": f"{100 * differs.float().mean().item():.3g}%",
            "max_abs": fmt_number((ta.float() - tb.float()).abs().max().item()),
            "max_ulp": fmt_number(int(ulp_distance(ta, tb).max())),
            "at_scale": fmt_number((ta.float() - tb.float()).abs().max().item()
                                   / ulp_at(max(ta.float().abs().max().item(), tb.float().abs().max().item()),
                                            ta.dtype))}


def differing_tensors(demo_dumps) -> int:
    """How many recorded tensors differ bitwise between the reference and the planted run."""
    a, b, _ = demo_dumps
    dump_a, dump_b = open_dump(a), open_dump(b)
    by_key = {r.pair_key: r for r in dump_b.records}
    return sum(not np.array_equal(dump_a.load(r).view(torch.uint8).numpy(),
                                  dump_b.load(by_key[r.pair_key]).view(torch.uint8).numpy())
               for r in dump_a.records)


def table_rows(markdown: str, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header line starts with ``header``, as cells."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def test_planted_case_names_the_culprit_and_tabulates_layers_and_boundaries(demo_dumps):
    a, b, _ = demo_dumps
    result = tdiff_cli("report", a, b, expect=1)
    text = result.stdout
    figures = planted_figures(demo_dumps)
    assert text.startswith("## tdiff: a vs b")
    assert f"**Diverged:** first divergence at `{PLANTED}` (output, layer 1" in text
    assert (f"boundary `post_attention_layernorm`): {figures['mismatched']:,}/{figures['numel']:,} elements "
            f"differ ({figures['percent']}), max abs {figures['max_abs']}, ULP at scale {figures['at_scale']} "
            f"(raw max ULP {figures['max_ulp']})") in text
    layers = table_rows(text, "| layer | tensors differ | first differing boundary")
    assert [row[0] for row in layers] == ["before layers", "0", "**1** ◀ first", "2", "3", "after layers"]
    assert layers[1][1:3] == ["0/13", "-"]
    assert layers[2][2] == "`post_attention_layernorm`"
    boundaries = table_rows(text, "| layer | boundary | kind |")
    culprit = [row for row in boundaries if row[1].startswith("`post_attention_layernorm` ◀ first")]
    assert len(culprit) == 1 and culprit[0][0] == "1" and culprit[0][3:] == ["1/1", figures["percent"],
                                                                         figures["max_abs"], figures["at_scale"]]
    assert {row[1] for row in boundaries if row[0] == "0"} >= {"`self_attn.q_proj`", "`mlp.down_proj`",
                                                               "`input_layernorm`", "`(layer)`"}
    assert all(row[3] == "0/1" for row in boundaries if row[0] == "0")
    assert "<details>" in text and len(text) <= COMMENT_LIMIT
    env = {row[0]: row[1:] for row in table_rows(text, "|   | A: a | B: b |")}
    assert env["torch"] == [torch.__version__] * 2
    assert env["tdiff"] == [tdiff.__version__] * 2
    assert env["device"] == ["cpu ×143"] * 2 and env["dtypes"][0].startswith("bfloat16 ×130")
    assert all(key in env for key in ("transformers", "megatron-core", "sglang"))


def test_identical_runs_report_a_match_and_exit_0(demo_dumps):
    a, _, a2 = demo_dumps
    text = tdiff_cli("report", a, a2, expect=0).stdout
    assert "**Match:** all 143 tensors are bitwise equal." in text
    assert "first divergence" not in text and "◀ first" not in text


def test_gh_comment_prints_the_marker_and_refuses_other_formats(demo_dumps):
    a, b, _ = demo_dumps
    text = tdiff_cli("report", a, b, "--gh-comment", expect=1).stdout
    assert text.startswith(GH_MARKER + "\n## tdiff: a vs b") and len(text) <= COMMENT_LIMIT
    for extra in (["--format", "html"], ["-o", "x.md"]):
        result = tdiff_cli("report", a, b, "--gh-comment", *extra, expect=2)
        assert "--gh-comment prints Markdown on standard output" in result.output


def test_output_file_and_json_format(demo_dumps, tmp_path):
    a, b, _ = demo_dumps
    result = tdiff_cli("report", a, b, "--format", "json", "-o", tmp_path / "r.json", expect=1)
    assert "tdiff: wrote" in result.stderr and result.stdout == ""
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["status"] == "diverged" and data["culprit"]["tensor"]["name"] == PLANTED
    assert data["culprit"]["boundary"] == "post_attention_layernorm" and data["culprit"]["layer"] == 1
    tokens = data["culprit"]["tokens"]
    assert tokens["axis"] == 1 and tokens["shape"] == [1, 24, 64] and len(tokens["max_abs"]) == 24
    ta, tb = planted_pair(demo_dumps)
    per_token = (ta.view(torch.int16) != tb.view(torch.int16)).sum(dim=(0, 2))
    assert tokens["mismatched"] == per_token.tolist()  # the differing elements, spread over the tokens
    assert [row["label"] for row in data["layers"]] == ["before layers", "0", "1", "2", "3", "after layers"]
    assert len(data["diverged_tensors"]) == data["summary"]["compared"] - data["summary"]["match"] \
        == differing_tensors(demo_dumps)
    assert set(data["environment"]) == {"a", "b", "report_host"}
    quiet = tdiff_cli("report", a, b, "--format", "json", "-o", tmp_path / "q.json", "--quiet", expect=1)
    assert quiet.output == ""


def test_bad_input_exits_2_with_one_line(demo_dumps, tmp_path):
    a, b, _ = demo_dumps
    (tmp_path / "bad.json").write_text('{"control": {}}')
    (tmp_path / "broken.json").write_text("{")
    for args, message in [((a, tmp_path / "nope"), "no such dump directory"),
                          ((a, b, "--patch-results", tmp_path / "missing.json"), "no such file"),
                          ((a, b, "--patch-results", tmp_path / "bad.json"), "not the JSON of `tdiff patch try"),
                          ((a, b, "--patch-results", tmp_path / "broken.json"), "not JSON"),
                          ((a, b, "--exact", "--atol", "1"), "--exact cannot be combined")]:
        result = tdiff_cli("report", *args, expect=2)
        assert message in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_bisect_flag_adds_the_bisect_result(demo_dumps):
    a, b, _ = demo_dumps
    result = tdiff_cli("report", a, b, "--bisect", expect=1)
    section = result.stdout.split("### Bisect")[1]
    assert f"Introduced at** `{PLANTED}` (output, kind norm, layer 1" in section


def demo_report(demo_dumps, **extra):
    a, b, _ = demo_dumps
    return build_report(compare_dumps(open_dump(a), open_dump(b)), **extra)


def test_bisect_section_renders_the_bisect_result(demo_dumps):
    a, b, a2 = demo_dumps
    bisected = bisect_dumps(a, b)
    figures = planted_figures(demo_dumps)
    text = render_markdown(demo_report(demo_dumps, bisect=bisected))
    section = text.split("### Bisect")[1]
    assert (f"**Introduced at** `{PLANTED}` (output, kind norm, layer 1, step 0); "
            f"{bisected.checked:,} events checked.") in section
    rows = {row[0]: row[1] for row in table_rows(section, "|   | value |")}
    assert rows["kind"] == "norm" and rows["max ULP"] == figures["max_ulp"] and rows["mismatch"] == figures["percent"]
    assert rows["max abs"] == figures["max_abs"] and rows["module (B)"] == f"`{PLANTED}`"
    assert [t.module for t in bisected.trail] == ["model.layers.1", "model", ""]
    assert rows["trail (enclosing modules that also differ)"] == ", ".join(f"`{t.name}`" for t in bisected.trail)

    between = replace(bisected, first_divergence=replace(bisected.first_divergence, event="between",
                                                         introduced=False, name="model.layers.1 forward"))
    text = render_markdown(demo_report(demo_dumps, bisect=between))
    assert "**First differs at** `model.layers.1 forward` (between" in text
    assert "could not prove the divergence is introduced here" in text
    matched = bisect_dumps(a, a2)
    text = render_markdown(demo_report(demo_dumps, bisect=matched))
    assert f"**Match:** bisect found no divergence ({matched.checked:,} events checked)." in text


def test_patch_results_become_a_ranked_table(demo_dumps, tmp_path):
    a, b, _ = demo_dumps
    first = TrialDivergence(name=PLANTED, module=PLANTED, role="output", step=0, call=0, rank=0,
                            status="mismatch", kind="norm", position=61)

    def trial(name, status, **figures):
        return TrialResult(name=name, patches=[name], status=status, dump=f"w/{name}", log=f"w/{name}.log",
                           **figures)

    trials = TrialReport(
        baseline=str(a), command=["python", "run.py"], workdir="w", tolerance="bitwise",
        control=trial("control", "diverged", first_divergence=first, position=61, mismatched=71, max_ulp=29979,
                      max_ulp_at_scale=2.5),
        candidates=[trial("fp32-rmsnorm", "match", mismatched=0, max_ulp=0, max_ulp_at_scale=0.0),
                    trial("fp32-rope", "diverged", first_divergence=first, position=61, moved_by=0,
                          mismatched=71, max_ulp=29979, max_ulp_at_scale=2.5)])
    (tmp_path / "trials.json").write_text(json.dumps(trials.to_json()))
    assert TrialReport.from_json(json.loads((tmp_path / "trials.json").read_text())) == trials
    text = tdiff_cli("report", a, b, "--patch-results", tmp_path / "trials.json", expect=1).stdout
    rows = table_rows(text, "| candidate | status |")
    assert rows == [["**control** (unpatched)", "diverged", f"`{PLANTED}`", "-", "71", "2.5"],   # ULP at scale
                    ["`fp32-rmsnorm` ★ best", "match", "-", "-", "0", "0"],
                    ["`fp32-rope`", "diverged", f"`{PLANTED}`", "0", "71", "2.5"]]
    reported = tdiff_cli("report", a, b, "--patch-results", tmp_path / "trials.json", "--format", "json", expect=1)
    assert json.loads(reported.stdout)["patch_results"] == trials.to_json()  # the trials' JSON, as written


def test_names_with_markdown_syntax_keep_the_table_intact(tmp_path):
    for side, scale in (("a", 1.0), ("b", 2.0)):
        with tdiff.capture(tmp_path / side):
            tdiff.dump("odd|name`with*syntax_", torch.ones(3) * scale)
            tdiff.dump("plain", torch.zeros(2))
    text = render_markdown(build_report(compare_dumps(open_dump(tmp_path / "a"), open_dump(tmp_path / "b"))))
    assert "first divergence at ``odd|name`with*syntax_``" in text  # a pipe is escaped in tables only
    rows = table_rows(text, "| layer | boundary | kind |")
    assert [row[1] for row in rows] == ["``odd\\|name`with*syntax_`` ◀ first", "`plain`"]
    assert all(len(row) == 7 for row in rows)


def test_a_sign_flip_near_zero_reads_at_the_tensors_scale_and_json_keeps_raw_ulp(tmp_path):
    from tdiff.compare.metrics import compare_tensors
    from tdiff.report.console import fmt_number

    values = {"a": torch.tensor([3.0, 1e-9, -2.0]), "b": torch.tensor([3.0, -1e-9, -2.0])}
    for side, tensor in values.items():
        with tdiff.capture(tmp_path / side):
            tdiff.dump("x", tensor)
    m = compare_tensors(values["a"], values["b"])
    text = tdiff_cli("report", tmp_path / "a", tmp_path / "b", expect=1).output
    assert f"ULP at scale {fmt_number(m.max_ulp_at_scale)} (raw max ULP {m.max_ulp:,})" in text
    layers = table_rows(text, "| layer | tensors differ | first differing boundary")
    assert [row[-1] for row in layers] == [fmt_number(m.max_ulp_at_scale)]
    rows = json.loads(tdiff_cli("report", tmp_path / "a", tmp_path / "b", "--format", "json", expect=1).output)
    [row] = rows["boundaries"]
    assert (row["max_ulp"], row["max_ulp_at_scale"]) == (m.max_ulp, m.max_ulp_at_scale)
    compared = json.loads(tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--json", expect=1).output)
    assert compared["first_divergence"]["metrics"]["max_ulp"] == m.max_ulp > 1e9
    assert compared["first_divergence"]["metrics"]["max_ulp_at_scale"] == m.max_ulp_at_scale < 0.01
