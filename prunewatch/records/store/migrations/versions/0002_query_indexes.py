"""Indexes for the queries dashboards, ROI and retention run.

- (model, domain, created_at): ROI and quality trends per model and domain over a time range;
- (round_id): the foreign key (PostgreSQL does not index one by itself), used by round joins and
  by retention deleting rounds whose results are gone;
- collector_rounds (target, started_at): "last rounds of this target" (doctor, dashboards).

A store that was created before migrations existed (create_all from the then-current models)
may already have some of them, so each is created only when missing.

Revision ID: 0002
Revises: 0001
Create Date: 2025-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = (
    ("ix_probe_results_model_domain_created_at", "probe_results", ["model", "domain", "created_at"]),
    ("ix_probe_results_round_id", "probe_results", ["round_id"]),
    ("ix_collector_rounds_target_started_at", "collector_rounds", ["target", "started_at"]),
)


def _existing(table: str) -> set[str]:
    return {ix["name"] for ix in sa.inspect(op.get_bind()).get_indexes(table)}


def upgrade() -> None:
    for name, table, columns in INDEXES:
        if name not in _existing(table):
            op.create_index(name, table, columns)


def downgrade() -> None:
    for name, table, _columns in reversed(INDEXES):
        if name in _existing(table):
            op.drop_index(name, table_name=table)
