"""Client-measured timings and dense baselines.

- probe_results.client_ttft_ms / client_decode_tokens_per_s: the collector streams every HTTP probe
  and times it itself (network included), so a server that reports nothing (any OpenAI-compatible
  baseline) still has a time to first token and a decode speed. Rows written before stay NULL.
- probe_results.baseline: a dense run (sensitivity 0) the collector made on purpose on the same
  target to time the dense model; existing rows were not (false).

A store created by create_all from newer models already has some of these; only missing ones are added.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NEW_COLUMNS = (
    sa.Column("client_ttft_ms", sa.Float(), nullable=True),
    sa.Column("client_decode_tokens_per_s", sa.Float(), nullable=True),
    sa.Column("baseline", sa.Boolean(), nullable=False, server_default=sa.false()),
)


def _present() -> set[str]:
    return {column["name"] for column in sa.inspect(op.get_bind()).get_columns("probe_results")}


def upgrade() -> None:
    missing = [column for column in NEW_COLUMNS if column.name not in _present()]
    if missing:
        with op.batch_alter_table("probe_results") as batch:  # batch mode: SQLite cannot ALTER freely
            for column in missing:
                batch.add_column(column)


def downgrade() -> None:
    present = [column.name for column in reversed(NEW_COLUMNS) if column.name in _present()]
    if present:
        with op.batch_alter_table("probe_results") as batch:
            for name in present:
                batch.drop_column(name)
