"""`prunewatch run`: the embedded collector (in-process engine, SQLite, /metrics, live table)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from prunewatch.collector.exporters import LogExporter, SqlExporter
from prunewatch.collector.exposition import start_metrics_server
from prunewatch.collector.governor import GovernedTarget, Governor, GovernorSettings, start_governing
from prunewatch.collector.in_process import InProcessTarget
from prunewatch.collector.live_table import round_table
from prunewatch.collector.probe_round import RoundSummary
from prunewatch.collector.reference import EngineReference
from prunewatch.collector.scheduler import ProbeScheduler, RoundTotals, TargetJob, run_until_done
from prunewatch.collector.settings import CollectorSettings
from prunewatch.engine import EngineSettings, PruningEngine
from prunewatch.engine.loading import check_model_dir
from prunewatch.engine.threads import release_openmp_team
from prunewatch.probes import load_calibration_set, load_probes
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.results import utcnow
from prunewatch.records.store import ResultRepository, connect_without_writing, create_schema

logger = logging.getLogger("prunewatch.collector")


@dataclass
class RunOutcome:
    rounds: int
    results: int
    failures: int


def _embedded_alerting(settings: CollectorSettings, db, thresholds=()):
    """The same rules as Prometheus, evaluated over the store with the model's measured thresholds; state kept
    beside a SQLite store."""
    from sqlalchemy.engine import make_url

    from prunewatch.alerts import AlertingSettings, EmbeddedAlerting

    alert_settings = AlertingSettings()
    if "state_path" not in alert_settings.model_fields_set:  # default: beside a SQLite store
        url = make_url(settings.db_url)
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            alert_settings = alert_settings.model_copy(
                update={"state_path": Path(url.database).with_suffix(".alerts.json")})
    return EmbeddedAlerting(alert_settings, db, thresholds=thresholds)


@contextmanager
def _prompt_progress(console: Console, description: str, total: int) -> Iterator[Callable[[int, int], None]]:
    """A progress bar (prompts done of `total`, elapsed, time left) while the block runs; it starts with the
    first prompt done, so a range loaded from its cache prints nothing."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("left"), TimeRemainingColumn())
    progress = Progress(*columns, console=console, transient=False)
    task = progress.add_task(description, total=total)

    def advance(done: int, of: int) -> None:
        if not progress.live.is_started:
            progress.start()
        progress.update(task, completed=done, total=of)

    try:
        yield advance
    finally:
        if progress.live.is_started:
            progress.stop()


def _operating_range(settings: CollectorSettings, engine, reference, probe_set, calibration_digest: str, console):
    """The model's healthy operating range (its alert thresholds): cached beside the calibration, else measured
    now on the evaluation prompts of the probed domains at the engine's default configuration. Never fatal: without
    one the rules fall back to their defaults, and say so."""
    from prunewatch.collector.operating_range import RangeOutcome, evaluation_probes, load_or_measure
    from prunewatch.engine.settings import EngineSettings

    prompts = evaluation_probes(probe_set.domains)
    default = float(EngineSettings.model_fields["sensitivity"].default)
    if settings.operating_range:
        console.print(f"operating range of {engine.name}: cached, or measured now on {len(prompts.probes)} evaluation "
                      f"prompts, each dense and at sensitivity {default:g} with its reference score (once per model "
                      "and weights)")
    try:
        with _prompt_progress(console, f"operating range of {engine.name}: evaluation prompts, dense and at "
                                       f"sensitivity {default:g}", len(prompts.probes)) as advance:
            return load_or_measure(
                InProcessTarget(engine, name=settings.target_name, quality=False), reference, prompts,
                directory=engine.calibration_path(calibration_digest).parent, model=engine.name,
                fingerprint=engine.loaded.fingerprint, sensitivity=default, engine_settings=engine.settings,
                device=f"{engine.loaded.device.type}: {InProcessTarget(engine).device_name or 'unnamed'}",
                measure=settings.operating_range, progress=advance)
    except Exception as exc:  # the run goes on with the rules' fallbacks
        logger.exception("measuring the operating range of %s failed", engine.name)
        return RangeOutcome(None, "none", f"measuring the operating range failed ({type(exc).__name__}: {exc}): the "
                                          "alert rules use their fallbacks for this model")


def _close_interrupted_rounds(db: Engine, target: str, before: datetime) -> int:
    """Rounds of `target` still open from a run that died mid-round, closed as aborted (see the repository)."""
    with Session(db) as session, session.begin():
        closed = ResultRepository(session).abort_open_rounds(target=target, started_before=before)
    if closed:
        logger.info("closed %d round(s) of %s left open by an earlier run as aborted", closed, target)
    return closed


