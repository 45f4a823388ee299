"""`prunewatch dashboards export` and `prunewatch dashboards push`, as plain typer command functions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from prunewatch.cli_errors import fail, first_validation_error, needs_extra
from prunewatch.dashboards.export import JSON_DIR, check_exported, export_dashboards
from prunewatch.dashboards.settings import DashboardSettings


def _settings(usd_per_million_tokens: float, gpu_usd_per_hour: float) -> DashboardSettings:
    try:
        return DashboardSettings(usd_per_million_tokens=usd_per_million_tokens, gpu_usd_per_hour=gpu_usd_per_hour)
    except ValidationError as exc:
        raise fail(first_validation_error(exc))


def export_command(
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Folder to write the dashboard JSON files into.")] = JSON_DIR,
    check: Annotated[bool, typer.Option("--check", help="Write nothing; exit 1 if the files differ from the code.")] = False,
    usd_per_million_tokens: Annotated[float, typer.Option(help="Configured $ per 1M tokens (cost panel default).")] = DashboardSettings().usd_per_million_tokens,
    gpu_usd_per_hour: Annotated[float, typer.Option(help="Configured GPU $ per hour (cost panel default).")] = DashboardSettings().gpu_usd_per_hour,
) -> None:
    """Write the Grafana dashboards as JSON (the files docker-compose provisions)."""
    settings = _settings(usd_per_million_tokens, gpu_usd_per_hour)
    if check:
        problems = check_exported(out_dir, settings)
        for problem in problems:
            typer.echo(f"drift: {problem}", err=True)
        if problems:
            typer.echo("run `prunewatch dashboards export` and commit the result", err=True)
            raise typer.Exit(1)
        typer.echo(f"{out_dir}: up to date")
        return
    try:
        written = export_dashboards(out_dir, settings)
    except OSError as exc:
        raise fail(f"cannot write into {out_dir}: {exc.strerror or exc}")
    for path in written:
        typer.echo(f"wrote {path}")


def push_command(
    url: Annotated[str, typer.Option("--url", help="Grafana base URL, e.g. http://localhost:3000.")],
    folder: Annotated[str, typer.Option("--folder", help="Folder title; created when absent.")] = "prunewatch",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per HTTP request.")] = 10.0,
    usd_per_million_tokens: Annotated[float, typer.Option(help="Configured $ per 1M tokens (cost panel default).")] = DashboardSettings().usd_per_million_tokens,
    gpu_usd_per_hour: Annotated[float, typer.Option(help="Configured GPU $ per hour (cost panel default).")] = DashboardSettings().gpu_usd_per_hour,
) -> None:
    """Create or update the dashboards in a running Grafana (token from the GRAFANA_TOKEN variable)."""
    from prunewatch.dashboards.build import build_dashboards

    try:
        from prunewatch.dashboards.push import GrafanaPushError, PushSettings, push_dashboards
    except ModuleNotFoundError as exc:
        raise fail(needs_extra(exc, "dashboards"))

    dashboard_settings = _settings(usd_per_million_tokens, gpu_usd_per_hour)
    try:
        settings = PushSettings.from_env(url=url, folder=folder, timeout_s=timeout)
    except GrafanaPushError as exc:
        raise fail(str(exc))
    except ValidationError as exc:
        raise fail(first_validation_error(exc))
    try:
        report = push_dashboards(settings, build_dashboards(dashboard_settings))
    except GrafanaPushError as exc:
        raise fail(str(exc))
    folder_state = "created" if report.folder_created else "existing"
    typer.echo(f"Grafana {report.grafana_version}: folder {report.folder_uid} ({folder_state}); "
               f"created {len(report.created)}, updated {len(report.updated)}, unchanged {len(report.unchanged)}")
