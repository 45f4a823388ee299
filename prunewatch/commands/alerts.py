"""`prunewatch alerts ...` commands: render the rule file, check what runs without Prometheus, evaluate once.

Plain functions with typer options; the `prunewatch` app mounts them (render-rules, check, eval).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from prunewatch.alerts.settings import ALERTMANAGER_PATH, RULES_PATH
from prunewatch.cli_errors import fail, first_validation_error
from prunewatch.records.settings import DEFAULT_STORE_URL, STORE_URL_ENV


def render_rules_command(
    out: Annotated[Path | None, typer.Option("--out", help="Write the rule file here (default: print it).")] = None,
    check: Annotated[bool, typer.Option("--check", help="Do not write: exit 1 when --out differs from the rendering.")] = False,
    settings_file: Annotated[Path | None, typer.Option(
        "--settings", help="YAML of RuleSettings fields: fallbacks, hold times, optional SLOs (PRUNEWATCH_RULE_* "
                           "variables win over it). Each model's measured thresholds are series, not settings.")] = None,
) -> None:
    """Render rules.yml from the PromQL constants and the rule settings (PRUNEWATCH_RULE_* variables, --settings file):
    one file for every model, whose measured thresholds it reads as series."""
    from prunewatch.alerts.rules import render_rules
    from prunewatch.alerts.settings import RuleSettings
    from prunewatch.probes import read_yaml

    try:
        from_environment = RuleSettings()
        from_file = {} if settings_file is None else read_yaml(settings_file, "rule settings", ValueError) or {}
        if not isinstance(from_file, dict):
            raise ValueError(f"rule settings file {settings_file} must hold field: value pairs")
        unknown = sorted(set(from_file) - set(RuleSettings.model_fields))
        if unknown:
            raise ValueError(f"rule settings file {settings_file}: unknown field(s) {', '.join(map(str, unknown))}")
        chosen = {name: getattr(from_environment, name) for name in from_environment.model_fields_set}
        text = render_rules(RuleSettings(**{**from_file, **chosen}))  # environment > file > default
    except ValidationError as exc:
        raise fail(f"invalid rule settings: {first_validation_error(exc)}")
    except ValueError as exc:
        raise fail(str(exc))
    if out is None:
        if check:
            raise fail("--check needs --out (the file to compare)")
        typer.echo(text, nl=False)
        return
    if check:
        current = out.read_text() if out.is_file() else None
        if current != text:
            typer.echo(f"{out} differs from the rendered rules; run `prunewatch alerts render-rules --out {out}`",
                       err=True)
            raise typer.Exit(1)
        typer.echo(f"{out} is up to date")
        return
    try:
        out.write_text(text)
    except OSError as exc:
        raise fail(f"cannot write {out}: {exc.strerror or exc}")
    typer.echo(f"wrote {out}")


def check_command(
    rules: Annotated[Path, typer.Option("--rules", help="Rule file to check.")] = RULES_PATH,
    alertmanager: Annotated[Path, typer.Option(
        "--alertmanager", help="Alertmanager config (inhibit rules).")] = ALERTMANAGER_PATH,
) -> None:
    """List which alert rules the embedded evaluator runs and which only Prometheus can (with the reason)."""
    from prunewatch.alerts.inhibit import load_inhibit_rules
    from prunewatch.alerts.ruleset import RuleFileError, load_rules

    try:
        rule_file = load_rules(rules)
        inhibit = load_inhibit_rules(alertmanager)
    except RuleFileError as exc:
        raise fail(str(exc))
    table = Table(title=f"{rules}: alert rules without Prometheus")
    for column in ("rule", "severity", "threshold", "for", "embedded evaluator"):
        table.add_column(column)
    for rule in rule_file.alerting:
        labels = dict(rule.labels)
        threshold = ("fallback" if labels.get("source") == "fallback" else
                     "measured, on(model)" if "prunewatch_alert_threshold" in rule.expr else "configured")
        table.add_row(rule.name, labels.get("severity", ""), threshold, f"{rule.hold_s:g}s", "evaluated")
    for unsupported in rule_file.unsupported:
        table.add_row(unsupported.name, "", "", "", f"Prometheus only: {unsupported.reason}")
    Console(width=160).print(table)
    typer.echo(f"{len(rule_file.alerting)} evaluated, {len(rule_file.unsupported)} Prometheus only, "
               f"{len(inhibit)} inhibit rules from {alertmanager}")


RANGES_HELP = ("Folder of the models' measured operating ranges (*.operating-range.json; default: the calibration "
               "cache, ~/.cache/prunewatch/calibration, where `prunewatch run` and `prunewatch tune --model` write them).")


def _range_dir(ranges: Path | None) -> Path:
    from prunewatch.engine.paths import calibration_cache  # a path only: the engine is not loaded

    return ranges if ranges is not None else calibration_cache()


def thresholds_command(
    ranges: Annotated[Path | None, typer.Option("--ranges", help=RANGES_HELP)] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="Only this model (the `model` label its results carry).")] = None,
) -> None:
    """Show each model's measured alert thresholds and how each was obtained (what `prunewatch_alert_threshold`
    exports); a model not listed is alerted on the rule file's fallbacks."""
    from prunewatch.records.operating_range import load_ranges

    folder = _range_dir(ranges)
    found = load_ranges(folder, None if model is None else [model])
    if not found:
        typer.echo(f"no measured operating range in {folder}"
                   + (f" for model {model}" if model else "") + ": the rules use their fallbacks (PRUNEWATCH_RULE_*)")
        return
    table = Table(title=f"measured alert thresholds ({folder})")
    for column in ("model", "kind", "value", "source", "how it was obtained"):
        table.add_column(column, overflow="fold")
    for name in sorted(found):
        for t in found[name].thresholds():
            table.add_row(t.model, t.kind, f"{t.value:.4g}", t.source, t.evidence)
    Console(width=200).print(table)