def run_embedded(settings: CollectorSettings, console: Console | None = None,
                 calibration_dir: Path | None = None, governor: GovernorSettings | None = None) -> RunOutcome:
    """Validate everything, then load, calibrate, schedule and run until done or interrupted.

    Order matters for "nothing written on bad input": the model folder, the probes, the /metrics
    address and the database URL are checked first (the URL without creating a SQLite file), then
    the model loads and is calibrated, and only then is the store created or migrated. A damaged
    model therefore fails with one ModelLoadError and leaves no store file behind. Rounds of this
    target that an earlier run left open (it was killed mid-round) are then closed as aborted.
    """
    console = console or Console(width=None if Console().is_terminal else 132)
    started_at = utcnow()
    check_model_dir(settings.model_dir)
    probe_set = load_probes(settings.probes_path)
    metrics = CollectorMetrics()
    server = None
    if settings.metrics_port:  # bound first: a taken port fails before the model loads or a file is written
        server, _thread = start_metrics_server(metrics, settings.metrics_host, settings.metrics_port)
    db = None
    try:
        db = connect_without_writing(settings.db_url)
        with console.status("loading model"):
            overrides = ({} if settings.activation_sparsity is None
                         else {"activation_sparsity": settings.activation_sparsity})
            engine = PruningEngine.load(EngineSettings(
                model_dir=settings.model_dir, device=settings.device, sensitivity=settings.sensitivity,
                calibration_dir=calibration_dir, **overrides))
        calibration_set = load_calibration_set()  # never the probes quality is read on
        with console.status("calibrating"):
            calibration, cached = engine.load_or_calibrate(calibration_set.calibration_texts(), calibration_set.digest)
        # The engine does not check its own answers: the job's reference, the same weights run dense, scores what
        # was served (reference-scored agreement, NLL, divergence from the reference's own answer, cached per probe).
        reference = EngineReference(engine)
        # Probes run on the engine's generation thread (InProcessTarget): this thread's OpenMP team, left from
        # loading and calibrating, would be a second team, and two make every decode step sleep and wake.
        release_openmp_team()
        alerting = _embedded_alerting(settings, db) if settings.alerts else None  # after the model: its warnings
        create_schema(db)  # the first write: creates a SQLite file
        aborted = _close_interrupted_rounds(db, settings.target_name, started_at)
    except BaseException:
        if server is not None:
            server.shutdown()
        if db is not None:
            db.dispose()
        raise
    if aborted:
        console.print(f"closed {aborted} round(s) of {settings.target_name} left open by an earlier run as aborted")
    console.print(f"model {engine.name} on {engine.loaded.device.type} ({engine.num_layers} layers); calibration "
                  f"{'loaded from cache' if cached else 'measured'} for domains {sorted(calibration.domains)}")
    try:
        operating = _operating_range(settings, engine, reference, probe_set, calibration_set.digest, console)
    except BaseException:  # Ctrl-C while measuring: nothing half-done stays open
        if server is not None:
            server.shutdown()
        db.dispose()
        raise
    thresholds = operating.range.thresholds() if operating.range is not None else []
    metrics.set_thresholds(thresholds)
    if alerting is not None:
        alerting.set_thresholds(thresholds)
    console.print(f"alert thresholds: {operating.detail}"
                  + (f" ({len(thresholds)} thresholds; `prunewatch alerts thresholds` shows them)" if thresholds else ""))
    if settings.baseline_every:
        console.print(f"dense baseline every {settings.baseline_every} round(s), the first included")
    if server is not None:
        console.print(f"metrics on http://{settings.metrics_host}:{settings.metrics_port}/metrics")

    sql = SqlExporter(db)
    target: InProcessTarget | GovernedTarget = InProcessTarget(engine, name=settings.target_name, sensitivity=settings.sensitivity, quality=False)
    governing = None
    if governor is not None:  # each domain's probes run at the governed sensitivity, decisions stored in `db`
        governing = Governor({settings.target_name: governor})
        target = GovernedTarget(target, governing)
        start_governing(governing, [TargetJob(target, probe_set, settings.interval_s)], registry=metrics.registry,
                        on_change=metrics.changed, store=db)
        console.print(f"governor: reference-scored agreement floor {governor.floor:g}, sensitivity "
                      f"{governor.min_sensitivity:g}..{governor.max_sensitivity:g}")
    totals = RoundTotals()
    live = Live(console=console, auto_refresh=False, transient=False)

    def on_round(summary: RoundSummary) -> None:
        totals.add(summary)
        if governing is not None:
            governing.observe_round(summary)  # before the next round, which runs at the new setting
        live.update(round_table(summary, totals.rounds), refresh=True)
        if alerting is not None:
            alerting.after_round(utcnow())  # never raises; transitions and deliveries are logged

    job = TargetJob(target, probe_set, settings.interval_s, baseline_every=settings.baseline_every or None,
                    reference=reference)
    scheduler = ProbeScheduler([job], [sql, metrics, LogExporter()], rounds=settings.rounds,
                               misfire_grace_s=settings.misfire_grace_s, on_round=on_round)
    try:
        with live:
            run_until_done(scheduler, on_interrupt=lambda: console.print("stopping: finishing the probe in flight"))
        if not console.is_terminal:  # written to a file or pipe, the last table ends without a newline
            console.line()
    finally:
        if server is not None:
            server.shutdown()
        db.dispose()
    return RunOutcome(rounds=totals.rounds, results=totals.results, failures=totals.failures)
