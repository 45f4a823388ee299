"""`prunewatch collect`: the production collector: several targets, PostgreSQL, nothing lost.

One process, one APScheduler (3.x cannot share a job store between processes); each target is a
job with its own interval, timeout and jitter. Results go to the disk buffer first and from there
to the store (see buffered.py); Prometheus samples are taken in memory, so /metrics keeps
answering while the database is down. The run starts even when the database is unreachable: it
buffers until the database comes back.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url

from prunewatch.collector.buffered import Backoff, BufferedStore
from prunewatch.collector.exporters import LogExporter
from prunewatch.collector.exposition import start_metrics_server
from prunewatch.collector.governor import GovernedTarget, Governor, governor_of, start_governing
from prunewatch.collector.http_target import HttpTarget
from prunewatch.collector.probe_round import RoundSummary
from prunewatch.collector.pushgateway import Pushgateway
from prunewatch.collector.reference import ChatTemplate, EngineReference, HttpReference, Reference, ReferenceError
from prunewatch.collector.scheduler import ProbeScheduler, RoundTotals, TargetJob, run_until_done
from prunewatch.collector.spool import DiskSpool
from prunewatch.collector.target_config import CollectorConfig, ReferenceSpec, ResolvedTarget, TargetConfigError
from prunewatch.collector.targets import Target
from prunewatch.probes import DEFAULT_PROBES_PATH, ProbeFileError, ProbeSet, load_calibration_set
from prunewatch.records.metrics import CollectorMetrics
from prunewatch.records.settings import DEFAULT_STORE_URL, STORE_URL_ENV
from prunewatch.records.store import StoreUnavailableError, connect
from prunewatch.records.store.migrate import upgrade

logger = logging.getLogger("prunewatch.collector")


class FleetSettings(BaseSettings):
    """How the production collector stores, buffers and exposes what it measures."""

    model_config = SettingsConfigDict(env_prefix="PRUNEWATCH_COLLECTOR_", extra="ignore", populate_by_name=True)

    db_url: str = Field(DEFAULT_STORE_URL, validation_alias=STORE_URL_ENV,
                        description="SQLAlchemy URL; postgresql+psycopg://... in production (PRUNEWATCH_DB_URL).")
    buffer_path: Path = Field(Path("prunewatch-buffer.sqlite"),
                              description="On-disk buffer of records not yet in the store; survives restarts.")
    buffer_max_results: int = Field(100_000, ge=1, le=100_000_000,
                                    description="Results the buffer holds before dropping the oldest.")
    batch_size: int = Field(500, ge=1, le=50_000, description="Records per store transaction.")
    backoff_initial_s: float = Field(0.5, gt=0.0, le=60.0, description="First retry delay after a failed write.")
    backoff_max_s: float = Field(30.0, gt=0.0, le=3600.0, description="Longest retry delay.")
    drain_timeout_s: float = Field(10.0, ge=0.0, le=3600.0,
                                   description="At exit, how long to keep writing the buffer before leaving it.")
    rounds: int | None = Field(None, ge=1, description="Stop after N rounds per target; None runs until stopped.")
    misfire_grace_s: float = Field(60.0, ge=1.0,
                                   description="A round that starts this late still runs (then coalesced).")
    metrics_host: str = Field("127.0.0.1", description="Address of /metrics.")
    metrics_port: int = Field(9464, ge=0, le=65535, description="/metrics port; 0 disables it.")
    pushgateway_url: str | None = Field(None, description="Push the registry here after each round and at exit.")
    pushgateway_job: str = Field("prunewatch_collector", min_length=1, description="Pushgateway job label.")
    probes_path: Path = Field(DEFAULT_PROBES_PATH, description="Canonical probes YAML.")
    calibration_dir: Path | None = Field(None, description="Calibration cache of in-process engines.")
    operating_range_dir: Path | None = Field(
        None, description="Folder of measured operating ranges (*.operating-range.json, written by `prunewatch run` "
                          "and `prunewatch tune`) whose alert thresholds the collector exports for the models it "
                          "probes (default: the calibration dir, else ~/.cache/prunewatch/calibration).")

    @field_validator("db_url")
    @classmethod
    def _parseable(cls, value: str) -> str:
        make_url(value)  # raises ArgumentError (a ValueError) on garbage
        return value

    @model_validator(mode="after")
    def _backoff_order(self) -> FleetSettings:
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(f"backoff_initial_s ({self.backoff_initial_s}) exceeds backoff_max_s ({self.backoff_max_s})")
        return self

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:  # printing the settings never shows the database password
        for name, value in super().__repr_args__():
            yield name, (self.store_fingerprint() if name == "db_url" else value)

    def store_fingerprint(self) -> str:
        return make_url(self.db_url).render_as_string(hide_password=True)

    def with_file(self, config: CollectorConfig, **explicit: Any) -> FleetSettings:
        """These settings (from the environment) over the config file's `collector:` section, under the
        flags the user passed explicitly: flag > environment > file > default."""
        section = {k: v for k, v in config.collector.model_dump().items() if v is not None}
        from_environment = {name: getattr(self, name) for name in self.model_fields_set}
        flags = {k: v for k, v in explicit.items() if v is not None}
        return FleetSettings(**{**section, **from_environment, **flags})


@dataclass
class FleetOutcome:
    rounds: int
    results: int
    failures: int
    written: int  # results inserted into the store by this run (replayed ones included)
    buffered: int  # records still on disk at exit (written by the next start)


EngineCache = dict[tuple[str, str], Any]
"""(model folder, device) -> its loaded PruningEngine (Any: the engine, and torch, are imported only when asked for)."""


def load_engine_cached(model_dir: Path, device: str, calibration_dir: Path | None, cache: EngineCache) -> Any:
    """One engine per (model folder, device), calibrated on the calibration set (cached on disk); this thread's
    OpenMP team is released after, as the engine's probes run on its generation thread (prunewatch/engine/threads.py)."""
    from prunewatch.engine import EngineSettings, PruningEngine
    from prunewatch.engine.loading import check_model_dir
    from prunewatch.engine.threads import release_openmp_team

    key = (str(Path(model_dir).resolve()), device)
    if key not in cache:
        check_model_dir(model_dir)
        engine = PruningEngine.load(EngineSettings(model_dir=model_dir, device=device, calibration_dir=calibration_dir))
        calibration = load_calibration_set()
        engine.load_or_calibrate(calibration.calibration_texts(), calibration.digest)
        release_openmp_team()  # probes run on the engine's generation thread: this thread's team would be a second
        cache[key] = engine
    return cache[key]


