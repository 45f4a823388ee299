"""Per-phase pruning ratios and the quality check's own time.

- prefill_pruning_ratio / decode_pruning_ratio: the request ratio split by phase. Decode steps are
  where skipping saves wall time (memory-bound, one row each), so alerts on savings read the decode
  ratio; a long prefill runs dense and would otherwise dilute it.
- quality_ms: the dense re-run and scoring behind token_agreement, no longer hidden in
  postprocessing_ms.

Rows written before this revision keep NULL: those figures were not measured apart then. A store
created by create_all from newer models already has the columns; only missing ones are added.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("prefill_pruning_ratio", "decode_pruning_ratio", "quality_ms")


def _existing() -> set[str]:
    return {column["name"] for column in sa.inspect(op.get_bind()).get_columns("probe_results")}


def upgrade() -> None:
    missing = [name for name in COLUMNS if name not in _existing()]
    with op.batch_alter_table("probe_results") as batch:  # batch mode: SQLite cannot ALTER freely
        for name in missing:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    present = [name for name in reversed(COLUMNS) if name in _existing()]
    with op.batch_alter_table("probe_results") as batch:
        for name in present:
            batch.drop_column(name)
