"""Write the CFO report to files: read the store, build the report's content, render PDF and HTML.

Apart from prunewatch/roi/report.py so that the renderers (report_pdf, report_html), which read the content
module, are not imported by it: content -> renderers -> files, no cycle.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from prunewatch.roi.assumptions import Assumptions
from prunewatch.roi.load_profile import LoadPoint
from prunewatch.roi.measured import Window
from prunewatch.roi.report import ReportData, build_report
from prunewatch.roi.report_html import write_html
from prunewatch.roi.report_pdf import write_pdf
from prunewatch.roi.store import load_results


def generate_report(db_url: str, days: int, pdf_path: Path, html_path: Path | None, assumptions: Assumptions,
                    target: str | None = None, model: str | None = None, now: datetime | None = None,
                    load: LoadPoint | None = None) -> ReportData:
    """Read the store, build the report and write the PDF (and the HTML variant when a path is given); with
    `load`, time per request is priced from the load run at its concurrency."""
    window = Window.last_days(days, now)
    # Every target's results, as the app reads them: the report filters them itself (prunewatch.roi.measured.select), and
    # a target name that matches nothing can then be answered with the ones that exist.
    data = build_report(load_results(db_url, window), window, assumptions, days, target, model, now=now, load=load)
    write_pdf(data, pdf_path)
    if html_path is not None:
        write_html(data, html_path)
    return data
