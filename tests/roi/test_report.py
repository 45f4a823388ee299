"""The CFO report from a store filled by a real collector run: pdftotext finds the core's numbers."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from prunewatch.commands.roi import report_command, roi_command
from prunewatch.roi import Assumptions, Basis, Window, calculate, sensitivity
from prunewatch.roi.formatting import interval_text, usd
from prunewatch.roi.measured import PROBE_MODEL_CAVEAT
from prunewatch.roi.provenance import Provenance
from prunewatch.roi.store import load_results
from prunewatch.roi.tables import headlines

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
    started = datetime.now(UTC)
    outcome = CliRunner().invoke(_cli(), ["report", "--days", "60", "--db", collected_sqlite, "--out", str(pdf),
                                          "--assumptions", str(assumptions_file)])
    assert outcome.exit_code == 0, outcome.output
    # The same numbers from the core, over the same 60-day window (the store's rows are older than `started`).
    window = Window.last_days(60, started)
    summary, result = calculate(load_results(collected_sqlite, window), window, Assumptions(**USER_ASSUMPTIONS))
    alloc, usage = result.allocation, result.usage
    assert outcome.output.startswith(f"wrote {pdf} and {html}: savings {usd(alloc.savings_per('month'))} per month")
    assert "(measured CPU time after pruning)" in outcome.output  # the probes ran on a CPU, and it says so

    text = _text(pdf)
    assert "Pruning ROI report, last 60 days" in text
    assert (f"Pruning saves {usd(alloc.savings_per('month'))} per month ({usd(alloc.savings_per('year'))} per year) "
            f"on the allocation basis") in text
    assert f"and {usd(usage.savings_per('month'))} per month ({usd(usage.savings_per('year'))} per year) on the usage basis" in text
    # The usage basis bills the GPU time per request, before (the dense baselines, measured) against after: it
    # saves exactly when pruning measured faster, and by that difference (on the tiny probe model it may not).
    times = result.gpu_time
    assert times.before_provenance is Provenance.MEASURED and times.after_provenance is Provenance.MEASURED
    assert (usage.savings_per("month") > 0) == (times.before_s > times.after_s)
    assert usage.gpu_hours_before / usage.gpu_hours_after == pytest.approx(times.before_s / times.after_s)
    for basis in Basis:
        for headline in headlines(result, basis):
            assert headline.value in text, (basis, headline)
    assert "Cost before / month" in text and "Payback" in text
    assert f"{summary.results_total} probe requests measured" in text
    # How "after" was derived, word for word, in the words of where the time was measured (CPU here).
    assert result.inputs.describe_basis().replace("GPU time", "CPU time") in text
    # Quality kept: the reference-scored agreement with its interval and prompts, pass rates dense vs pruned.
    assert summary.reference_agreement is not None
    assert f"Reference-scored agreement (quality kept) {interval_text(summary.reference_agreement)}" in text
    if summary.pass_rate_pruned is not None and summary.pass_rate_dense is not None:
        assert "Task pass rate, pruned" in text and "Task pass rate, dense" in text
    # The collector's default dense baselines (every 10th round, the first included): "before" is measured.
    assert summary.dense_results > 0 and summary.has_dense_baseline
    assert result.gpu_time.before_provenance.value == "measured"
    assert "Request volume 200,000 requests/day user-entered" in text
    assert " ".join(PROBE_MODEL_CAVEAT.split()) in text
    assert "GPU utilisation 70.0% fraction assumed-default" in text
    # The collector ran the probe model on this machine's CPU: its times are CPU time, labelled so.
    assert summary.time_label.startswith("CPU time per request (measured on cpu")
    assert " ".join(f"{summary.time_label} is ".split()) in text and "GPU time per request is" not in text
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


@pytest.mark.parametrize("option, kind", [("--target", "target"), ("--model", "model")])
def test_a_filter_matching_nothing_names_what_the_store_holds(collected_sqlite: str, tmp_path: Path, option: str,
                                                             kind: str) -> None:
    """A mistyped target or model is answered with the names that have results, and nothing is written."""
    pdf = tmp_path / "r.pdf"
    outcome = CliRunner().invoke(_cli(), ["report", "--db", collected_sqlite, "--out", str(pdf), option, "NOSUCH"])
    assert outcome.exit_code == 2
    held = "embedded" if kind == "target" else "probe-llama"
    assert outcome.output.strip().endswith(
        f"(0 results, 0 failed); no result of {kind} NOSUCH in this window ({kind}s with results: {held})")
    assert f"for {'target NOSUCH' if kind == 'target' else 'all targets, model NOSUCH'} between" in outcome.output
    assert not pdf.exists()


def test_roi_command_checks_the_store_before_starting(tmp_path: Path) -> None:
    outcome = CliRunner().invoke(_cli(), ["roi", "--db", f"sqlite:///{tmp_path / 'absent.db'}"])
    assert outcome.exit_code == 2 and outcome.output.startswith("error: no result store at")
    outcome = CliRunner().invoke(_cli(), ["roi", "--days", "45", "--db", "sqlite:///x.db"])
    assert outcome.exit_code == 2
    assert outcome.output.strip() == "error: --days must be one of 1, 7, 30, 60, 90, 180, 365, got 45"


def _words(data) -> str:
    """Every text of a report's blocks, one string (what the PDF and the HTML variant both print)."""
    from prunewatch.roi import report as content

    parts = []
    for block in data.blocks:
        if isinstance(block, content.Para):
            parts.append(block.markup)
        elif isinstance(block, content.Bullets):
            parts.extend(block.items)
        elif isinstance(block, content.Table):
            parts.extend(cell for row in block.rows for cell in row)
    return " ".join(parts)


