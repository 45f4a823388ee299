"""`prunewatch roi` (the Streamlit calculator) and `prunewatch report` (the CFO PDF + HTML report).

Plain functions with typer options; the `prunewatch` app mounts them. Bad input ends with a
one-line `error: ...` and exit code 2.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prunewatch.cli_errors import fail
from prunewatch.records.settings import DEFAULT_STORE_URL, STORE_URL_ENV
from prunewatch.roi.settings import CONCURRENCY_ENV, LOAD_RESULTS_ENV

if TYPE_CHECKING:
    from prunewatch.roi.load_profile import LoadPoint

LOAD_RESULTS_HELP = ("Results JSON of `prunewatch bench load`: price time per request from its measured aggregate "
                     "tokens/s at --concurrency, not from the probes' one-request-at-a-time times.")


def _load_point(load_results: Path | None, concurrency: int | None, *, required: bool) -> LoadPoint | None:
    """The load run at the deployment's concurrency (None without a file), or a one-line `error:` exit for a bad
    file or an unmeasured level. `required`: the report needs the concurrency named, because a default would price
    a load nobody stated (the app starts at the run's highest level and labels it assumed-default)."""
    from prunewatch.roi.errors import RoiError
    from prunewatch.roi.load_profile import LoadPoint, LoadProfile

    if load_results is None:
        if concurrency is not None:
            raise fail("--concurrency needs --load-results (a `prunewatch bench load` result)")
        return None
    try:
        profile = LoadProfile.from_file(load_results)
        if concurrency is None:
            if required:
                raise fail(f"--load-results needs --concurrency, one of the levels {load_results} measured: "
                           f"{', '.join(map(str, profile.concurrencies))}")
            return None
        return LoadPoint.choose(profile, concurrency)
    except RoiError as exc:
        raise fail(str(exc))


def app_path() -> Path:
    """The Streamlit script of the ROI part, found without importing it (it loads pandas and plotly)."""
    spec = importlib.util.find_spec("prunewatch.roi.app")
    assert spec is not None and spec.origin is not None, "the roi package ships prunewatch/roi/app.py"
    return Path(spec.origin)


def roi_command(
    db: Annotated[str, typer.Option(envvar=STORE_URL_ENV, help="SQLAlchemy URL of the result store (or PRUNEWATCH_DB_URL, which keeps a password off the command line).")] = DEFAULT_STORE_URL,
    host: Annotated[str, typer.Option(help="Address the app listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port the app listens on.")] = 8501,
    days: Annotated[int, typer.Option(help="Window selected when the app opens (1, 7, 30, 60, 90, 180 or 365 days).")] = 30,
    load_results: Annotated[Path | None, typer.Option(envvar=LOAD_RESULTS_ENV, help=LOAD_RESULTS_HELP)] = None,
    concurrency: Annotated[int | None, typer.Option(envvar=CONCURRENCY_ENV, help=(
        "Concurrent clients the app starts at, a level the load run measured (default: its highest)."))] = None,
) -> None:
    """Open the ROI calculator (Streamlit) on the store's measurements; PRUNEWATCH_ROI_PASSWORD locks it."""
    from prunewatch.records.store import safe_url
    from prunewatch.roi.errors import RoiStoreError
    from prunewatch.roi.settings import (
        DEFAULT_DAYS_ENV,
        PASSWORD_ENV,
        WINDOW_CHOICES_DAYS,
    )
    from prunewatch.roi.store import check_store

    if days not in WINDOW_CHOICES_DAYS:
        raise fail(f"--days must be one of {', '.join(map(str, WINDOW_CHOICES_DAYS))}, got {days}")
    _load_point(load_results, concurrency, required=False)
    try:
        check_store(db)
    except RoiStoreError as exc:
        raise fail(str(exc))
    from prunewatch.server.run import ServeAddressError, bind_listener

    try:  # Streamlit's own message for a taken port is not one line with exit 2
        bind_listener(host, port, what="the ROI app").close()
    except ServeAddressError as exc:
        raise fail(str(exc))
    env = {**os.environ, STORE_URL_ENV: db, DEFAULT_DAYS_ENV: str(days)}
    if load_results is not None:  # absolute: Streamlit runs the app from its own working directory
        env[LOAD_RESULTS_ENV] = str(load_results.resolve())
    if concurrency is not None:
        env[CONCURRENCY_ENV] = str(concurrency)
    lock = "password required" if os.environ.get(PASSWORD_ENV) else f"no password (set {PASSWORD_ENV} to require one)"
    typer.echo(f"ROI app on http://{host}:{port} for store {safe_url(db)}; {lock}; Ctrl-C stops it")
    sys.stdout.flush()
    command = [sys.executable, "-m", "streamlit", "run", str(app_path()), "--server.address", host,
               "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false"]
    os.execve(sys.executable, command, env)  # the app replaces this process, so signals reach Streamlit directly


def report_command(
    days: Annotated[int, typer.Option(help="Measurement window in days: 30, 60 or 90.")] = 30,
    db: Annotated[str, typer.Option(envvar=STORE_URL_ENV, help="SQLAlchemy URL of the result store.")] = DEFAULT_STORE_URL,
    out: Annotated[Path, typer.Option(help="PDF to write.")] = Path("report.pdf"),
    html: Annotated[Path | None, typer.Option(help="HTML variant to write (default: next to the PDF, .html).")] = None,
    target: Annotated[str | None, typer.Option(help="Only this target (default: every target in the store).")] = None,
    model: Annotated[str | None, typer.Option(help="Only this model (default: every model).")] = None,
    assumptions: Annotated[Path | None, typer.Option(help="JSON file of assumptions (the app's 'download assumptions').")] = None,
    load_results: Annotated[Path | None, typer.Option(help=LOAD_RESULTS_HELP)] = None,
    concurrency: Annotated[int | None, typer.Option(help="Concurrent clients of the deployment: one of the levels "
                                                         "the load run measured (needed with --load-results).")] = None,
) -> None:
    """Write the CFO report (PDF + HTML): savings with their basis, trends, method, assumptions, quality kept."""
    from prunewatch.records.store import safe_url
    from prunewatch.roi.assumptions import Assumptions
    from prunewatch.roi.costs import Basis
    from prunewatch.roi.errors import NoMeasurementsError, NoTrafficError, RoiError
    from prunewatch.roi.formatting import payback_text, usd
    from prunewatch.roi.load_profile import clients_text
    from prunewatch.roi.report import REPORT_DAYS
    from prunewatch.roi.report_files import generate_report

    if days not in REPORT_DAYS:
        raise fail(f"--days must be one of {', '.join(map(str, REPORT_DAYS))}, got {days}")
    if out.suffix.lower() != ".pdf":
        raise fail(f"--out must name a .pdf file, got {out}")
    html_path = html or out.with_suffix(".html")
    if html_path.resolve() == out.resolve():
        raise fail("--html must differ from --out")
    load = _load_point(load_results, concurrency, required=True)
    try:
        chosen = Assumptions.from_file(assumptions) if assumptions else Assumptions()
        data = generate_report(db, days, out, html_path, chosen, target=target, model=model, load=load)
    except (NoMeasurementsError, NoTrafficError) as exc:  # about the store's data: say which store
        raise fail(f"store {safe_url(db)}: {exc}")
    except RoiError as exc:
        raise fail(str(exc))
    except OSError as exc:
        raise fail(f"cannot write the report: {exc}")
    costs = data.result.costs(Basis.ALLOCATION)
    # An entered time per request is a production GPU time; the store's is what its probes ran on, a load run's
    # what its server ran on.
    measured_noun = load.profile.time_noun if load else data.summary.time_noun
    noun = "GPU time" if data.result.gpu_time.entered else measured_noun.replace("Time", "time")
    at = f" at {clients_text(load.concurrency)}" if load else ""
    typer.echo(f"wrote {out} and {html_path}: savings {usd(costs.savings_per('month'))} per month on the allocation "
               f"basis ({data.result.inputs.time_basis.value} {noun} after pruning{at}), payback "
               f"{payback_text(data.result.payback(Basis.ALLOCATION))}")
