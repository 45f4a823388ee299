"""Quality of what each engine served, scored against a dense reference, with its evidence.

- probe_results.token_agreement is renamed continuation_agreement: it is the pruned model's
  teacher-forced agreement on the dense model's own continuation, a secondary figure that only a
  prunewatch engine can give.
- probe_results gains the primary figures: reference_agreement (share of the served answer's tokens
  equal to the dense reference's argmax given the served prefix), reference_tokens (the tokens
  scored), served_nll (mean NLL of the served answer under the reference), reference_nll (the
  reference's NLL on its own greedy answer), divergence_at (first token where the served answer leaves
  the reference's greedy answer), quality_source (which reference scored it) and task_passed (the
  probe's machine check on the served text). Rows written before stay NULL.
- governor_decisions gains the interval of its evidence: agreement_low, agreement_high and tokens.

A store created by create_all from newer models already has them; only what is missing is changed.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RESULT_COLUMNS = (
    sa.Column("reference_agreement", sa.Float(), nullable=True),
    sa.Column("reference_tokens", sa.Integer(), nullable=True),
    sa.Column("served_nll", sa.Float(), nullable=True),
    sa.Column("reference_nll", sa.Float(), nullable=True),
    sa.Column("divergence_at", sa.Integer(), nullable=True),
    sa.Column("quality_source", sa.String(64), nullable=True),
    sa.Column("task_passed", sa.Boolean(), nullable=True),
)
DECISION_COLUMNS = (
    sa.Column("agreement_low", sa.Float(), nullable=True),
    sa.Column("agreement_high", sa.Float(), nullable=True),
    sa.Column("tokens", sa.Integer(), nullable=True),
)


def _present(table: str) -> set[str]:
    return {column["name"] for column in sa.inspect(op.get_bind()).get_columns(table)}


def _add(table: str, columns: Sequence[sa.Column]) -> None:
    missing = [column for column in columns if column.name not in _present(table)]
    if missing:
        with op.batch_alter_table(table) as batch:  # batch mode: SQLite cannot ALTER freely
            for column in missing:
                batch.add_column(column)


def _drop(table: str, columns: Sequence[sa.Column]) -> None:
    present = [column.name for column in reversed(columns) if column.name in _present(table)]
    if present:
        with op.batch_alter_table(table) as batch:
            for name in present:
                batch.drop_column(name)


def upgrade() -> None:
    if "token_agreement" in _present("probe_results"):
        with op.batch_alter_table("probe_results") as batch:
            batch.alter_column("token_agreement", new_column_name="continuation_agreement")
    _add("probe_results", RESULT_COLUMNS)
    _add("governor_decisions", DECISION_COLUMNS)


def downgrade() -> None:
    _drop("governor_decisions", DECISION_COLUMNS)
    _drop("probe_results", RESULT_COLUMNS)
    if "continuation_agreement" in _present("probe_results"):
        with op.batch_alter_table("probe_results") as batch:
            batch.alter_column("continuation_agreement", new_column_name="token_agreement")
