"""Round status (running, complete, aborted) and the device each result's timings were measured on.

- collector_rounds.status: a round whose collector died stayed open forever (finished_at NULL, counts
  0). The next start closes such rounds as `aborted` with the counts of the results they stored; a
  round closed by its own end is `complete`. Existing rounds with an end become `complete`; open
  ones stay `running` for that start to close (not here: a collector may be running during the
  upgrade). Indexed with the target, so finding open rounds at each start stays cheap.
- probe_results.device / device_name: where the timings were measured (cpu or cuda, and the CPU's
  or GPU's name), so CPU time is never reported as GPU time. Rows written before stay NULL: not
  recorded then.

A store created by create_all from newer models already has some of these; only missing ones are
added, and the backfill touches only rounds still marked running that have an end.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RESULT_COLUMNS = (("device", 16), ("device_name", 128))
STATUS_INDEX = ("ix_collector_rounds_status_target", ["status", "target"])


def _columns(table: str) -> set[str]:
    return {column["name"] for column in sa.inspect(op.get_bind()).get_columns(table)}


def _indexes(table: str) -> set[str]:
    return {ix["name"] for ix in sa.inspect(op.get_bind()).get_indexes(table)}


def upgrade() -> None:
    missing = [(name, width) for name, width in RESULT_COLUMNS if name not in _columns("probe_results")]
    if missing:
        with op.batch_alter_table("probe_results") as batch:  # batch mode: SQLite cannot ALTER freely
            for name, width in missing:
                batch.add_column(sa.Column(name, sa.String(length=width), nullable=True))
    if "status" not in _columns("collector_rounds"):
        with op.batch_alter_table("collector_rounds") as batch:
            batch.add_column(sa.Column("status", sa.String(length=16), nullable=False, server_default="running"))
    op.execute(sa.text("UPDATE collector_rounds SET status = 'complete' "
                       "WHERE status = 'running' AND finished_at IS NOT NULL"))
    name, columns = STATUS_INDEX
    if name not in _indexes("collector_rounds"):
        op.create_index(name, "collector_rounds", columns)


def downgrade() -> None:
    name, _columns_of_index = STATUS_INDEX
    if name in _indexes("collector_rounds"):
        op.drop_index(name, table_name="collector_rounds")
    if "status" in _columns("collector_rounds"):
        with op.batch_alter_table("collector_rounds") as batch:
            batch.drop_column("status")
    present = [name for name, _width in reversed(RESULT_COLUMNS) if name in _columns("probe_results")]
    if present:
        with op.batch_alter_table("probe_results") as batch:
            for name in present:
                batch.drop_column(name)
