"""Commands of the production collector, as plain functions the `prunewatch` app mounts.

    prunewatch collect --config targets.yaml [--db URL] [--rounds N]
    prunewatch db upgrade --db URL
    prunewatch db prune --db URL --older-than 90d [--dry-run]
    prunewatch tune --config targets.yaml --target T
    prunewatch doctor --config targets.yaml --target T

Bad input is one `error: ...` line and exit code 2; doctor exits 1 when a check fails.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Annotated, cast

import typer

from prunewatch.cli_errors import fail, first_validation_error
from prunewatch.collector.settings import INTERVAL_ENV
from prunewatch.records.settings import DEFAULT_STORE_URL, STORE_URL_ENV
from prunewatch.records.store.database import safe_url


def configure_logging(verbose: bool) -> None:
    """One log format for the scheduling commands (run, collect); APScheduler's coalescing notes only when verbose."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    if not verbose:  # a round longer than its interval is coalesced by design; say so only when asked
        logging.getLogger("apscheduler").setLevel(logging.ERROR)


def collect_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="Targets file (YAML).")],
    db: Annotated[str | None, typer.Option(
        "--db", envvar=STORE_URL_ENV, help="SQLAlchemy URL of the store (overrides the file).")] = None,
    interval: Annotated[float | None, typer.Option(
        "--interval", envvar=INTERVAL_ENV, min=1.0, max=86_400.0,
        help="Seconds between rounds of every target (overrides the file).")] = None,
    buffer: Annotated[Path | None, typer.Option(
        "--buffer", help="On-disk buffer file (default prunewatch-buffer.sqlite).")] = None,
    rounds: Annotated[int | None, typer.Option(
        "--rounds", min=1, help="Stop after N rounds per target (default: run on).")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Port of /metrics (0 disables; default 9464).")] = None,
    metrics_host: Annotated[str | None, typer.Option(
        "--metrics-host", help="Address of /metrics (default 127.0.0.1).")] = None,
    pushgateway: Annotated[str | None, typer.Option(
        "--pushgateway", help="Pushgateway URL to push to after each round.")] = None,
    target: Annotated[list[str] | None, typer.Option("--target", "-t", help="Probe only this target (repeatable).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every probe result as JSON.")] = False,
) -> None:
    """The production collector: every configured target on its schedule, PostgreSQL, nothing lost."""
    from pydantic import ValidationError

    from prunewatch.collector.exposition import MetricsPortError
    from prunewatch.collector.fleet import FleetSettings, build_jobs, run_collector
    from prunewatch.collector.spool import SpoolError
    from prunewatch.collector.target_config import TargetConfigError, load_targets
    from prunewatch.engine.errors import EngineError
    from prunewatch.probes import ProbeFileError, load_probes
    from prunewatch.records.store import StoreUnavailableError, connect

    configure_logging(verbose)
    try:
        parsed = load_targets(config)
        settings = FleetSettings().with_file(parsed, db_url=db, buffer_path=buffer, rounds=rounds,
                                             metrics_port=metrics_port, metrics_host=metrics_host,
                                             pushgateway_url=pushgateway)
        connect(settings.db_url, check=False).dispose()  # the URL is usable (the server may still be down)
        probe_set = load_probes(settings.probes_path)
        jobs = build_jobs(parsed, probe_set, calibration_dir=settings.calibration_dir, only=target or None,
                          interval_s=interval)
    except ValidationError as exc:
        raise fail(first_validation_error(exc))
    except (TargetConfigError, ProbeFileError, EngineError, StoreUnavailableError, ValueError) as exc:
        raise fail(str(exc))
    typer.echo(f"probing {len(jobs)} target(s): " + ", ".join(
        f"{j.target.name} every {j.interval_s:g}s ({len(j.probe_set.probes)} probes)" for j in jobs)
        + f"; store {safe_url(settings.db_url)}, buffer {settings.buffer_path}")

    def on_round(summary) -> None:
        typer.echo(f"round {summary.round_id[:8]} {summary.target}: {summary.ok} ok, {summary.failed} failed")

    try:
        outcome = run_collector(settings, jobs, on_round=on_round)
    except (SpoolError, StoreUnavailableError, MetricsPortError) as exc:
        raise fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(130)
    typer.echo(f"done: {outcome.rounds} round(s), {outcome.results} result(s), {outcome.failures} failed; "
               f"{outcome.written} written to the store, {outcome.buffered} record(s) left in the buffer")


