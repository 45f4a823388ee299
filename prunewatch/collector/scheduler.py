"""Schedule probe rounds with APScheduler 3.x and stop cleanly after N rounds or on a signal.

One scheduler per process (APScheduler 3.x cannot share a job store between processes). Each
target has one job with max_instances=1 and coalescing: a slow round delays the next instead of
stacking, and missed runs collapse into one. A misfire grace time lets a round that starts a
little late still run, and jitter spreads the rounds of many targets so they do not all start in
the same second.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers.background import BackgroundScheduler

from prunewatch.collector.exporters import Exporter
from prunewatch.collector.probe_round import RoundSummary, run_round
from prunewatch.collector.reference import Reference
from prunewatch.collector.targets import Target
from prunewatch.probes import ProbeSet

logger = logging.getLogger("prunewatch.collector")


@dataclass(frozen=True)
class TargetJob:
    """One target's schedule: which probes, how often, how long a probe may take."""

    target: Target
    probe_set: ProbeSet
    interval_s: float
    timeout_s: float | None = None  # None: no deadline (the embedded default)
    jitter_s: float = 0.0
    first_delay_s: float = 0.0  # spread first rounds too when many targets start at once
    baseline_every: int | None = None  # every N rounds (the first included) also probe dense: a measured baseline
    reference: Reference | None = None  # scores every served answer against a dense model (collector.reference)


class ProbeScheduler:
    """Runs `run_round` for each job's target every job's `interval_s`, first round immediately."""

    def __init__(
        self,
        jobs: Sequence[TargetJob],
        exporters: Sequence[Exporter],
        *,
        rounds: int | None = None,
        misfire_grace_s: float = 60.0,
        on_round: Callable[[RoundSummary], None] | None = None,
    ) -> None:
        names = [job.target.name for job in jobs]
        if len(set(names)) != len(names):
            raise ValueError(f"target names must be unique, got {names}")
        self.jobs = list(jobs)
        self.exporters = list(exporters)
        self.rounds = rounds
        self.on_round = on_round
        self.stop_event = threading.Event()  # set: finish the current probe, then stop
        self.done = threading.Event()
        self.completed_rounds = 0
        self.rounds_by_target = {name: 0 for name in names}
        self._lock = threading.Lock()
        self._scheduler = BackgroundScheduler(timezone=UTC)
        now = datetime.now(UTC)
        for job in self.jobs:
            self._scheduler.add_job(
                self._run, "interval", args=[job], seconds=job.interval_s, jitter=job.jitter_s or None,
                id=f"probe-round:{job.target.name}", next_run_time=now + timedelta(seconds=job.first_delay_s),
                max_instances=1, coalesce=True, misfire_grace_time=max(1, int(misfire_grace_s)),
            )

    def _run(self, job: TargetJob) -> None:
        name = job.target.name
        with self._lock:
            if self.stop_event.is_set() or (self.rounds is not None and self.rounds_by_target[name] >= self.rounds):
                return
        with self._lock:
            baseline = job.baseline_every is not None and self.rounds_by_target[name] % job.baseline_every == 0
        summary = run_round(job.target, job.probe_set, self.exporters, stop=self.stop_event, timeout_s=job.timeout_s,
                            baseline=baseline, reference=job.reference)
        with self._lock:
            self.completed_rounds += 1
            self.rounds_by_target[name] += 1
            finished = self.rounds is not None and all(n >= self.rounds for n in self.rounds_by_target.values())
        if self.on_round is not None:
            try:
                self.on_round(summary)
            except Exception:
                logger.exception("round callback failed")
        if finished:
            self.stop_event.set()
            self.done.set()

    def start(self) -> None:
        self._scheduler.start()

    def shutdown(self) -> None:
        """Stop scheduling, let the running probe finish and be recorded, then return."""
        self.stop_event.set()
        self._scheduler.shutdown(wait=True)


@dataclass
class RoundTotals:
    """What a run did, round by round (the outcome `run` and `collect` print)."""

    rounds: int = 0
    results: int = 0
    failures: int = 0

    def add(self, summary: RoundSummary) -> None:
        self.rounds += 1
        self.results += len(summary.results)
        self.failures += summary.failed


def run_until_done(scheduler: ProbeScheduler, stop: threading.Event | None = None,
                   on_interrupt: Callable[[], None] | None = None) -> None:
    """Run `scheduler` until its rounds are done, `stop` is set, SIGTERM arrives or Ctrl-C is pressed.

    The probe in flight is finished and recorded in every case (shutdown waits for it). SIGTERM is
    handled only from the main thread (signal handlers cannot be set elsewhere) and restored after.
    Ctrl-C calls `on_interrupt` (say that the run is stopping) instead of propagating.
    """
    restore = None
    if threading.current_thread() is threading.main_thread():
        restore = signal.getsignal(signal.SIGTERM)

        def on_sigterm(*_: object) -> None:
            scheduler.stop_event.set()
            scheduler.done.set()

        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        scheduler.start()
        while not scheduler.done.wait(0.2):
            if stop is not None and stop.is_set():
                break
    except KeyboardInterrupt:
        if on_interrupt is None:
            raise
        on_interrupt()
    finally:
        scheduler.shutdown()
        if restore is not None:
            signal.signal(signal.SIGTERM, restore)
