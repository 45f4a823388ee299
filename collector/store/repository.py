"""Read and write probe results over a session the caller owns; plain objects in and out."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from collector.results import ProbeResult
from collector.store.models import ProbeResultRow, RoundRow

_RESULT_FIELDS = [f.name for f in dataclasses.fields(ProbeResult)]


def _to_result(row: ProbeResultRow) -> ProbeResult:
    values = {name: getattr(row, name) for name in _RESULT_FIELDS}
    if values["created_at"].tzinfo is None:  # SQLite keeps no zone; every timestamp is written in UTC
        values["created_at"] = values["created_at"].replace(tzinfo=timezone.utc)
    for name in ("executed_flops", "dense_flops", "peak_memory_bytes"):
        if values[name] is not None:
            values[name] = int(values[name])
    return ProbeResult(**values)


class ResultRepository:
    """The store's query surface. It never commits: the caller's unit of work decides."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def start_round(self, *, round_id: str, target: str, model: str, started_at: datetime, probe_set_digest: str) -> None:
        if self.session.get(RoundRow, round_id) is None:
            self.session.add(RoundRow(round_id=round_id, target=target, model=model, started_at=started_at,
                                      probe_set_digest=probe_set_digest))

    def finish_round(self, round_id: str, *, finished_at: datetime, ok: int, failed: int) -> None:
        row = self.session.get(RoundRow, round_id)
        if row is not None:
            row.finished_at, row.probes_ok, row.probes_failed = finished_at, ok, failed

    def add(self, result: ProbeResult) -> bool:
        """Insert unless a row with the same result_id exists; returns whether it inserted."""
        if self.session.get(ProbeResultRow, result.result_id) is not None:
            return False
        values = result.to_dict()
        self.session.add(ProbeResultRow(**values))
        return True

    def get(self, result_id: str) -> ProbeResult | None:
        row = self.session.get(ProbeResultRow, result_id)
        return _to_result(row) if row is not None else None

    def list(self, *, since: datetime | None = None, until: datetime | None = None, target: str | None = None,
             domain: str | None = None, status: str | None = None, limit: int | None = None) -> list[ProbeResult]:
        query = select(ProbeResultRow).order_by(ProbeResultRow.created_at, ProbeResultRow.result_id)
        if since is not None:
            query = query.where(ProbeResultRow.created_at >= since)
        if until is not None:
            query = query.where(ProbeResultRow.created_at < until)
        if target is not None:
            query = query.where(ProbeResultRow.target == target)
        if domain is not None:
            query = query.where(ProbeResultRow.domain == domain)
        if status is not None:
            query = query.where(ProbeResultRow.status == status)
        if limit is not None:
            query = query.limit(limit)
        return [_to_result(row) for row in self.session.scalars(query)]

    def count(self, *, status: str | None = None) -> int:
        query = select(func.count()).select_from(ProbeResultRow)
        if status is not None:
            query = query.where(ProbeResultRow.status == status)
        return int(self.session.scalar(query) or 0)

    def round_count(self) -> int:
        return int(self.session.scalar(select(func.count()).select_from(RoundRow)) or 0)
