"""Decisions of the quality governor.

- governor_decisions: one row per (target, model, domain) and governed round: the sensitivity before
  and after, why (breach, relax, hold, ...) and the evidence (mean token agreement, probes counted,
  consecutive good rounds, the floor, the round). `prunewatch governor status` reads the newest row of
  each key; the collector resumes from it after a restart.

A store created by create_all from newer models already has the table; then only missing indexes are added.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "governor_decisions"
INDEXES = (
    ("ix_governor_decisions_target_domain_decided_at", ["target", "domain", "decided_at"]),
    ("ix_governor_decisions_decided_at", ["decided_at"]),
)


def _tables() -> set[str]:
    return set(sa.inspect(op.get_bind()).get_table_names())


def _indexes() -> set[str]:
    return {ix["name"] for ix in sa.inspect(op.get_bind()).get_indexes(TABLE)}


def upgrade() -> None:
    if TABLE not in _tables():
        op.create_table(
            TABLE,
            sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
            sa.Column("decided_at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("target", sa.String(length=128), nullable=False),
            sa.Column("model", sa.String(length=256), nullable=False),
            sa.Column("domain", sa.String(length=64), nullable=False),
            sa.Column("old_setting", sa.Float(), nullable=False),
            sa.Column("new_setting", sa.Float(), nullable=False),
            sa.Column("reason", sa.String(length=32), nullable=False),
            sa.Column("agreement", sa.Float(), nullable=True),
            sa.Column("probes", sa.Integer(), nullable=False),
            sa.Column("good_rounds", sa.Integer(), nullable=False),
            sa.Column("floor", sa.Float(), nullable=False),
            sa.Column("round_id", sa.String(length=32), nullable=True),
        )
    present = _indexes()
    for name, columns in INDEXES:
        if name not in present:
            op.create_index(name, TABLE, columns)


def downgrade() -> None:
    if TABLE in _tables():
        op.drop_table(TABLE)
