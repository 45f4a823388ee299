"""Schedule probe rounds with APScheduler 3.x and stop cleanly after N rounds or on a signal.

One scheduler per process (APScheduler 3.x cannot share a job store between processes). Each
target has one job with max_instances=1 and coalescing: a slow round delays the next instead of
stacking, and missed runs collapse into one.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import Callable, Sequence

from apscheduler.schedulers.background import BackgroundScheduler

from collector.exporters import Exporter
from collector.probe_round import RoundSummary, run_round
from collector.targets import Target
from probes import ProbeSet

logger = logging.getLogger("prunewatch.collector")


class ProbeScheduler:
    """Runs `run_round` for each target every `interval_s`, first round immediately."""

    def __init__(
        self,
        targets: Sequence[Target],
        probe_set: ProbeSet,
        exporters: Sequence[Exporter],
        *,
        interval_s: float,
        rounds: int | None = None,
        misfire_grace_s: float = 60.0,
        on_round: Callable[[RoundSummary], None] | None = None,
    ) -> None:
        self.targets = list(targets)
        self.probe_set = probe_set
        self.exporters = list(exporters)
        self.interval_s = interval_s
        self.rounds = rounds
        self.on_round = on_round
        self.stop_event = threading.Event()  # set: finish the current probe, then stop
        self.done = threading.Event()
        self.completed_rounds = 0
        self._lock = threading.Lock()
        self._scheduler = BackgroundScheduler(timezone=timezone.utc)
        for target in self.targets:
            self._scheduler.add_job(
                self._run, "interval", args=[target], seconds=interval_s, id=f"probe-round:{target.name}",
                next_run_time=datetime.now(timezone.utc), max_instances=1, coalesce=True,
                misfire_grace_time=int(misfire_grace_s),
            )

    def _run(self, target: Target) -> None:
        if self.stop_event.is_set():
            return
        summary = run_round(target, self.probe_set, self.exporters, stop=self.stop_event)
        with self._lock:
            self.completed_rounds += 1
            finished = self.rounds is not None and self.completed_rounds >= self.rounds * len(self.targets)
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

    def wait(self, poll_s: float = 0.2) -> None:
        """Block until the requested rounds are done (or forever); Ctrl-C propagates to the caller."""
        while not self.done.wait(poll_s):
            pass

    def shutdown(self) -> None:
        """Stop scheduling, let the running probe finish and be recorded, then return."""
        self.stop_event.set()
        self._scheduler.shutdown(wait=True)