def db_upgrade_command(
    db: Annotated[str, typer.Option(
        "--db", envvar=STORE_URL_ENV, help="SQLAlchemy URL of the store.")] = DEFAULT_STORE_URL,
    revision: Annotated[str, typer.Option("--revision", help="Target revision (default: the newest).")] = "head",
) -> None:
    """Create or migrate the store's schema (Alembic)."""
    from prunewatch.records.store import StoreUnavailableError, connect
    from prunewatch.records.store.migrate import upgrade

    try:
        engine = connect(db)
        before, after = upgrade(engine, revision)
    except StoreUnavailableError as exc:
        raise fail(str(exc))
    except Exception as exc:  # alembic's own errors: an unknown revision, for one
        raise fail(f"cannot migrate to {revision!r}: {str(exc).splitlines()[0]}")
    engine.dispose()
    unchanged = ""
    if before == after:  # alembic's upgrade to an older revision does nothing, silently
        unchanged = " (already current)" if revision in ("head", after) else \
            f" (already past {revision}: an upgrade never goes back, nothing changed)"
    typer.echo(f"store {safe_url(db)}: schema {before or 'empty'} -> {after}{unchanged}")


SHORTEST_UNCONFIRMED_AGE = timedelta(days=1)
"""`db prune` deletes results younger than this only with --yes."""


