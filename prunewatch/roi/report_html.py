"""Render the report's blocks to one self-contained HTML file (charts inlined as PNG data URIs)."""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path

from prunewatch.roi import report as content

_CSS = """
body{font-family:"DejaVu Sans",Helvetica,Arial,sans-serif;color:#1b1f24;max-width:860px;margin:32px auto;
padding:0 20px;font-size:15px;line-height:1.5}
h1{font-size:28px;margin-bottom:2px}.subtitle{color:#5b6570;font-size:13px;margin-bottom:18px}
h2{font-size:20px;margin-top:30px;border-bottom:1px solid #c9d1d9;padding-bottom:4px}
table{border-collapse:collapse;width:100%;margin:8px 0 14px;font-size:13px}
th{background:#eef2f6;text-align:left}th,td{padding:5px 8px;border-bottom:1px solid #c9d1d9;vertical-align:top}
tr.total td{font-weight:bold}.small{color:#5b6570;font-size:12px}
figure{margin:14px 0}figure img{max-width:100%}figcaption{color:#5b6570;font-size:12px}
.row{display:flex;gap:16px}.row figure{flex:1 1 0}
@media print{figure,table{page-break-inside:avoid}}
"""


def _figure(chart: content.Chart, width_pct: float) -> str:
    encoded = base64.b64encode(chart.png).decode("ascii")
    return (f'<figure><img style="width:{width_pct:.0f}%" alt="{escape(chart.caption)}" '
            f'src="data:image/png;base64,{encoded}"><figcaption>{escape(chart.caption)}</figcaption></figure>')


def render_html(data: content.ReportData) -> str:
    """The report as an HTML document string."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{escape(data.title)}</title><style>{_CSS}</style></head><body>"]
    for block in data.blocks:
        if isinstance(block, content.Title):
            parts.append(f"<h1>{escape(block.text)}</h1><div class=\"subtitle\">{escape(block.subtitle)}</div>")
        elif isinstance(block, content.Heading):
            parts.append(f"<h2>{escape(block.text)}</h2>")
        elif isinstance(block, content.Para):
            parts.append(f"<p class=\"small\">{block.markup}</p>" if block.small else f"<p>{block.markup}</p>")
        elif isinstance(block, content.Bullets):
            parts.append("<ul>" + "".join(f"<li>{item}</li>" for item in block.items) + "</ul>")
        elif isinstance(block, content.Table):
            head = "".join(f"<th>{escape(text)}</th>" for text in block.header)
            rows = []
            for index, row in enumerate(block.rows):
                css = ' class="total"' if block.bold_last_row and index == len(block.rows) - 1 else ""
                rows.append(f"<tr{css}>" + "".join(f"<td>{escape(text)}</td>" for text in row) + "</tr>")
            if block.title:
                parts.append(f"<p><b>{escape(block.title)}</b></p>")
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
        elif isinstance(block, content.Chart):
            parts.append(_figure(block, block.width * 100))
        elif isinstance(block, content.ChartRow):
            parts.append('<div class="row">' + "".join(_figure(chart, 100) for chart in block.charts) + "</div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(data: content.ReportData, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(data), encoding="utf-8")
