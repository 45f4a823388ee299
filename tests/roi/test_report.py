"""The CFO report from a store filled by a real collector run: pdftotext finds the core's numbers."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from roi import Assumptions, Basis, Window, calculate, sensitivity
from roi.cli import report_command, roi_command
from roi.formatting import pct, usd
from roi.measured import PROBE_MODEL_CAVEAT
from roi.store import load_results
from roi.tables import headlines

USER_ASSUMPTIONS = {"requests_per_day": 200_000, "gpu_hourly_usd": 2.5, "implementation_cost_usd": 5_000}


def _cli() -> typer.Typer:
    """The two commands mounted the way the `prunewatch` app mounts them."""
    app = typer.Typer()
    app.command("report")(report_command)
    app.command("roi")(roi_command)
    return app


def _text(pdf: Path) -> str:
    out = subprocess.run(["pdftotext", "-enc", "UTF-8", str(pdf), "-"], check=True, capture_output=True, text=True)
    return " ".join(out.stdout.split())


def _pages(pdf: Path) -> int:
    info = subprocess.run(["pdfinfo", str(pdf)], check=True, capture_output=True, text=True).stdout
    return int(re.search(r"^Pages:\s+(\d+)", info, re.MULTILINE).group(1))


@pytest.mark.slow
def test_report_command_writes_pdf_and_html_with_the_cores_numbers(collected_sqlite: str, tmp_path: Path) -> None:
    assumptions_file = tmp_path / "assumptions.json"
    assumptions_file.write_text(json.dumps(USER_ASSUMPTIONS))
    pdf, html = tmp_path / "out" / "report.pdf", tmp_path / "out" / "report.html"
    started = datetime.now(timezone.utc)
    outcome = CliRunner().invoke(_cli(), ["report", "--days", "60", "--db", collected_sqlite, "--out", str(pdf),
                                          "--assumptions", str(assumptions_file)])
    assert outcome.exit_code == 0, outcome.output
    # The same numbers from the core, over the same 60-day window (the store's rows are older than `started`).
    window = Window.last_days(60, started)
    summary, result = calculate(load_results(collected_sqlite, window), window, Assumptions(**USER_ASSUMPTIONS))
    alloc, usage = result.allocation, result.usage
    assert outcome.output.startswith(f"wrote {pdf} and {html}: savings {usd(alloc.savings_per('month'))} per month")

    text = _text(pdf)
    assert "Pruning ROI report, last 60 days" in text
    assert (f"Pruning saves {usd(alloc.savings_per('month'))} per month ({usd(alloc.savings_per('year'))} per year) "
            f"on the allocation basis") in text
    assert f"and {usd(usage.savings_per('month'))} per month ({usd(usage.savings_per('year'))} per year) on the usage basis" in text
    assert usage.savings_per("month") > 0  # the usage basis always sees the measured GPU time saved
    for basis in Basis:
        for headline in headlines(result, basis):
            assert headline.value in text, (basis, headline)
    assert "Cost before / month" in text and "Payback" in text
    assert f"{summary.results_total} probe requests measured" in text
    assert result.inputs.describe_basis() in text  # how "after" was derived, word for word
    assert f"Mean token agreement {pct(summary.token_agreement_mean)}" in text
    assert "Request volume 200,000 requests/day user-entered" in text
    assert " ".join(PROBE_MODEL_CAVEAT.split()) in text
    assert "GPU utilisation 70.0% fraction assumed-default" in text
    for section in ("Summary", "Savings and their basis", "Measured trends", "Sensitivity", "Quality kept",
                    "Method and assumptions", "Every input and its provenance"):
        assert section in text
    assert 3 <= _pages(pdf) <= 6

    page = html.read_text(encoding="utf-8")
    moved = any(row.swing > 0 for row in sensitivity(result, Basis.ALLOCATION, 20))
    assert page.count("data:image/png;base64,") == (5 if moved else 4)  # no tornado when no input moves savings
    assert f"<b>{usd(alloc.savings_per('month'))} per month</b>" in page
    for headline in headlines(result, Basis.USAGE):
        assert f"<td>{headline.value}</td>" in page


@pytest.mark.parametrize("args, message", [
    (["--days", "45"], "error: --days must be one of 30, 60, 90, got 45"),
    (["--out", "report.txt"], "error: --out must name a .pdf file, got report.txt"),
])
def test_report_command_rejects_bad_options(args, message, tmp_path: Path) -> None:
    outcome = CliRunner().invoke(_cli(), ["report", "--db", f"sqlite:///{tmp_path / 'x.db'}", *args])
    assert outcome.exit_code == 2
    assert outcome.output.strip() == message


def test_report_command_on_a_missing_store_writes_nothing(tmp_path: Path) -> None:
    pdf = tmp_path / "report.pdf"
    outcome = CliRunner().invoke(_cli(), ["report", "--db", f"sqlite:///{tmp_path / 'absent.db'}", "--out", str(pdf)])
    assert outcome.exit_code == 2
    assert outcome.output.startswith(f"error: no result store at {tmp_path / 'absent.db'}")
    assert not pdf.exists() and not (tmp_path / "absent.db").exists()


def test_report_command_rejects_an_invalid_assumptions_file(tmp_path: Path, collected_sqlite: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpu_utilisation": 0}')
    outcome = CliRunner().invoke(_cli(), ["report", "--db", collected_sqlite, "--out", str(tmp_path / "r.pdf"),
                                          "--assumptions", str(bad)])
    assert outcome.exit_code == 2
    assert outcome.output.strip() == (f"error: assumptions file {bad}: gpu_utilisation: Input should be greater than "
                                      f"or equal to 0.01 (got 0)")


def test_roi_command_checks_the_store_before_starting(tmp_path: Path) -> None:
    outcome = CliRunner().invoke(_cli(), ["roi", "--db", f"sqlite:///{tmp_path / 'absent.db'}"])
    assert outcome.exit_code == 2 and outcome.output.startswith("error: no result store at")
    outcome = CliRunner().invoke(_cli(), ["roi", "--days", "45", "--db", "sqlite:///x.db"])
    assert outcome.exit_code == 2
    assert outcome.output.strip() == "error: --days must be one of 1, 7, 30, 60, 90, 180, 365, got 45"