def db_prune_command(
    older_than: Annotated[str, typer.Option("--older-than", help="Delete results older than this: 90d, 12h, 2w, 30m.")],
    db: Annotated[str, typer.Option(
        "--db", envvar=STORE_URL_ENV, help="SQLAlchemy URL of the store.")] = DEFAULT_STORE_URL,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would be deleted; delete nothing.")] = False,
    yes: Annotated[bool, typer.Option(
        "--yes", help="Prune with an age under a day (`30m` is 30 minutes, not months).")] = False,
) -> None:
    """Retention: delete probe results (and emptied rounds) and superseded governor decisions older than the given age."""
    from prunewatch.records.store import StoreUnavailableError, connect_existing
    from prunewatch.records.store.migrate import is_current
    from prunewatch.records.store.retention import parse_age, prune_older_than

    try:
        age = parse_age(older_than)
    except ValueError as exc:
        raise fail(f"--older-than: {exc}")
    if age < SHORTEST_UNCONFIRMED_AGE and not dry_run and not yes:
        # m is minutes (as in Prometheus durations): `1m` meant as a month would delete nearly the whole store.
        minutes = int(age.total_seconds() // 60)
        kept = f"{minutes} minute(s)" if minutes < 60 else f"{minutes // 60} hour(s)"
        raise fail(f"--older-than {older_than.strip()} keeps only the last {kept} of results: add --yes to delete "
                   "everything older, or --dry-run to count it (m is minutes; a month is 30d)")
    try:
        engine = connect_existing(db)
        if not is_current(engine):
            raise fail(f"store {safe_url(db)} is not migrated to the current schema; run `prunewatch db upgrade`")
        report = prune_older_than(engine, age, dry_run=dry_run)
    except StoreUnavailableError as exc:
        raise fail(str(exc))
    engine.dispose()
    verb = "would delete" if report.dry_run else "deleted"
    typer.echo(f"{verb} {report.results_deleted} result(s), {report.rounds_deleted} round(s) and "
               f"{report.decisions_deleted} superseded governor decision(s) older than "
               f"{report.cutoff.isoformat(timespec='seconds')} from store {safe_url(db)}")


def _grid(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--points: expected comma-separated numbers, got {text!r}") from None
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"--points: sensitivities must be within [0, 1], got {text!r}")
    return values


def tune_command(
    target: Annotated[str | None, typer.Option("--target", "-t", help="Name of the target in the config file.")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Targets file (YAML).")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="Instead of a target: tune the engine in this process on this "
                        "model folder (or known model name, pulled on first use).")] = None,
    device: Annotated[str, typer.Option("--device", help="With --model: auto, cpu or cuda.")] = "auto",
    quality_floor: Annotated[float, typer.Option(
        "--quality-floor", min=0.01, max=1.0,
        help="Quality below this is lost quality (sets the alert thresholds).")] = 0.95,
    points: Annotated[str, typer.Option(
        "--points", help="Sensitivities to sweep; must include 0 and 1.")] = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
    margin: Annotated[float, typer.Option("--margin", help="Safety margin below the knee.")] = 0.07,
    out: Annotated[Path, typer.Option("--out", help="Folder for tune-<target>.json and .png.")] = Path("."),
    repeats: Annotated[int, typer.Option(
        "--repeats", help="Sweeps over the grid (alternating direction); median latency.")] = 1,
    blacklist: Annotated[bool, typer.Option("--blacklist", help="Also discover a layer blacklist (per-layer A/B).")] = False,
    probes: Annotated[Path | None, typer.Option("--probes", help="Probes YAML (default: the canonical probes).")] = None,
) -> None:
    """Sweep sensitivity 0..1 on a target, find the knee on the reference-scored agreement, recommend knee - margin,
    and record the model's operating range and alert thresholds (JSON, plot, tune-<target>-range.json)."""
    import dataclasses

    from prunewatch.alerts.settings import RuleSettings
    from prunewatch.collector.fleet import FleetSettings, build_jobs, load_engine_cached
    from prunewatch.collector.in_process import InProcessTarget
    from prunewatch.collector.reference import EngineReference, Reference
    from prunewatch.collector.target_config import TargetConfigError, load_targets
    from prunewatch.collector.targets import TunableTarget
    from prunewatch.collector.tune import TuneError, TuneSettings, tune, write_operating_range, write_report
    from prunewatch.engine.errors import EngineError
    from prunewatch.engine.settings import EngineSettings
    from prunewatch.models_cli import model_folder
    from prunewatch.probes import DEFAULT_PROBES_PATH, ProbeFileError, load_probes
    from prunewatch.records.operating_range import range_path

    configure_logging(False)
    if (model is None) == (config is None) or (config is not None) != (target is not None):
        raise fail("give either --config and --target (a configured target) or --model (the engine in this process)")
    try:
        settings = TuneSettings(sensitivities=_grid(points), margin=margin, repeats=repeats, blacklist=blacklist,
                                quality_floor=quality_floor, configured_red_line=RuleSettings().quality_red_line)
        default = float(EngineSettings.model_fields["sensitivity"].default)
        subject: TunableTarget
        reference: Reference | None
        if model is not None:
            probe_set = load_probes(probes or DEFAULT_PROBES_PATH)
            engine = load_engine_cached(model_folder(model), device, FleetSettings().calibration_dir, {})
            # Quality of what was served: the same weights run dense score every answer of the sweep.
            subject, subject_probes = InProcessTarget(engine, name=engine.name, quality=False), probe_set
            reference = EngineReference(engine)
        else:
            assert config is not None and target is not None  # by the check above
            parsed = load_targets(config)
            probe_set = load_probes(probes or parsed.collector.probes_path or DEFAULT_PROBES_PATH)
            (job,) = build_jobs(parsed, probe_set, only=[target], calibration_dir=FleetSettings().calibration_dir)
            settings = dataclasses.replace(settings, probe_timeout_s=job.timeout_s or settings.probe_timeout_s)
            # tune() refuses, with a TuneError, a target that cannot change its sensitivity per request.
            subject, subject_probes, reference = cast("TunableTarget", job.target), job.probe_set, job.reference
            configured = parsed.target(target).sensitivity
            if configured is not None:
                default = configured
        report = tune(subject, subject_probes, settings, progress=lambda m: typer.echo(f"  {m}", err=True),
                      reference=reference, default_sensitivity=default)
    except (TuneError, TargetConfigError, ProbeFileError, EngineError, ValueError) as exc:
        raise fail(str(exc))
    json_path, png_path = write_report(report, out)
    range_file = write_operating_range(report, out)
    installed = None
    if model is not None and report.operating_range is not None:  # what `run` and `alerts eval` read for it
        installed = range_path(engine.calibration_path("x").parent, engine.name, engine.loaded.fingerprint)
        report.operating_range.save(installed)
    typer.echo(f"{'sensitivity':>11} {'ratio':>7} {'latency ms':>10} {'quality':>8} {'failed':>6}")
    for p in report.points:
        ratio = "—" if p.pruning_ratio is None else f"{p.pruning_ratio:.3f}"
        typer.echo(f"{p.sensitivity:>11.2f} {ratio:>7} {p.latency_ms:>10.1f} {p.quality:>8.3f} {p.failed:>6}")
    typer.echo(f"latency: {report.latency_source}; quality: {report.quality_source}")
    typer.echo(f"quality knee {report.quality_knee if report.quality_knee is not None else 'none'}, latency knee "
               f"{report.latency_knee if report.latency_knee is not None else 'none'} -> knee {report.knee:.2f}; "
               f"recommended sensitivity {report.recommended_sensitivity:.2f} (margin {report.margin:.2f})")
    if blacklist:
        typer.echo(f"recommended layer blacklist: {report.recommended_blacklist or 'none'} "
                   f"({len(report.blacklist_trials)} layer(s) tried)")
    if report.operating_range is not None:
        for t in report.operating_range.thresholds():
            typer.echo(f"alert threshold {t.kind}: {t.value:.4g} ({t.evidence})")
    else:
        typer.echo("no operating range: no probe succeeded at the default sensitivity and dense")
    typer.echo(f"wrote {json_path}, {png_path}" + (f" and {range_file}" if range_file else ""))
    if installed is not None:
        typer.echo(f"installed the operating range as {installed}: `prunewatch run` and `prunewatch alerts eval` "
                   "read its thresholds for this model")
    elif range_file is not None:
        typer.echo("copy it into the collector's operating-range folder (PRUNEWATCH_COLLECTOR_OPERATING_RANGE_DIR) "
                   "for the collector to export its thresholds")