def eval_command(
    db: Annotated[str, typer.Option(
        "--db", envvar=STORE_URL_ENV, help="SQLAlchemy URL of the result store.")] = DEFAULT_STORE_URL,
    rules: Annotated[Path, typer.Option("--rules", help="Rule file to evaluate.")] = RULES_PATH,
    at: Annotated[str | None, typer.Option("--at", help="Evaluation time, ISO 8601 (default: now, UTC).")] = None,
    ranges: Annotated[Path | None, typer.Option("--ranges", help=RANGES_HELP)] = None,
) -> None:
    """Evaluate every rule once over the store, with each model's measured thresholds, and show the alerts whose
    condition holds with their annotations (nothing is posted)."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError

    from prunewatch.alerts.embedded import EmbeddedAlerting
    from prunewatch.alerts.ruleset import RuleFileError
    from prunewatch.alerts.settings import AlertingSettings
    from prunewatch.records.store import StoreUnavailableError, connect_existing, safe_url

    try:
        when = datetime.fromisoformat(at) if at else datetime.now(UTC)
    except ValueError:
        raise fail(f"--at {at!r} is not an ISO 8601 time such as 2026-03-02T09:00:00+00:00")
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        engine = connect_existing(db)
    except StoreUnavailableError as exc:
        raise fail(str(exc))
    try:
        if not inspect(engine).has_table("probe_results"):
            raise fail(f"store {safe_url(db)} has no probe results table; run the collector (`prunewatch run` or "
                       "`prunewatch collect`) or `prunewatch db upgrade` first")
        from prunewatch.records.operating_range import load_ranges, thresholds_of

        thresholds = thresholds_of(load_ranges(_range_dir(ranges)).values())
        alerting = EmbeddedAlerting(AlertingSettings(rules_path=rules, state_path=None), engine, thresholds=thresholds)
        evaluation = alerting.evaluate(when)
    except RuleFileError as exc:
        raise fail(str(exc))
    except SQLAlchemyError as exc:
        raise fail(f"cannot read the store {safe_url(db)}: {str(exc).splitlines()[0]}")
    finally:
        engine.dispose()
    typer.echo(f"store {safe_url(db)}")
    models = sorted({t.model for t in thresholds})
    typer.echo(f"measured thresholds: {', '.join(models) if models else 'none'} (from {_range_dir(ranges)}); other "
               "models are alerted on the rule file's fallbacks")
    table = Table(title=f"alerts at {when.isoformat()} (one evaluation: holds longer than 0s show as pending)")
    for column in ("rule", "labels", "value (from the rule's expression)", "state"):
        table.add_column(column)
    active = alerting.evaluator.alerts()
    for alert in active:
        labels = ", ".join(f"{k}={v}" for k, v in alert.labels if k != "alertname")
        table.add_row(alert.rule, labels, f"{alert.value:.4g}", alert.state)
    Console(width=160).print(table)
    if not active:
        typer.echo("no alert holds")
    for alert in active:  # the annotation as Slack would get it, with the threshold and how it was obtained
        labels = ", ".join(f"{k}={v}" for k, v in alert.labels if k not in ("alertname", "severity"))
        typer.echo(f"{alert.rule} ({labels}): {alert.annotations.get('description', '')}")
    for error in evaluation.errors:
        typer.echo(f"rule {error.rule} failed: {error.message}", err=True)
    for rule in alerting.unsupported:
        typer.echo(f"not evaluated without Prometheus: {rule}")
