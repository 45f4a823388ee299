"""The quality governor's decisions in the store: plain `GovernorDecision` objects in and out.

A repository over a session the caller owns (it never commits), like `ResultRepository`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from prunewatch.records.store.models import GovernorDecisionRow


@dataclass(frozen=True)
class GovernorDecision:
    """What the governor did for one (target, model, domain) after one round, and on what evidence."""

    decided_at: datetime
    target: str
    model: str
    domain: str
    old_setting: float  # pruning sensitivity the round ran at
    new_setting: float  # sensitivity of the next round (and of live traffic on a prunewatch engine)
    reason: str  # breach, breach_at_min, relax, hold, hold_near_floor, hold_at_max, no_evidence
    agreement: float | None  # pooled reference agreement of the evidence window; None: not measured
    probes: int  # prompts whose agreement counted
    good_rounds: int  # consecutive evaluations with the interval's lower bound at or above floor + margin
    floor: float
    round_id: str | None = None
    agreement_low: float | None = None  # 95% interval of `agreement`, bootstrapped over prompts
    agreement_high: float | None = None
    tokens: int | None = None  # answer tokens behind `agreement`

    @property
    def changed(self) -> bool:
        return self.new_setting != self.old_setting

    @property
    def clamped(self) -> bool:
        """The governor had to lower the setting (a breach of the floor)."""
        return self.new_setting < self.old_setting


_FIELDS = ("decided_at", "target", "model", "domain", "old_setting", "new_setting", "reason", "agreement", "probes",
           "good_rounds", "floor", "round_id", "agreement_low", "agreement_high", "tokens")


def _to_decision(row: GovernorDecisionRow) -> GovernorDecision:
    values = {name: getattr(row, name) for name in _FIELDS}
    if values["decided_at"].tzinfo is None:  # SQLite keeps no zone; every timestamp is written in UTC
        values["decided_at"] = values["decided_at"].replace(tzinfo=UTC)
    return GovernorDecision(**values)


class GovernorRepository:
    """Write decisions, read the history and the newest decision per key. Never commits."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def add(self, decision: GovernorDecision) -> None:
        self.session.add(GovernorDecisionRow(**{name: getattr(decision, name) for name in _FIELDS}))

    def history(self, *, target: str | None = None, domain: str | None = None,
                since: datetime | None = None) -> list[GovernorDecision]:
        """Decisions oldest first, optionally of one target / domain / since an instant."""
        query = select(GovernorDecisionRow)
        if target is not None:
            query = query.where(GovernorDecisionRow.target == target)
        if domain is not None:
            query = query.where(GovernorDecisionRow.domain == domain)
        if since is not None:
            query = query.where(GovernorDecisionRow.decided_at >= since)
        query = query.order_by(GovernorDecisionRow.decided_at, GovernorDecisionRow.id)
        return [_to_decision(row) for row in self.session.scalars(query)]

    def latest(self, *, target: str | None = None) -> list[GovernorDecision]:
        """The newest decision of each (target, model, domain), sorted by key: the policy in force and why."""
        newest = select(func.max(GovernorDecisionRow.id).label("id")).group_by(
            GovernorDecisionRow.target, GovernorDecisionRow.model, GovernorDecisionRow.domain)
        if target is not None:
            newest = newest.where(GovernorDecisionRow.target == target)
        query = select(GovernorDecisionRow).where(GovernorDecisionRow.id.in_(newest.scalar_subquery())).order_by(
            GovernorDecisionRow.target, GovernorDecisionRow.model, GovernorDecisionRow.domain)
        return [_to_decision(row) for row in self.session.scalars(query)]
