"""The slice of stored probe results one evaluation needs, read incrementally between rounds, and the
quality governor's decisions in the same window (a few per round: read whole each time).

The first read loads [at - horizon, at]; later reads load only what arrived since the last one
(with an overlap for results committed a little late) and drop what fell out of the horizon, so
a round's evaluation costs one small query even with a 24 h window. A full reload every
`full_every` picks up results written much later than they were measured (a collector that
buffered them while the database was away).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from prunewatch.records.results import ProbeResult
from prunewatch.records.store import ResultRepository
from prunewatch.records.store.governor import GovernorDecision, GovernorRepository

_INCLUSIVE = timedelta(microseconds=1)  # the repository's `until` is exclusive; evaluation instants are not


class StoreHistory:
    """Cached window of results from the store behind `engine`."""

    def __init__(self, engine: Engine, horizon: timedelta, late: timedelta = timedelta(minutes=5),
                 full_every: timedelta = timedelta(minutes=10)) -> None:
        self.engine = engine
        self.horizon = horizon
        self.late = late
        self.full_every = full_every
        self._results: dict[str, ProbeResult] = {}
        self._start: datetime | None = None
        self._end: datetime | None = None
        self._full_at: datetime | None = None

    def _load(self, since: datetime, until: datetime) -> list[ProbeResult]:
        with Session(self.engine) as session:
            return ResultRepository(session).list(since=since, until=until + _INCLUSIVE)

    def results(self, at: datetime) -> list[ProbeResult]:
        """Results with created_at in [at - horizon, at], oldest first."""
        start = at - self.horizon
        if self._start is None or self._end is None or self._full_at is None or start < self._start \
                or at < self._end or at - self._full_at >= self.full_every:
            self._results = {r.result_id: r for r in self._load(start, at)}
            self._full_at = at
        else:
            for r in self._load(max(start, self._end - self.late), at):
                self._results[r.result_id] = r
            self._results = {k: r for k, r in self._results.items() if r.created_at >= start}
        self._start, self._end = start, at
        return sorted(self._results.values(), key=lambda r: (r.created_at, r.result_id))

    def decisions(self, at: datetime) -> list[GovernorDecision]:
        """Governor decisions made in [at - horizon, at], oldest first (the order the governor wrote them)."""
        with Session(self.engine) as session:
            decisions = GovernorRepository(session).history(since=at - self.horizon)
        return [d for d in decisions if d.decided_at <= at]
