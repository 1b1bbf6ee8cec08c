"""The HTML report: self-contained, and its plots drawn in headless Chromium."""

import re

import torch

import tdiff
from tdiff.bisect import bisect_dumps
from tdiff.compare.engine import compare_dumps
from tdiff.report.html import render_html
from tdiff.report.model import build_report
from tdiff.store import open_dump
from tests.helpers import tdiff_process, tiny_qwen2, token_ids
from tests.report.chromium import measure_figures, screenshot

PLOTS = {"plot-growth", "plot-heatmap", "plot-tokens"}


def test_demo_html_report_opens_in_chromium_with_its_plots_drawn(demo_dumps, tmp_path):
    a, b, _ = demo_dumps
    out = tmp_path / "r.html"
    result = tdiff_process("report", a, b, "--format", "html", "-o", out)
    assert result.returncode == 1, result.stderr
    page = out.read_text(encoding="utf-8")
    assert_self_contained(page)
    figures = {f["id"]: f for f in measure_figures(out, tmp_path)}
    assert set(figures) == PLOTS
    for figure in figures.values():
        assert figure["width"] > 300 and figure["height"] > 150, figure
        assert figure["drawn"] > 20, figure   # axes, curves, cells and glyphs, laid out by the browser
    png = screenshot(out, tmp_path / "r.png")
    from matplotlib.image import imread

    pixels = imread(png)[..., :3]
    assert (pixels.mean(axis=-1) < 0.9).mean() > 0.05  # a page of plots, not a blank one


def assert_self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<(script|link|iframe|object|embed)\b", page, re.IGNORECASE)
    assert not re.search(r"""(?:src|href)\s*=\s*["'](?!#|data:)""", page, re.IGNORECASE)
    assert not re.search(r"url\((?!#|data:)", page)
    assert "@import" not in page


def test_html_contents_follow_the_report(demo_dumps):
    a, b, _ = demo_dumps
    page = render_html(build_report(compare_dumps(open_dump(a), open_dump(b))))
    assert '<span class="verdict-diverged">diverged</span>' in page
    assert "<code>model.layers.1.post_attention_layernorm</code>" in page
    for plot in PLOTS:
        assert re.search(rf'<figure class="plot" id="{plot}">\s*<h2>[^<]+</h2>\s*<svg', page)
    assert '<table id="layers">' in page and '<table id="boundaries">' in page
    assert page.count("<svg") == 3


def test_the_bisect_answer_comes_right_under_the_headline_above_the_plots(demo_dumps):
    a, b, _ = demo_dumps
    bisected = bisect_dumps(open_dump(a), open_dump(b))
    page = render_html(build_report(compare_dumps(open_dump(a), open_dump(b)), bisect=bisected))
    counts_line = page.index("tensors differ (bitwise)")
    bisect = page.index('<h2 id="bisect">')
    assert counts_line < bisect < page.index("Introduced at") < page.index('id="plot-growth"') \
        < page.index('<table id="layers">')


def test_the_same_dump_as_a_and_b_is_called_the_same_dump(demo_dumps):
    a, _, a2 = demo_dumps
    same = render_html(build_report(compare_dumps(open_dump(a), open_dump(a))))
    assert f"A and B are the same dump (<code>{a}</code>)" in same
    assert "same dump" not in render_html(build_report(compare_dumps(open_dump(a), open_dump(a2))))


def test_html_of_a_match_draws_flat_plots_and_no_token_plot(demo_dumps):
    a, _, a2 = demo_dumps
    page = render_html(build_report(compare_dumps(open_dump(a), open_dump(a2))))
    assert '<span class="verdict-match">match</span>' in page
    assert 'id="plot-growth"' in page and 'id="plot-heatmap"' in page and 'id="plot-tokens"' not in page
    assert "bitwise equal everywhere" in page  # matplotlib keeps drawn text as an SVG comment


def test_stats_mode_dumps_report_unmeasured_divergence(tmp_path):
    model = tiny_qwen2(layers=2)
    for side in ("a", "b"):
        if side == "b":
            with torch.no_grad():
                model.model.layers[1].mlp.up_proj.weight[0, 0] += 0.5
        with torch.no_grad(), tdiff.capture(tmp_path / side, mode="stats"):
            model(token_ids())
    report = build_report(compare_dumps(open_dump(tmp_path / "a"), open_dump(tmp_path / "b")))
    assert report.culprit.comparison.name == "model.layers.1.mlp.up_proj"
    assert report.culprit.tokens is None and "stats mode" in report.culprit.tokens_note
    up = next(row for row in report.boundaries if (row.layer, row.boundary) == (1, "mlp.up_proj"))
    assert up.unmeasured == up.diverged == 1 and up.mismatch_fraction is None
    page = render_html(report)
    assert "No per-token plot: captured in stats mode" in page and "1/1 (1 unmeasured)" in page
    assert 'id="plot-heatmap"' in page and 'id="plot-tokens"' not in page
    # a match row of a stats dump is measured by its fingerprint: bitwise equal
    gate = next(row for row in report.boundaries if (row.layer, row.boundary) == (1, "mlp.gate_proj"))
    assert gate.diverged == 0 and gate.mismatch_fraction == 0.0


def test_the_heatmap_under_a_tolerance_says_so_and_tells_bits_that_differ_from_equal_ones(demo_dumps):
    from tdiff.compare.engine import CompareOptions
    from tdiff.compare.metrics import Tolerance
    from tdiff.report.plots import WITHIN, figures

    a, b, _ = (open_dump(path) for path in demo_dumps)
    loose = build_report(compare_dumps(a, b, CompareOptions(tolerance=Tolerance(atol=1.0))))
    assert loose.status == "match" and any(row.mismatched and not row.outside for row in loose.boundaries)
    heatmap = next(f for f in figures(loose) if f.key == "plot-heatmap")
    assert "outside atol=1 rtol=0" in heatmap.caption and "bits differ" not in heatmap.caption.split(".")[0]
    assert "blue: within the tolerance, some bits differ" in heatmap.caption
    assert "elements outside atol=1" in heatmap.svg and f"fill: {WITHIN}" in heatmap.svg
    bitwise = next(f for f in figures(build_report(compare_dumps(a, b))) if f.key == "plot-heatmap")
    assert bitwise.caption.startswith("Fraction of elements whose bits differ. Green: bitwise equal;")
    assert f"fill: {WITHIN}" not in bitwise.svg
