"""The HTML report: one self-contained file (inline CSS and SVG; no script, font or network
fetch) with the Markdown report's content and its figures."""

from __future__ import annotations

from html import escape

from tdiff.report.document import Code, Heading, Inline, Paragraph, Plots, Strong, Table, build_document
from tdiff.report.model import Report
from tdiff.report.plots import figures

HTML_ROWS = 5000    # rows per table; the JSON report has every row

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1280px;
       padding: 0 1.5em; color: #1f2328; }
h1 { font-size: 1.6em; margin-bottom: .3em; } h2 { font-size: 1.25em; margin-top: 1.6em; }
code { font: 12.5px ui-monospace, SFMono-Regular, Menlo, monospace; background: #f3f4f6; padding: 0 .25em;
       border-radius: 3px; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: 13px; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; vertical-align: top; }
th { background: #f6f8fa; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
caption { caption-side: bottom; text-align: left; color: #59636e; font-size: 12px; padding-top: 3px; }
figure { margin: 1.2em 0; } figure svg { max-width: 100%; height: auto; }
figcaption { color: #59636e; font-size: 12.5px; } .verdict-diverged { color: #b42318; }
.verdict-match { color: #1a7f37; } details > summary { cursor: pointer; font-weight: 600; margin: .6em 0; }
"""


def render_html(report: Report) -> str:
    doc = build_document(report)
    verdict = "match" if report.status == "match" else "diverged"
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{escape(doc.title)}</title>", f"<style>{STYLE}</style>", "</head>", "<body>",
           f'<h1>{escape(doc.title)} — <span class="verdict-{verdict}">{verdict}</span></h1>']
    for block in doc.blocks:
        if isinstance(block, Heading):
            out.append(f'<h2 id="{block.key}">{escape(block.text)}</h2>')
        elif isinstance(block, Paragraph):
            out.append(f"<p>{inline(block.parts)}</p>")
        elif isinstance(block, Table):
            out.append(_table(block))
        elif isinstance(block, Plots):
            out += [_figure(f) for f in figures(report)]
            if not report.layer_numbers:
                out.append("<p>No per-layer plots: the dumps hold no tensors of decoder layers.</p>")
            if report.culprit is not None and report.culprit.tokens is None:
                out.append(f"<p>No per-token plot: {escape(report.culprit.tokens_note or '')}.</p>")
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


def _figure(figure) -> str:
    return (f'<figure class="plot" id="{figure.key}">\n<h2>{escape(figure.title)}</h2>\n{figure.svg}\n'
            f"<figcaption>{escape(figure.caption)}</figcaption>\n</figure>")


def _table(table: Table) -> str:
    kept = table.kept(HTML_ROWS)
    head = "".join(f"<th>{escape(c)}</th>" for c in table.columns)
    body = []
    for i in kept:
        cells = "".join(f'<td class="num">{inline(cell)}</td>' if j in table.numeric else f"<td>{inline(cell)}</td>"
                        for j, cell in enumerate(table.rows[i]))
        body.append(f"<tr>{cells}</tr>")
    notes = [table.note] if table.note else []
    if len(kept) < len(table.rows):
        notes.append(f"{len(table.rows) - len(kept):,} more rows in `tdiff report --format json`")
    caption = f"<caption>{escape('; '.join(notes))}</caption>" if notes else ""
    html = (f'<table id="{table.key}">{caption}<thead><tr>{head}</tr></thead>\n<tbody>\n' + "\n".join(body)
            + "\n</tbody></table>")
    if table.folded:
        return f"<details><summary>{escape(table.title or table.key)}</summary>\n{html}\n</details>"
    return f"<h2>{escape(table.title)}</h2>\n{html}" if table.title else html


def inline(parts: Inline) -> str:
    parts = (parts,) if isinstance(parts, str) else parts
    out = []
    for part in parts:
        if isinstance(part, Code):
            out.append(f"<code>{escape(part)}</code>")
        elif isinstance(part, Strong):
            out.append(f"<strong>{escape(part)}</strong>")
        else:
            out.append(escape(part))
    return "".join(out)
