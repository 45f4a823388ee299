"""`prunewatch stack up` / `prunewatch stack down`, as plain functions the `prunewatch` app mounts.

Bad input is one `error: ...` line and exit code 2; a service that fails to start or stop is one
`error: ...` line naming it and its log, and exit code 1. Options left out fall back to
PRUNEWATCH_STACK_* variables, then to StackSettings' defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from prunewatch.cli_errors import fail, first_validation_error

STATE_DIR_HELP = "State dir: configs, secrets, pids, logs, data (default .prunewatch/stack)."


def _error(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


def stack_up_command(
    state_dir: Annotated[Path | None, typer.Option("--state-dir", help=STATE_DIR_HELP)] = None,
    model: Annotated[Path | None, typer.Option("--model", help="Model folder the engines serve (default: bundled probe model).")] = None,
    engines: Annotated[int | None, typer.Option("--engines", help="Engine servers to start (1..8, default 2).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="Engine device: cpu (default), cuda or auto.")] = None,
    probes: Annotated[Path | None, typer.Option("--probes", help="Probes YAML the collector sends (default: canonical).")] = None,
    interval: Annotated[float | None, typer.Option("--interval", help="Seconds between probe rounds per engine (default 30).")] = None,
    baseline_every: Annotated[int | None, typer.Option("--baseline-every", help="Dense baseline runs every N rounds per engine (default 10).")] = None,
    scrape_interval: Annotated[int | None, typer.Option("--scrape-interval", help="Prometheus scrape interval, s (default 15).")] = None,
    alert_group_wait: Annotated[int | None, typer.Option("--alert-group-wait", help="Alertmanager group_wait in s (default: prunewatch/alerts/alertmanager.yml's).")] = None,
    calibration_dir: Annotated[Path | None, typer.Option("--calibration-dir", help="Calibration cache the engines share.")] = None,
    start_timeout: Annotated[float | None, typer.Option("--start-timeout", help="Longest wait per service, s (default 180).")] = None,
) -> None:
    """Start PostgreSQL, engines, the collector, Prometheus, Alertmanager (+ a local Slack sink) and the ROI app."""
    from pydantic import ValidationError

    from prunewatch.stack.lifecycle import StackError, display_rank, stack_up
    from prunewatch.stack.settings import StackSettings

    given: dict[str, Any] = {"state_dir": state_dir, "model_dir": model, "engines": engines, "device": device,
             "probes_path": probes, "interval_s": interval, "baseline_every": baseline_every,
             "scrape_interval_s": scrape_interval,
             "alert_group_wait_s": alert_group_wait, "calibration_dir": calibration_dir,
             "start_timeout_s": start_timeout}
    try:
        settings = StackSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        raise fail(first_validation_error(exc))
    try:
        state = stack_up(settings, progress=lambda message: typer.echo(f"  {message}", err=True))
    except StackError as exc:
        raise _error(str(exc))
    root = state.state_dir
    typer.echo(f"prunewatch stack up from {root} (logs in {root / 'logs'}):")
    for service in sorted(state.services, key=lambda s: display_rank(s.record.name)):
        if service.url:
            typer.echo(f"  {service.record.name:<13} {service.url}")
    typer.echo(f"  engine API key in {root / 'secrets' / 'engine-api-key'}; "
               f"Slack messages in {root / 'slack-messages.jsonl'}")
    typer.echo(f"stop it with: prunewatch stack down --state-dir {root}")


def stack_down_command(
    state_dir: Annotated[Path | None, typer.Option("--state-dir", help=STATE_DIR_HELP)] = None,
    stop_timeout: Annotated[float, typer.Option("--stop-timeout", min=0.1, max=600.0, help="Seconds each service gets to exit before it is killed.")] = 20.0,
) -> None:
    """Stop every service `stack up` started from the state dir; logs, configs and data stay."""
    from prunewatch.stack.lifecycle import StackError, stack_down
    from prunewatch.stack.settings import DEFAULT_STATE_DIR

    try:
        report = stack_down(state_dir or DEFAULT_STATE_DIR, stop_timeout)
    except StackError as exc:
        raise _error(str(exc))
    if report.nothing_recorded:
        typer.echo(f"nothing to stop: {report.nothing_recorded}")
        return
    line = f"stopped {len(report.stopped)} service(s)"
    if report.killed:
        line += f"; killed after {stop_timeout:g}s: {', '.join(report.killed)}"
    if report.already_gone:
        line += f"; already gone: {', '.join(report.already_gone)}"
    typer.echo(line)
