"""Render the report's blocks to an A4 PDF with reportlab (DejaVu Sans, bundled with matplotlib)."""

from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path
from xml.sax.saxutils import escape

import matplotlib
from reportlab.lib import colors
from reportlab.lib.enums import TA_LEFT
from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import ParagraphStyle
from reportlab.lib.units import mm
from reportlab.pdfbase import pdfmetrics
from reportlab.pdfbase.ttfonts import TTFont
from reportlab.platypus import (
    Image,
    KeepTogether,
    ListFlowable,
    ListItem,
    Paragraph,
    SimpleDocTemplate,
    Spacer,
    TableStyle,
)
from reportlab.platypus import Table as PdfTable

from prunewatch.roi import report as content

FONT, FONT_BOLD = "DejaVuSans", "DejaVuSans-Bold"
MARGIN = 18 * mm
LONG_TABLE_ROWS = 8
INK, MUTED, RULE, BAND = colors.HexColor("#1b1f24"), colors.HexColor("#5b6570"), colors.HexColor("#c9d1d9"), colors.HexColor("#eef2f6")


@lru_cache(maxsize=1)
def _fonts() -> None:
    """DejaVu Sans has ×, −, ± and €, which the PDF base fonts lack; matplotlib ships it, so it is always there."""
    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    pdfmetrics.registerFont(TTFont(FONT, str(folder / "DejaVuSans.ttf")))
    pdfmetrics.registerFont(TTFont(FONT_BOLD, str(folder / "DejaVuSans-Bold.ttf")))
    pdfmetrics.registerFontFamily(FONT, normal=FONT, bold=FONT_BOLD, italic=FONT, boldItalic=FONT_BOLD)


def _styles() -> dict[str, ParagraphStyle]:
    base = ParagraphStyle("body", fontName=FONT, fontSize=9.5, leading=13.5, textColor=INK, alignment=TA_LEFT,
                          spaceAfter=5)
    return {
        "title": ParagraphStyle("title", parent=base, fontName=FONT_BOLD, fontSize=20, leading=24, spaceAfter=2),
        "subtitle": ParagraphStyle("subtitle", parent=base, fontSize=9, textColor=MUTED, spaceAfter=10),
        "heading": ParagraphStyle("heading", parent=base, fontName=FONT_BOLD, fontSize=13.5, leading=17,
                                  spaceBefore=8, spaceAfter=5),
        "table_title": ParagraphStyle("table_title", parent=base, fontName=FONT_BOLD, spaceBefore=3, spaceAfter=3,
                                      keepWithNext=1),
        "table_title_long": ParagraphStyle("table_title_long", parent=base, fontName=FONT_BOLD, spaceBefore=3,
                                           spaceAfter=3),
        "body": base,
        "small": ParagraphStyle("small", parent=base, fontSize=8, leading=11, textColor=MUTED),
        "cell": ParagraphStyle("cell", parent=base, fontSize=8.5, leading=11, spaceAfter=0),
        "cell_head": ParagraphStyle("cell_head", parent=base, fontName=FONT_BOLD, fontSize=8.5, leading=11, spaceAfter=0),
        "caption": ParagraphStyle("caption", parent=base, fontSize=8, leading=10.5, textColor=MUTED, spaceAfter=9),
    }


def _table(block: content.Table, width: float, styles: dict[str, ParagraphStyle]) -> PdfTable:
    head = [Paragraph(escape(text), styles["cell_head"]) for text in block.header]
    body = [[Paragraph(escape(text), styles["cell_head"] if block.bold_last_row and i == len(block.rows) - 1
                       else styles["cell"]) for text in row] for i, row in enumerate(block.rows)]
    table = PdfTable([head, *body], colWidths=[w * width for w in block.widths], repeatRows=1, hAlign="LEFT")
    table.setStyle(TableStyle([
        ("BACKGROUND", (0, 0), (-1, 0), BAND),
        ("LINEBELOW", (0, 0), (-1, 0), 0.8, RULE),
        ("LINEBELOW", (0, 1), (-1, -1), 0.4, RULE),
        ("VALIGN", (0, 0), (-1, -1), "TOP"),
        ("TOPPADDING", (0, 0), (-1, -1), 3),
        ("BOTTOMPADDING", (0, 0), (-1, -1), 3),
    ]))
    return table


