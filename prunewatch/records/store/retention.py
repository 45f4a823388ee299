"""Retention: delete probe results (and then emptied rounds) older than a cut-off, and the governor's
decisions older than it except the newest per (target, model, domain), which is the policy in force.

Deletes run in bounded batches, each its own transaction, so pruning a large PostgreSQL table
never holds one long lock the collector's inserts would queue behind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine, delete, exists, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import InstrumentedAttribute, Session, aliased
from sqlalchemy.sql import ColumnElement

from prunewatch.records.results import utcnow
from prunewatch.records.store.database import StoreUnavailableError, reason
from prunewatch.records.store.models import GovernorDecisionRow, ProbeResultRow, RoundRow

_UNITS = {"m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
_DURATION = re.compile(r"^\s*(\d+)\s*([mhdw])\s*$")
MAX_AGE = timedelta(days=36_500)  # a century: older than any store


def parse_age(text: str) -> timedelta:
    """'90d', '12h', '30m', '2w' as a timedelta; ValueError with the accepted forms otherwise."""
    match = _DURATION.match(text or "")
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"expected a positive age like 90d, 12h, 30m or 2w, got {text!r}")
    seconds = int(match.group(1)) * _UNITS[match.group(2)]
    if seconds > MAX_AGE.total_seconds():  # a cut-off before year 1 cannot be computed
        raise ValueError(f"{text.strip()!r} is longer than the longest age accepted, {MAX_AGE.days} days")
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class PruneReport:
    cutoff: datetime
    results_deleted: int
    rounds_deleted: int
    dry_run: bool
    decisions_deleted: int = 0  # governor decisions superseded by a newer one for the same key


def prune_older_than(engine: Engine, age: timedelta, *, now: datetime | None = None, batch_size: int = 5000,
                     dry_run: bool = False) -> PruneReport:
    """Delete results created before now - age, then rounds started before it with no results left, then
    governor decisions made before it that a newer decision for the same key superseded."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    cutoff = (now or utcnow()) - age
    old_results = ProbeResultRow.created_at < cutoff
    empty_old_rounds = (RoundRow.started_at < cutoff) & ~exists().where(ProbeResultRow.round_id == RoundRow.round_id)
    newer = aliased(GovernorDecisionRow)
    decision = GovernorDecisionRow
    superseded_old_decisions = (decision.decided_at < cutoff) & exists().where(
        (newer.target == decision.target) & (newer.model == decision.model) & (newer.domain == decision.domain)
        & (newer.id > decision.id))  # newer as GovernorRepository.latest reads it: written later
    try:
        if dry_run:
            with Session(engine) as session:
                results = int(session.scalar(select(func.count()).select_from(ProbeResultRow).where(old_results)) or 0)
                rounds = int(session.scalar(
                    select(func.count()).select_from(RoundRow).where(
                        (RoundRow.started_at < cutoff)
                        & ~exists().where((ProbeResultRow.round_id == RoundRow.round_id) & ~old_results))) or 0)
                decisions = int(session.scalar(
                    select(func.count()).select_from(decision).where(superseded_old_decisions)) or 0)
            return PruneReport(cutoff, results, rounds, True, decisions)
        results = _delete_in_batches(engine, ProbeResultRow.result_id, old_results, batch_size)
        rounds = _delete_in_batches(engine, RoundRow.round_id, empty_old_rounds, batch_size)
        decisions = _delete_in_batches(engine, decision.id, superseded_old_decisions, batch_size)
    except SQLAlchemyError as exc:
        raise StoreUnavailableError(f"cannot prune the store: {reason(exc)}") from exc
    return PruneReport(cutoff, results, rounds, False, decisions)


def _delete_in_batches(engine: Engine, key: InstrumentedAttribute[str] | InstrumentedAttribute[int],
                       condition: ColumnElement[bool], batch_size: int) -> int:
    table = key.class_
    total = 0
    for _ in range(1_000_000):  # bounded: at most a billion rows at the smallest batch size
        with Session(engine) as session, session.begin():
            ids = list(session.scalars(select(key).where(condition).limit(batch_size)))
            if not ids:
                return total
            session.execute(delete(table).where(key.in_(ids)))
            total += len(ids)
    return total
