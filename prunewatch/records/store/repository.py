"""Read and write probe results over a session the caller owns; plain objects in and out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import CursorResult, Insert, Table, func, insert, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement

from prunewatch.records.results import ProbeResult
from prunewatch.records.store.models import (
    ROUND_ABORTED,
    ROUND_COMPLETE,
    ROUND_RUNNING,
    ProbeResultRow,
    RoundRow,
)

_RESULT_FIELDS = [f.name for f in dataclasses.fields(ProbeResult)]
# Declarative types `__table__` as any FromClause; a mapped class with a __tablename__ always has a Table.
_ROUNDS = cast(Table, RoundRow.__table__)
_RESULTS = cast(Table, ProbeResultRow.__table__)


def _to_result(row: ProbeResultRow) -> ProbeResult:
    values = {name: getattr(row, name) for name in _RESULT_FIELDS}
    if values["created_at"].tzinfo is None:  # SQLite keeps no zone; every timestamp is written in UTC
        values["created_at"] = values["created_at"].replace(tzinfo=UTC)
    for name in ("executed_flops", "dense_flops", "peak_memory_bytes"):
        if values[name] is not None:
            values[name] = int(values[name])
    return ProbeResult(**values)


class ResultRepository:
    """The store's query surface. It never commits: the caller's unit of work decides."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def _insert_ignoring_duplicates(self, table: Table, key: str) -> Insert:
        """INSERT that skips rows whose primary key exists, in the dialect's own words.

        Why: a result written, then retried after a lost acknowledgement (or replayed from the
        on-disk buffer after a crash), must not fail the batch nor appear twice.
        """
        dialect = self.session.get_bind().dialect.name
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(table).on_conflict_do_nothing(index_elements=[key])
        if dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            return sqlite_insert(table).on_conflict_do_nothing(index_elements=[key])
        return insert(table)

    def _supports_upsert(self) -> bool:
        return self.session.get_bind().dialect.name in ("postgresql", "sqlite")

    def start_round(self, *, round_id: str, target: str, model: str, started_at: datetime, probe_set_digest: str) -> None:
        self.start_rounds([dict(round_id=round_id, target=target, model=model, started_at=started_at,
                                probe_set_digest=probe_set_digest)])

    def start_rounds(self, rounds: Sequence[Mapping[str, Any]]) -> None:
        """Insert round rows (round_id, target, model, started_at, probe_set_digest); existing ids are kept.

        A target runs one round at a time (the scheduler's max_instances=1), so a round of a target
        that is still open when a later round of it starts was interrupted: its process died. It is
        closed as aborted here, in the same transaction, whichever exporter writes (direct or replayed
        from the disk buffer). Should it be alive after all (another collector probing a target of the
        same name), its own `finish_round` marks it complete again with its real counts.
        """
        if not rounds:
            return
        if self._supports_upsert():
            self.session.execute(self._insert_ignoring_duplicates(_ROUNDS, "round_id"),
                                 [{**r, "probes_ok": 0, "probes_failed": 0, "status": ROUND_RUNNING} for r in rounds])
        else:
            for r in rounds:
                if self.session.get(RoundRow, r["round_id"]) is None:
                    self.session.add(RoundRow(**r, probes_ok=0, probes_failed=0, status=ROUND_RUNNING))
            self.session.flush()
        latest: dict[str, datetime] = {}
        for r in rounds:
            latest[r["target"]] = max(latest.get(r["target"], r["started_at"]), r["started_at"])
        for target, started_at in latest.items():
            self.abort_open_rounds(target=target, started_before=started_at)

    def finish_round(self, round_id: str, *, finished_at: datetime, ok: int, failed: int) -> None:
        """Set the round's end and counts and mark it complete; repeating it writes the same values (idempotent)."""
        self.session.execute(update(RoundRow).where(RoundRow.round_id == round_id)
                             .values(finished_at=finished_at, probes_ok=ok, probes_failed=failed,
                                     status=ROUND_COMPLETE))

    @staticmethod
    def _recorded_values() -> dict[str, ColumnElement[Any]]:
        """A round's counts and end as its stored results tell them (correlated subqueries, one UPDATE)."""
        mine = ProbeResultRow.round_id == RoundRow.round_id
        ok = select(func.count()).where(mine, ProbeResultRow.status == "ok").scalar_subquery()
        failed = select(func.count()).where(mine, ProbeResultRow.status != "ok").scalar_subquery()
        last = select(func.max(ProbeResultRow.created_at)).where(mine).scalar_subquery()
        return dict(probes_ok=ok, probes_failed=failed, finished_at=func.coalesce(last, RoundRow.started_at))

    def abort_open_rounds(self, *, target: str | None = None, started_before: datetime | None = None) -> int:
        """Close still-running rounds (of `target`, started before `started_before`) as aborted.

        What they did record is kept: the counts come from their stored results, the end is their
        last result's time (their start when they stored none). Returns how many were closed.
        """
        query = update(RoundRow).where(RoundRow.status == ROUND_RUNNING)
        if target is not None:
            query = query.where(RoundRow.target == target)
        if started_before is not None:
            query = query.where(RoundRow.started_at < started_before)
        # an UPDATE's result is a CursorResult; Session.execute is typed for any statement
        closed = cast(CursorResult[Any], self.session.execute(
            query.values(status=ROUND_ABORTED, **self._recorded_values()).execution_options(synchronize_session=False)))
        return int(closed.rowcount or 0)

    def _recount_aborted(self, round_ids: Iterable[str]) -> None:
        """Results of an aborted round that arrive after it was closed (replayed from the disk buffer)
        are counted in, so its counts always equal what it stored."""
        ids = sorted(set(round_ids))
        if ids:
            self.session.execute(update(RoundRow).where(RoundRow.round_id.in_(ids), RoundRow.status == ROUND_ABORTED)
                                 .values(**self._recorded_values()).execution_options(synchronize_session=False))

    def add(self, result: ProbeResult) -> bool:
        """Insert unless a row with the same result_id exists; returns whether it inserted."""
        return self.add_many([result]) == 1

    def add_many(self, results: Iterable[ProbeResult]) -> int:
        """Insert a batch in one statement, skipping result ids already stored; returns rows inserted."""
        rows = [r.to_dict() for r in results]
        if not rows:
            return 0
        if not self._supports_upsert():
            inserted = 0
            for values in rows:
                if self.session.get(ProbeResultRow, values["result_id"]) is None:
                    self.session.add(ProbeResultRow(**values))
                    inserted += 1
            self.session.flush()
            self._recount_aborted(v["round_id"] for v in rows)
            return inserted
        # Count what is new before inserting: drivers do not report rowcounts of batched inserts
        # reliably. The "on conflict do nothing" still guards against a concurrent writer.
        before = set(self.session.scalars(select(ProbeResultRow.result_id)
                                          .where(ProbeResultRow.result_id.in_([v["result_id"] for v in rows]))))
        fresh = list({v["result_id"]: v for v in rows if v["result_id"] not in before}.values())
        if fresh:
            self.session.execute(self._insert_ignoring_duplicates(_RESULTS, "result_id"), fresh)
            self._recount_aborted(v["round_id"] for v in fresh)
        return len(fresh)

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