def _image(png: bytes, width: float) -> Image:
    image = Image(io.BytesIO(png))
    scale = width / image.imageWidth
    image.drawWidth, image.drawHeight = image.imageWidth * scale, image.imageHeight * scale
    return image


def _chart(block: content.Chart, width: float, styles: dict[str, ParagraphStyle]) -> list:
    return [_image(block.png, width * block.width), Paragraph(escape(block.caption), styles["caption"])]


def _chart_row(block: content.ChartRow, width: float, styles: dict[str, ParagraphStyle]) -> PdfTable:
    half = width / 2
    cells = [[_image(chart.png, half - 8), Paragraph(escape(chart.caption), styles["caption"])] for chart in block.charts]
    table = PdfTable([cells], colWidths=[half, half], hAlign="LEFT")
    table.setStyle(TableStyle([("VALIGN", (0, 0), (-1, -1), "TOP"), ("LEFTPADDING", (0, 0), (-1, -1), 0),
                               ("RIGHTPADDING", (0, 0), (-1, -1), 8)]))
    return table


def write_pdf(data: content.ReportData, path: Path) -> None:
    """Write the report to `path` (A4, numbered pages with a footer naming the report)."""
    _fonts()
    styles = _styles()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = SimpleDocTemplate(str(path), pagesize=A4, leftMargin=MARGIN, rightMargin=MARGIN, topMargin=MARGIN,
                                 bottomMargin=MARGIN, title=data.title, author="prunewatch",
                                 subject="Cost before and after pruning, from measured probe data")
    width = document.width
    story: list = []
    heading: list = []  # a heading waits for the block after it, so the two stay on one page
    for block in data.blocks:
        together: list = []  # flowables that must not be split across pages
        after: list = []
        if isinstance(block, content.Title):
            together = [Paragraph(escape(block.text), styles["title"]), Paragraph(escape(block.subtitle), styles["subtitle"])]
        elif isinstance(block, content.Heading):
            heading = [Paragraph(escape(block.text), styles["heading"])]
            continue
        elif isinstance(block, content.Para):
            together = [Paragraph(block.markup, styles["small" if block.small else "body"])]
        elif isinstance(block, content.Bullets):
            together = [ListFlowable([ListItem(Paragraph(item, styles["body"]), leftIndent=10) for item in block.items],
                                     bulletType="bullet", start="•", leftIndent=10, bulletFontName=FONT)]
        elif isinstance(block, content.Table):
            title = [Paragraph(escape(block.title), styles["table_title"])] if block.title else []
            if len(block.rows) > LONG_TABLE_ROWS:  # may split across pages; its header row repeats
                title = [Paragraph(escape(block.title), styles["table_title_long"])] if block.title else []
                story += [*heading, *title, _table(block, width, styles), Spacer(1, 7)]
                heading = []
                continue
            together, after = [*title, _table(block, width, styles)], [Spacer(1, 7)]
        elif isinstance(block, content.Chart):
            together = _chart(block, width, styles)
        elif isinstance(block, content.ChartRow):
            together = [_chart_row(block, width, styles)]
        story += [KeepTogether([*heading, *together]), *after]
        heading = []
    story += heading

    footer = f"prunewatch · {data.title} · generated {data.generated_at:%Y-%m-%d %H:%M} UTC"

    def _footer(canvas, doc) -> None:
        canvas.saveState()
        canvas.setFont(FONT, 7.5)
        canvas.setFillColor(MUTED)
        canvas.drawString(MARGIN, 10 * mm, footer)
        canvas.drawRightString(A4[0] - MARGIN, 10 * mm, f"page {doc.page}")
        canvas.restoreState()

    document.build(story, onFirstPage=_footer, onLaterPages=_footer)