def build_reference(spec: ReferenceSpec, *, calibration_dir: Path | None = None,
                    engines: EngineCache | None = None) -> Reference:
    """The live reference of a `references` entry (a local one loads its model, dense, in this process)."""
    if spec.kind == "local":
        if spec.model_dir is None:  # ReferenceSpec's validator requires it; said again for the type
            raise ValueError("a local reference needs model_dir")
        engine = load_engine_cached(spec.model_dir, spec.device, calibration_dir, engines if engines is not None
                                    else {})
        return EngineReference(engine, name=spec.name)
    if spec.template is None:
        raise ValueError("a http reference needs template")
    return HttpReference(name=spec.name, base_url=spec.base_url or "", model=spec.model or "",
                         template=ChatTemplate.from_dir(spec.template), api_key=spec.api_key(),
                         timeout_s=spec.timeout_s)


def build_target(spec: ResolvedTarget, probe_set: ProbeSet, *, calibration_dir: Path | None = None,
                 engines: EngineCache | None = None) -> Target:
    """A live Target for one resolved config entry (loads the engine for in_process targets). An in_process
    target does not check its own quality: its job's reference scores what it served (build_jobs)."""
    if spec.kind == "in_process":
        from prunewatch.collector.in_process import InProcessTarget  # the engine, and torch, only when asked for

        engine = load_engine_cached(spec.model_dir, spec.device, calibration_dir,
                                    engines if engines is not None else {})
        return InProcessTarget(engine, name=spec.name, sensitivity=spec.sensitivity, quality=False)
    return HttpTarget(name=spec.name, base_url=spec.base_url or "", model=spec.model or "", kind=spec.kind,
                      api_key=spec.api_key(), timeout_s=spec.timeout_s, sensitivity=spec.sensitivity)


def build_jobs(config: CollectorConfig, probe_set: ProbeSet, *, calibration_dir: Path | None = None,
               only: Sequence[str] | None = None, interval_s: float | None = None) -> list[TargetJob]:
    """Every configured target (or those named in `only`) with its schedule and probe subset.

    `interval_s` (a flag or PRUNEWATCH_INTERVAL_S) replaces every target's interval from the file."""
    engines: EngineCache = {}
    jobs = []
    specs = [config.target(name) for name in only] if only else config.targets
    governed_settings = {spec.name: spec.governor for spec in specs if spec.governor is not None}
    governor = Governor(governed_settings) if governed_settings else None  # one for the process
    references: dict[str, Reference] = {}
    for spec in specs:
        try:
            subset = probe_set.filter(spec.domains)
        except ProbeFileError as exc:
            raise TargetConfigError(f"{config.source}: target {spec.name}: domains: {exc}") from None
        target = build_target(spec, probe_set, calibration_dir=calibration_dir, engines=engines)
        reference: Reference | None = None
        if spec.reference is not None:
            if spec.reference.name not in references:
                try:
                    references[spec.reference.name] = build_reference(spec.reference, calibration_dir=calibration_dir,
                                                                      engines=engines)
                except ReferenceError as exc:
                    raise TargetConfigError(f"{config.source}: reference {spec.reference.name}: {exc}") from None
            reference = references[spec.reference.name]
        elif spec.kind == "in_process":
            reference = EngineReference(target.engine)  # type: ignore[attr-defined]  # its own weights, run dense
        if governor is not None and spec.name in governed_settings:
            target = GovernedTarget(target, governor)  # probes run at the governed sensitivity of their domain
        jobs.append(TargetJob(target,
                              subset, interval_s=interval_s or spec.interval_s, timeout_s=spec.timeout_s,
                              jitter_s=spec.jitter_s, baseline_every=spec.baseline_every,
                              first_delay_s=random.uniform(0.0, spec.jitter_s),  # spread first rounds too
                              reference=reference))
    return jobs


