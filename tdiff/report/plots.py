"""The HTML report's figures, drawn with matplotlib as inline SVG (no network, no script).

- growth: per-layer error of each boundary, on log scales (mismatch fraction, max abs, ULP at scale);
- heatmap: boundaries × layers, coloured by mismatch fraction;
- tokens: the culprit tensor's error per token;
- token grid: for a token-aligned culprit, its error over (sequence, position), the first
  differing token outlined.

matplotlib is imported here only, when an HTML report is made (``pip install torch-tdiff[report]``).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

from tdiff.errors import TdiffError
from tdiff.report.model import LAYER_ITSELF, BoundaryRow, Report

MAX_SERIES = 10                 # growth curves drawn; the heatmap shows every boundary
MAX_TOKEN_POINTS = 2048         # longer sequences are drawn as the maximum over bins of tokens
MAX_HEATMAP_ROWS = 80          # boundaries shown in the heatmap: the worst when there are more
ANNOTATE_CELLS = 300            # heatmaps up to this many cells print their values
EQUAL, MISSING, UNMEASURED = "#c7e9c0", "#eeeeee", "#6a3d9a"
WITHIN = "#9ecae1"   # under a tolerance: every element within it, some bits differ


@dataclass
class Figure:
    key: str        # the HTML id
    title: str
    svg: str
    caption: str


def figures(report: Report) -> list[Figure]:
    require_matplotlib()
    out = []
    if report.layer_numbers:
        out.append(Figure("plot-growth", "Error growth by layer", growth_svg(report),
                          "Per layer, for the layer's output and the boundaries with the largest errors "
                          f"(at most {MAX_SERIES}). Log scales: a boundary that is bitwise equal in a layer "
                          "has no point there."))
        boundaries = len({row.boundary for row in report.boundaries if row.layer is not None})
        shown = (f" Shown: the {MAX_HEATMAP_ROWS} boundaries with the largest errors of {boundaries}."
                 if boundaries > MAX_HEATMAP_ROWS else "")
        if report.tolerance == "bitwise":
            cells = "Fraction of elements whose bits differ. Green: bitwise equal; "
        else:
            cells = (f"Fraction of elements outside {report.tolerance}. Green: bitwise equal; blue: within "
                     "the tolerance, some bits differ; ")
        out.append(Figure("plot-heatmap", "Mismatch by boundary and layer", heatmap_svg(report),
                          cells + "grey: not captured; purple: differs, not measured (stats mode or one side "
                          "only). The first divergence is outlined." + shown))
    culprit = report.culprit
    if culprit is not None and culprit.tokens is not None:
        t = culprit.tokens
        out.append(Figure("plot-tokens", "Error per token of the first divergence", tokens_svg(report),
                          f"{culprit.comparison.name}: token axis is dim {t.axis} of shape {t.shape}; "
                          f"{t.per_token:,} elements per token."))
        if t.refs is not None:
            out.append(Figure("plot-token-grid", "First divergence over sequence and position",
                              token_grid_svg(report),
                              f"{culprit.comparison.name}: largest absolute difference per token, one row per "
                              "sequence pair (A / B), one column per position a token has. Green: the token's row passes "
                              "(equal bits, or within the tolerance); grey: not compared (one run lacks it); "
                              "purple: fails without an absolute difference (bits only, NaN). The first "
                              "differing token is outlined."))
    return out


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise TdiffError("the HTML report needs matplotlib: pip install 'torch-tdiff[report]'") from None
    return matplotlib


def _svg(fig, key: str) -> str:
    matplotlib = require_matplotlib()
    buffer = io.StringIO()
    # a salt per figure keeps SVG ids unique within the page, and the output reproducible
    with matplotlib.rc_context({"svg.hashsalt": key, "svg.fonttype": "path"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None}, dpi=150)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _new_figure(width: float, height: float):
    from matplotlib.figure import Figure as MplFigure

    return MplFigure(figsize=(width, height), layout="constrained")


# ---- growth curves ----
def growth_svg(report: Report) -> str:
    from matplotlib.ticker import MaxNLocator

    layers = report.layer_numbers
    series = _series(report)
    fig = _new_figure(13, 4.2)
    axes = fig.subplots(1, 3, sharex=True)
    panels = (("mismatch fraction", lambda r: r.outside_fraction), ("max abs", lambda r: r.max_abs),
              ("ULP at scale", lambda r: r.max_ulp_at_scale))
    culprit_layer = report.culprit.layer if report.culprit else None
    for ax, (title, metric) in zip(axes, panels):
        drawn = False
        for name, rows in series:
            ys = [_positive(metric(rows[n])) if n in rows else math.nan for n in layers]
            drawn |= any(not math.isnan(y) for y in ys)
            own = name == LAYER_ITSELF
            ax.plot(layers, ys, marker="o", markersize=3.5 if own else 2.5, linewidth=2.2 if own else 1.1,
                    color="black" if own else None, label="layer output" if own else name, zorder=3 if own else 2)
        if culprit_layer is not None:
            ax.axvline(culprit_layer, color="crimson", linestyle="--", linewidth=1, label="first divergence")
        if drawn:
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "bitwise equal everywhere", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
        ax.set_title(title)
        ax.set_xlim(layers[0] - 0.3, layers[-1] + 0.3)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    columns = max(1, min(len(labels), 150 // (max(map(len, labels)) + 8)))  # the legend fits the width
    fig.legend(handles, labels, loc="outside lower center", ncol=columns, fontsize="small", frameon=False)
    return _svg(fig, "growth")


def _series(report: Report) -> list[tuple[str, dict[int, BoundaryRow]]]:
    """The layer output first, then the boundaries with the largest errors, at most MAX_SERIES."""
    by_name: dict[str, dict[int, BoundaryRow]] = {}
    for row in report.boundaries:
        if row.layer is not None:
            by_name.setdefault(row.boundary, {})[row.layer] = row
    culprit = report.culprit.boundary if report.culprit and report.culprit.layer is not None else None

    def rank(name: str) -> tuple:
        worst = max(row.severity() for row in by_name[name].values())
        return (name == LAYER_ITSELF, name == culprit, *worst)

    names = sorted(by_name, key=rank, reverse=True)[:MAX_SERIES]
    return [(name, by_name[name]) for name in names]


def _positive(value) -> float:
    return float(value) if value is not None and float(value) > 0 else math.nan


# ---- heatmap ----
def heatmap_svg(report: Report) -> str:
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter, NullFormatter

    layers = report.layer_numbers
    names = _heatmap_rows(report)
    row_of = {name: i for i, name in enumerate(names)}
    column = {n: j for j, n in enumerate(layers)}
    values = np.full((len(names), len(layers)), np.nan)
    within: list[tuple[int, int]] = []      # cells within the tolerance whose bits differ
    for row in report.boundaries:
        if row.layer is None or row.boundary not in row_of:
            continue
        i, j = row_of[row.boundary], column[row.layer]
        if row.unmeasured and not row.outside:
            values[i, j] = 2.0              # above the scale: "differs, not measured" colour
        else:
            values[i, j] = row.outside_fraction or 0.0
            if not row.outside and row.mismatched:
                within.append((i, j))
    measured = values[(values > 0) & (values <= 1)]
    low = float(measured.min()) if measured.size else 1e-6
    low = min(low, 0.5)
    values[values == 0] = low / 10          # below the scale: "equal" colour
    cmap = colormaps["YlOrRd"].with_extremes(under=EQUAL, over=UNMEASURED, bad=MISSING)
    fig = _new_figure(min(16, max(6.5, 0.42 * len(layers) + 4)), min(40, max(3.2, 0.3 * len(names) + 1.6)))
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=LogNorm(vmin=low, vmax=1.0),
                      aspect="auto", interpolation="nearest")
    for i, j in within:
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=WITHIN, edgecolor="none"))
    bar = fig.colorbar(image, ax=ax, extend="both", label="elements that differ" if report.tolerance == "bitwise"
                       else f"elements outside {report.tolerance}")
    percent = FuncFormatter(lambda value, _: f"{100 * value:.3g}%")
    bar.ax.yaxis.set_major_formatter(percent)
    # minor ticks are labelled only when the scale spans less than a decade (no major tick but 100%)
    bar.ax.yaxis.set_minor_formatter(percent if low >= 0.1 else NullFormatter())
    ax.set_yticks(range(len(names)), names, fontsize="small")
    if len(layers) <= 40:
        ax.set_xticks(range(len(layers)), [str(n) for n in layers])
    ax.set_xlabel("layer")
    if values.size <= ANNOTATE_CELLS:
        for (i, j), value in np.ndenumerate(values):
            if low / 10 < value <= 1:
                ax.text(j, i, f"{100 * value:.2g}%", ha="center", va="center", fontsize=6.5,
                        color="white" if value > 0.3 else "black")
    culprit = report.culprit
    if culprit is not None and culprit.layer in column and culprit.boundary in row_of:
        i, j = row_of[culprit.boundary], column[culprit.layer]
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="crimson", linewidth=2))
    return _svg(fig, "heatmap")


def _heatmap_rows(report: Report) -> list[str]:
    """Boundary names in execution order; past MAX_HEATMAP_ROWS, those with the largest errors."""
    rows: dict[str, tuple] = {}
    for row in report.boundaries:
        if row.layer is not None:
            rows[row.boundary] = max(rows.get(row.boundary, ()), row.severity())
    if len(rows) <= MAX_HEATMAP_ROWS:
        return list(rows)
    culprit = report.culprit.boundary if report.culprit else None
    kept = set(sorted(rows, key=lambda name: (name == culprit, rows[name]), reverse=True)[:MAX_HEATMAP_ROWS])
    return [name for name in rows if name in kept]


# ---- per-token error ----
def tokens_svg(report: Report) -> str:
    from matplotlib.ticker import MaxNLocator

    t = report.culprit.tokens
    count = len(t.max_abs)
    size = max(1, math.ceil(count / MAX_TOKEN_POINTS))
    starts = list(range(0, count, size))
    max_abs = [max(t.max_abs[s:s + size]) for s in starts]
    fraction = [max(t.differing[s:s + size]) / t.per_token if t.per_token else 0.0 for s in starts]
    fig = _new_figure(13, 4.6)
    top, bottom = fig.subplots(2, 1, sharex=True)
    ys = [_positive(v) for v in max_abs]
    top.plot(starts, ys, marker="o" if len(starts) <= 200 else None, markersize=3, linewidth=1, color="crimson")
    if any(not math.isnan(y) for y in ys):
        top.set_yscale("log")
    top.set_ylabel("max abs error")
    top.grid(True, alpha=0.3)
    bottom.bar(starts, fraction, width=size * 0.9, align="edge" if size > 1 else "center", color="#4c72b0")
    bottom.set_ylim(0, 1)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("fraction differing")
    binned = f" (maximum over bins of {size} tokens)" if size > 1 else ""
    order = " in order of A's sequence and position" if t.refs is not None else ""
    bottom.set_xlabel(f"token (dim {t.axis} of {t.shape}{order}){binned}")
    worst = t.worst
    if worst is not None:
        top.axvline(worst, color="gray", linestyle=":", linewidth=1)
        top.annotate(f"worst: {t.label(worst)}", (worst, 1), xycoords=("data", "axes fraction"),
                     xytext=(4, -12), textcoords="offset points", fontsize="small")
    return _svg(fig, "tokens")


# ---- first divergence over (sequence, position) ----
def token_grid_svg(report: Report) -> str:
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    culprit = report.culprit
    t = culprit.tokens
    sequences = sorted({(ref.seq_a, ref.seq_b) for ref in t.refs})
    row_of = {pair: i for i, pair in enumerate(sequences)}
    # one column per position some token has: a grid over the positions' span would take memory
    # for every position in between (a dump's positions may be 10^9 apart)
    positions = sorted({ref.position for ref in t.refs})
    column_of = {position: i for i, position in enumerate(positions)}
    width = len(positions)
    values = np.full((len(sequences), width), np.nan)
    for ref, max_abs, differing in zip(t.refs, t.max_abs, t.differing):
        cell = (row_of[(ref.seq_a, ref.seq_b)], column_of[ref.position])
        if not differing:
            values[cell] = 0.0
        elif max_abs > 0:
            values[cell] = max_abs
        else:
            values[cell] = np.inf
    finite = values[np.isfinite(values) & (values > 0)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (1e-9, 1.0)
    high = max(high, low * 10)
    values[values == 0] = low / 10          # below the scale: "passes" colour
    values[np.isposinf(values)] = high * 10  # above the scale: "fails, no absolute difference"
    cmap = colormaps["YlOrRd"].with_extremes(under=EQUAL, over=UNMEASURED, bad=MISSING)
    fig = _new_figure(min(16, max(6.5, 0.12 * width + 4)), min(20, max(2.6, 0.35 * len(sequences) + 1.6)))
    ax = fig.subplots()
    extent = (-0.5, width - 0.5, len(sequences) - 0.5, -0.5)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=LogNorm(vmin=low, vmax=high), aspect="auto",
                      interpolation="nearest", extent=extent)
    fig.colorbar(image, ax=ax, extend="both", label="max abs error")
    ax.set_yticks(range(len(sequences)), [f"{a} / {b}" for a, b in sequences], fontsize="small")
    ax.set_ylabel("sequence (A / B)")
    ax.set_xlabel("position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(
        lambda x, _: str(positions[int(x)]) if x == int(x) and 0 <= x < width else ""))
    first = culprit.comparison.tokens.first_differing if culprit.comparison.tokens is not None else None
    if first is not None and (first.seq_a, first.seq_b) in row_of and first.position in column_of:
        row, column = row_of[(first.seq_a, first.seq_b)], column_of[first.position]
        ax.add_patch(Rectangle((column - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="crimson",
                               linewidth=2))
        ax.annotate(f"first: position {first.position}", (column, row), xytext=(6, -10),
                    textcoords="offset points", fontsize="small", color="crimson")
    return _svg(fig, "token-grid")