@pytest.mark.parametrize("device, name, label, gpu", [
    ("cpu", "Test CPU 9000", "CPU time per request (measured on cpu: Test CPU 9000)", False),
    ("cuda", "NVIDIA H200", "GPU time per request (measured on cuda: NVIDIA H200)", True),
    (None, None, "Time per request (device not recorded)", False),
])
def test_report_labels_time_by_the_device_it_was_measured_on(device, name, label, gpu) -> None:
    """CPU time is never called GPU time: the savings paragraph, the method and the inputs table say where."""
    from dataclasses import replace

    from prunewatch.roi.report import build_report
    from tests.roi.factories import T0, WINDOW, measured_basis_results

    results = [replace(r, device=device, device_name=name) for r in measured_basis_results()]
    data = build_report(results, WINDOW, Assumptions(), 30, now=T0)
    words = _words(data)
    assert data.summary.time_label == label
    assert f"{label} is " in words
    caveat = "it was not measured on a GPU, so enter a production GPU time per request for GPU costs"
    if gpu:
        assert caveat not in words and "GPU time after / before" in words
    else:  # no measured figure is called GPU time: not the savings paragraph, the basis, nor the inputs table
        assert caveat in words
        for claim in ("GPU time per request is", "GPU time per request after pruning =", "GPU time after / before",
                      "savings come from GPU time"):
            assert claim not in words
        noun = label.split(" per ")[0]
        assert f"{noun} after / before" in words  # the measured input, relabelled
        assert f"Measured: {noun if noun != 'Time' else 'time'} per request after pruning = before" in words


def test_mixed_devices_are_named_and_not_called_gpu_time() -> None:
    from dataclasses import replace

    from prunewatch.roi.measured import summarize
    from tests.roi.factories import WINDOW, measured_basis_results

    results = measured_basis_results()
    results = [replace(r, device="cuda", device_name="NVIDIA H200") for r in results[:4]] + [
        replace(r, device="cpu", device_name="Test CPU") for r in results[4:6]] + results[6:]
    summary = summarize(results, WINDOW)
    assert summary.timing_devices == {"cpu: Test CPU": 2, "cuda: NVIDIA H200": 4, "device not recorded": 1}
    assert summary.time_label == ("Time per request (measured on cpu: Test CPU and cuda: NVIDIA H200, "
                                  "device not recorded for 1 result(s))")


def test_an_entered_time_per_request_is_not_called_the_stores_cpu_time() -> None:
    """A production GPU time typed in replaces the store's CPU time: the report names it as entered and drops
    the caveat that tells the reader to enter one."""
    from dataclasses import replace

    from prunewatch.roi.report import build_report
    from tests.roi.factories import T0, WINDOW, measured_basis_results

    results = [replace(r, device="cpu", device_name="Test CPU 9000") for r in measured_basis_results()]
    data = build_report(results, WINDOW, Assumptions(dense_inference_s=0.05), 30, now=T0)
    words = _words(data)
    assert "GPU time per request (user-entered) is 0.05" in words
    assert "CPU time per request (measured on cpu: Test CPU 9000) is" not in words
    assert "it was not measured on a GPU" not in words
    assert data.result.gpu_time.before_provenance.value == "user-entered"


def test_roi_command_on_a_taken_port_is_one_line_before_streamlit_starts(collected_sqlite: str) -> None:
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        outcome = CliRunner().invoke(_cli(), ["roi", "--db", collected_sqlite, "--port", str(port)])
    finally:
        taken.close()
    assert outcome.exit_code == 2
    assert outcome.output.startswith(f"error: cannot serve the ROI app on 127.0.0.1:{port}: ")
    assert len(outcome.output.strip().splitlines()) == 1


def _load_point(tmp_path: Path, clients: int = 4):
    from prunewatch.roi import LoadPoint, LoadProfile
    from tests.roi.factories import write_load

    return LoadPoint.choose(LoadProfile.from_file(write_load(tmp_path)), clients)