def export_thresholds(metrics: CollectorMetrics, settings: FleetSettings, jobs: Sequence[TargetJob]) -> list[str]:
    """Export the measured alert thresholds of the probed models that have an operating range; the models
    without one are alerted on the rule file's fallbacks. Returns the models with thresholds."""
    from prunewatch.engine.paths import calibration_cache
    from prunewatch.records.operating_range import load_ranges, thresholds_of

    folder = settings.operating_range_dir or settings.calibration_dir or calibration_cache()
    models = sorted({job.target.model for job in jobs if getattr(job.target, "model", None)})
    ranges = load_ranges(folder, models)
    metrics.set_thresholds(thresholds_of(ranges.values()))
    for model in models:
        if model in ranges:
            logger.info("alert thresholds of %s: measured (%s, %s)", model, ranges[model].source,
                        ranges[model].measured_at)
        else:
            logger.warning("no operating range of %s in %s: its alerts use the rule file's fallbacks", model, folder)
    return sorted(ranges)


def run_collector(settings: FleetSettings, jobs: Sequence[TargetJob], *,
                  on_round: Callable[[RoundSummary], None] | None = None,
                  stop: threading.Event | None = None, metrics: CollectorMetrics | None = None) -> FleetOutcome:
    """Probe every job's target on its schedule until the requested rounds are done or `stop` is set."""
    db = connect(settings.db_url, check=False)  # a bad URL fails here, before any file is written
    metrics = metrics or CollectorMetrics()
    export_thresholds(metrics, settings, jobs)
    server = None
    if settings.metrics_port:  # a taken port fails before the buffer, a migration or the store thread
        server, _thread = start_metrics_server(metrics, settings.metrics_host, settings.metrics_port)
    spool = DiskSpool(settings.buffer_path, store_fingerprint=settings.store_fingerprint(),
                      max_results=settings.buffer_max_results)
    store = BufferedStore(db, spool, metrics=metrics, batch_size=settings.batch_size,
                          backoff=Backoff(settings.backoff_initial_s, settings.backoff_max_s))
    try:
        before, after = upgrade(db)
        if before != after:
            logger.info("store schema migrated from %s to %s", before or "empty", after)
    except StoreUnavailableError as exc:
        logger.warning("%s; results are buffered in %s until it answers", exc, settings.buffer_path)
    if spool.depth:
        logger.warning("%d record(s) from an earlier run are waiting in %s; writing them first",
                       spool.depth, settings.buffer_path)
    store.start()
    pusher = Pushgateway(settings.pushgateway_url, metrics.registry, job=settings.pushgateway_job) \
        if settings.pushgateway_url else None
    governor = governor_of(job.target for job in jobs)
    if governor is not None:  # the exposition is cached by CollectorMetrics' state key: bump it on each decision
        start_governing(governor, jobs, registry=metrics.registry, on_change=metrics.changed, store=db)
    totals = RoundTotals()

    def round_done(summary: RoundSummary) -> None:
        totals.add(summary)
        if governor is not None and governor.governs(summary.target):
            governor.observe_round(summary)  # before the target's next round: it runs at the new setting
        if pusher is not None:
            pusher.push()
        if on_round is not None:
            on_round(summary)

    scheduler = ProbeScheduler(jobs, [store, metrics, LogExporter()], rounds=settings.rounds,
                               misfire_grace_s=settings.misfire_grace_s, on_round=round_done)
    try:
        run_until_done(scheduler, stop)
    finally:
        store.close(settings.drain_timeout_s)
        if pusher is not None:
            pusher.push()
        if server is not None:
            server.shutdown()
            server.server_close()
        for job in jobs:
            close = getattr(job.target, "close", None)
            if close is not None:
                close()
        buffered = spool.depth
        spool.close()
        db.dispose()
    return FleetOutcome(rounds=totals.rounds, results=totals.results, failures=totals.failures,
                        written=store.written, buffered=buffered)