def doctor_command(
    target: Annotated[str | None, typer.Option("--target", "-t", help="Name of the target in the config file.")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Targets file (YAML) of a collector; without it, the main job (`prunewatch run`) "
                               "as its PRUNEWATCH_* variables configure it.")] = None,
    db: Annotated[str | None, typer.Option(
        "--db", envvar=STORE_URL_ENV, help="Store URL (default: the file's, else sqlite).")] = None,
    metrics_url: Annotated[str | None, typer.Option(
        "--metrics-url", help="The collector's /metrics (default from the file's metrics_host/port).")] = None,
) -> None:
    """The pruning autopsy: one PASS/FAIL line per check with what to do; exit code 1 if any FAIL."""
    from prunewatch.collector.doctor import run_doctor
    from prunewatch.collector.fleet import FleetSettings
    from prunewatch.collector.target_config import TargetConfigError, load_targets
    from prunewatch.probes import DEFAULT_PROBES_PATH, ProbeFileError, load_probes

    configure_logging(False)
    if config is None:
        if target is not None:
            raise fail("--target names a target of a --config file; without --config doctor checks the main job "
                       "(`prunewatch run`)")
        spec, probe_set, db_url, metrics_url, calibration_dir = _main_job_doctor(db, metrics_url)
    else:
        if target is None:
            raise fail("--config needs --target: the name of the target to check")
        try:
            parsed = load_targets(config)
            spec = parsed.target(target)
            probe_set = load_probes(parsed.collector.probes_path or DEFAULT_PROBES_PATH)
        except (TargetConfigError, ProbeFileError) as exc:
            raise fail(str(exc))
        section = parsed.collector
        if metrics_url is None and section.metrics_port != 0:
            metrics_url = f"http://{section.metrics_host or '127.0.0.1'}:{section.metrics_port or 9464}/metrics"
        db_url, calibration_dir = db or section.db_url or DEFAULT_STORE_URL, FleetSettings().calibration_dir
    checks = run_doctor(spec, probe_set, db_url=db_url, collector_metrics_url=metrics_url, calibration_dir=calibration_dir)
    typer.echo(f"prunewatch doctor: target {spec.name} ({spec.kind}"
               + (f", {spec.base_url}" if spec.base_url else "") + ")")
    for check in checks:
        for line in check.lines():
            typer.echo(line)
    failed = [c.name for c in checks if c.failed]
    typer.echo(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else "all checks passed")
    if failed:
        raise typer.Exit(1)


def _main_job_doctor(db: str | None, metrics_url: str | None):
    """The main job's target, probes, store, /metrics and calibration folder, as `prunewatch run` resolves them
    from its PRUNEWATCH_* variables and defaults (the model: PRUNEWATCH_MODEL_DIR, else the default model)."""
    from pydantic import ValidationError

    from prunewatch.collector.settings import CollectorSettings
    from prunewatch.collector.target_config import ResolvedTarget
    from prunewatch.engine.errors import EngineError
    from prunewatch.models_cli import main_job_model
    from prunewatch.probes import ProbeFileError, load_probes

    try:
        settings = CollectorSettings()
        model = main_job_model(settings)
        probe_set = load_probes(settings.probes_path)
    except ValidationError as exc:
        raise fail(first_validation_error(exc))
    except (EngineError, ProbeFileError) as exc:
        raise fail(str(exc))
    spec = ResolvedTarget(name=settings.target_name, kind="in_process", base_url=None, api_key_env=None, model=None,
                          model_dir=model, device=settings.device, domains=None, interval_s=settings.interval_s,
                          timeout_s=settings.interval_s, sensitivity=settings.sensitivity, jitter_s=0.0)
    if metrics_url is None and settings.metrics_port != 0:
        metrics_url = f"http://{settings.metrics_host}:{settings.metrics_port}/metrics"
    return spec, probe_set, db or settings.db_url, metrics_url, None