def test_report_under_load_has_its_section_and_prices_time_from_the_load_run(tmp_path: Path) -> None:
    """At 4 clients of the factory's run pruned serving is 0.80x dense: the report says it does not pay there,
    shows cost per 1M output tokens at each measured level, and never calls the load run's CPU time GPU time."""
    from prunewatch.roi import report as content
    from prunewatch.roi.report import build_report
    from prunewatch.roi.report_html import render_html
    from tests.roi.factories import T0, WINDOW, measured_basis_results

    load = _load_point(tmp_path)
    data = build_report(measured_basis_results(), WINDOW, Assumptions(gpu_hourly_usd=3.6), 30, now=T0, load=load)
    headings = [block.text for block in data.blocks if isinstance(block, content.Heading)]
    assert headings.index("Throughput under load") == headings.index("Savings and their basis") + 1
    words = _words(data)
    basis = data.result.inputs.describe_basis()
    assert basis.startswith("Measured under load: at 4 concurrent clients (user-entered)")
    assert words.count(basis) >= 2  # the summary's "before and after" and the section itself
    assert "A pruned token is cheaper than a dense one at 1 concurrent client, and not at 2 and 4 concurrent clients." \
        in words
    table = next(block for block in data.blocks if isinstance(block, content.Table)
                 and block.title == "Cost per 1M output tokens by concurrency, dense vs pruned")
    assert table.rows[2] == ("4 (deployment)", "50.0", "40.0", "0.80x", "$20.00", "$25.00", "costs 25% more")
    assert table.rows[0][4:] == ("$50.00", "$40.00", "saves 20%")
    assert "CPU time per request under load (4 concurrent clients, measured on cpu: Test CPU 9000, 2 threads) is " \
           "1.000 s before pruning (measured-under-load) and 1.250 s after (measured-under-load)" in words
    assert "it was not measured on a GPU" in words  # the load run ran on a CPU and is priced at a GPU hour
    assert "time per request comes from the load run's aggregate tokens/s" in words
    assert "probes run one request at a time" not in words
    page = render_html(data)
    assert "<h2>Throughput under load</h2>" in page and "<td>4 (deployment)</td>" in page

    plain = build_report(measured_basis_results(), WINDOW, Assumptions(gpu_hourly_usd=3.6), 30, now=T0)
    assert "Throughput under load" not in [b.text for b in plain.blocks if isinstance(b, content.Heading)]
    assert "probes run one request at a time" in _words(plain) and "under load" not in _words(plain)


@pytest.mark.slow
def test_report_command_with_load_results_writes_the_section_into_the_pdf(collected_sqlite: str, tmp_path: Path) -> None:
    from tests.roi.factories import write_load

    path = write_load(tmp_path)
    pdf = tmp_path / "report.pdf"
    outcome = CliRunner().invoke(_cli(), ["report", "--db", collected_sqlite, "--out", str(pdf),
                                          "--load-results", str(path), "--concurrency", "2"])
    assert outcome.exit_code == 0, outcome.output
    assert "(measured-under-load CPU time after pruning at 2 concurrent clients)" in outcome.output
    text = _text(pdf)
    assert "Throughput under load" in text and "Cost per 1M output tokens by concurrency, dense vs pruned" in text
    assert "Measured under load: at 2 concurrent clients (user-entered)" in text
    assert "2 (deployment)" in text and "no change" in text  # 36.0 tokens/s both ways at 2 clients
    # The table's prices at the default $0.91 per GPU hour (assumed-default): 0.91 / (20 x 3600) x 1e6 = $12.64.
    assert "$12.64" in text and "$0.91 per GPU hour (assumed-default)" in text
    page = pdf.with_suffix(".html").read_text(encoding="utf-8")
    assert "<h2>Throughput under load</h2>" in page


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "4"], "error: --concurrency needs --load-results (a `prunewatch bench load` result)"),
    (["--load-results", "{load}"], "error: --load-results needs --concurrency, one of the levels {load} measured: "
                                   "1, 2, 4"),
    (["--load-results", "{load}", "--concurrency", "3"],
     "error: concurrency 3 was not measured in {load}; measured levels: 1, 2, 4 (or measure it: prunewatch bench load "
     "--clients 3)"),
    (["--load-results", "{absent}", "--concurrency", "4"],
     "error: no load results file at {absent}; run `prunewatch bench load` to write one"),
    (["--load-results", "{bad}", "--concurrency", "4"],
     "error: load results file {bad} is not JSON: Expecting value at line 1"),
])
def test_report_command_rejects_a_bad_load_run_in_one_line(args, message, tmp_path: Path) -> None:
    from tests.roi.factories import write_load

    paths = {"load": str(write_load(tmp_path)), "absent": str(tmp_path / "absent.json"), "bad": str(tmp_path / "bad.json")}
    (tmp_path / "bad.json").write_text("nope")
    pdf = tmp_path / "r.pdf"
    outcome = CliRunner().invoke(_cli(), ["report", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--out", str(pdf),
                                          *[arg.format(**paths) for arg in args]])
    assert outcome.exit_code == 2
    assert outcome.output.strip() == message.format(**paths)
    assert not pdf.exists() and not (tmp_path / "x.db").exists()


def test_roi_command_checks_the_load_run_before_starting(tmp_path: Path) -> None:
    from tests.roi.factories import write_load

    path = write_load(tmp_path)
    outcome = CliRunner().invoke(_cli(), ["roi", "--db", f"sqlite:///{tmp_path / 'x.db'}", "--load-results", str(path),
                                          "--concurrency", "8"])
    assert outcome.exit_code == 2
    assert outcome.output.strip() == (f"error: concurrency 8 was not measured in {path}; measured levels: 1, 2, 4 "
                                      "(or measure it: prunewatch bench load --clients 8)")
