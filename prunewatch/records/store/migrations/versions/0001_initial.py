"""Initial schema: collector rounds and probe results, as the embedded collector first created them.

Revision ID: 0001
Revises:
Create Date: 2025-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "collector_rounds",
        sa.Column("round_id", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("probes_ok", sa.Integer(), nullable=False),
        sa.Column("probes_failed", sa.Integer(), nullable=False),
        sa.Column("probe_set_digest", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("round_id"),
    )
    op.create_index("ix_collector_rounds_started_at", "collector_rounds", ["started_at"])
    op.create_table(
        "probe_results",
        sa.Column("result_id", sa.String(length=32), nullable=False),
        sa.Column("round_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("target", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("probe_id", sa.String(length=128), nullable=False),
        sa.Column("probe_version", sa.Integer(), nullable=False),
        sa.Column("probe_hash", sa.String(length=16), nullable=False),
        sa.Column("domain", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("failure_reason", sa.String(length=32), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("sensitivity", sa.Float(), nullable=True),
        sa.Column("pruning_ratio", sa.Float(), nullable=True),
        sa.Column("ratio_unit", sa.String(length=32), nullable=True),
        sa.Column("ratio_source", sa.String(length=16), nullable=True),
        sa.Column("executed_flops", sa.Float(), nullable=True),
        sa.Column("dense_flops", sa.Float(), nullable=True),
        sa.Column("layers_bypassed", sa.JSON(), nullable=True),
        sa.Column("layers_total", sa.Integer(), nullable=True),
        sa.Column("heads_gated", sa.Integer(), nullable=True),
        sa.Column("activation_sparsity", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("preprocessing_ms", sa.Float(), nullable=True),
        sa.Column("inference_ms", sa.Float(), nullable=True),
        sa.Column("postprocessing_ms", sa.Float(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("decode_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("token_agreement", sa.Float(), nullable=True),
        sa.Column("perplexity_delta_pct", sa.Float(), nullable=True),
        sa.Column("matched_domain", sa.String(length=64), nullable=True),
        sa.Column("domain_confidence", sa.Float(), nullable=True),
        sa.Column("fallback_reason", sa.String(length=64), nullable=True),
        sa.Column("peak_memory_bytes", sa.Float(), nullable=True),
        sa.Column("dram_bytes_per_instruction", sa.Float(), nullable=True),
        sa.Column("dram_source", sa.String(length=16), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=True),
        sa.Column("output_text", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["round_id"], ["collector_rounds.round_id"]),
        sa.PrimaryKeyConstraint("result_id"),
    )
    op.create_index("ix_probe_results_created_at", "probe_results", ["created_at"])
    op.create_index("ix_probe_results_target_created_at", "probe_results", ["target", "created_at"])
    op.create_index("ix_probe_results_domain_created_at", "probe_results", ["domain", "created_at"])


def downgrade() -> None:
    op.drop_table("probe_results")
    op.drop_table("collector_rounds")
