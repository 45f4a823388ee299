"""Tables: one row per collector round, one row per probe result.

The schema of record is the Alembic history in prunewatch/records/store/migrations; these models equal its
head (a test compares them), so a change here needs a new revision there.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


ROUND_RUNNING = "running"  # started; closed by its own end, or as aborted when its process died
ROUND_COMPLETE = "complete"  # its collector recorded the end (counts as the round saw them)
ROUND_ABORTED = "aborted"  # closed at a later start: counts from the results it stored, end at its last one


class RoundRow(Base):
    """One probe round: every probe against one target."""

    __tablename__ = "collector_rounds"

    round_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    target: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    probes_ok: Mapped[int] = mapped_column(Integer, default=0)
    probes_failed: Mapped[int] = mapped_column(Integer, default=0)
    probe_set_digest: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default=ROUND_RUNNING, server_default=ROUND_RUNNING)

    __table_args__ = (
        Index("ix_collector_rounds_target_started_at", "target", "started_at"),
        Index("ix_collector_rounds_status_target", "status", "target"),  # open rounds, found at each start
    )


class ProbeResultRow(Base):
    """One probe's measurement; nullable columns are figures the target could not measure."""

    __tablename__ = "probe_results"

    result_id: Mapped[str] = mapped_column(String(32), primary_key=True)  # idempotent writes
    round_id: Mapped[str] = mapped_column(String(32), ForeignKey("collector_rounds.round_id"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    target: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    probe_id: Mapped[str] = mapped_column(String(128))
    probe_version: Mapped[int] = mapped_column(Integer)
    probe_hash: Mapped[str] = mapped_column(String(16))
    domain: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    failure_reason: Mapped[str | None] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)
    sensitivity: Mapped[float | None] = mapped_column(Float)
    pruning_ratio: Mapped[float | None] = mapped_column(Float)
    prefill_pruning_ratio: Mapped[float | None] = mapped_column(Float)
    decode_pruning_ratio: Mapped[float | None] = mapped_column(Float)
    ratio_unit: Mapped[str | None] = mapped_column(String(32))
    ratio_source: Mapped[str | None] = mapped_column(String(16))
    executed_flops: Mapped[int | None] = mapped_column(Float)  # Float: exceeds int32/int64 on large models
    dense_flops: Mapped[int | None] = mapped_column(Float)
    layers_bypassed: Mapped[list[int] | None] = mapped_column(JSON)
    layers_total: Mapped[int | None] = mapped_column(Integer)
    heads_gated: Mapped[int | None] = mapped_column(Integer)
    activation_sparsity: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    preprocessing_ms: Mapped[float | None] = mapped_column(Float)
    inference_ms: Mapped[float | None] = mapped_column(Float)
    postprocessing_ms: Mapped[float | None] = mapped_column(Float)
    quality_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    decode_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    continuation_agreement: Mapped[float | None] = mapped_column(Float)  # pruned, teacher-forced on dense's answer
    perplexity_delta_pct: Mapped[float | None] = mapped_column(Float)
    reference_agreement: Mapped[float | None] = mapped_column(Float)  # served tokens equal to the reference's argmax
    reference_tokens: Mapped[int | None] = mapped_column(Integer)  # served tokens scored
    served_nll: Mapped[float | None] = mapped_column(Float)  # mean NLL of the served answer under the reference
    reference_nll: Mapped[float | None] = mapped_column(Float)  # the reference's NLL on its own greedy answer
    divergence_at: Mapped[int | None] = mapped_column(Integer)  # first token leaving the reference's answer
    quality_source: Mapped[str | None] = mapped_column(String(64))  # which reference scored the answer
    task_passed: Mapped[bool | None] = mapped_column(Boolean)  # the probe's check on the served text
    matched_domain: Mapped[str | None] = mapped_column(String(64))
    domain_confidence: Mapped[float | None] = mapped_column(Float)
    fallback_reason: Mapped[str | None] = mapped_column(String(64))
    peak_memory_bytes: Mapped[int | None] = mapped_column(Float)
    dram_bytes_per_instruction: Mapped[float | None] = mapped_column(Float)
    dram_source: Mapped[str | None] = mapped_column(String(16))
    duration_ms: Mapped[float | None] = mapped_column(Float)
    output_text: Mapped[str | None] = mapped_column(Text)
    device: Mapped[str | None] = mapped_column(String(16))  # where timings were measured: cpu, cuda, ...
    device_name: Mapped[str | None] = mapped_column(String(128))
    client_ttft_ms: Mapped[float | None] = mapped_column(Float)  # timed by the collector, network included
    client_decode_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    baseline: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    __table_args__ = (
        Index("ix_probe_results_created_at", "created_at"),
        Index("ix_probe_results_target_created_at", "target", "created_at"),
        Index("ix_probe_results_domain_created_at", "domain", "created_at"),
        Index("ix_probe_results_model_domain_created_at", "model", "domain", "created_at"),
        Index("ix_probe_results_round_id", "round_id"),
    )


class GovernorDecisionRow(Base):
    """One decision of the quality governor: the sensitivity of a (target, model, domain) and the evidence."""

    __tablename__ = "governor_decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    decided_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    target: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    domain: Mapped[str] = mapped_column(String(64))
    old_setting: Mapped[float] = mapped_column(Float)
    new_setting: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(String(32))  # breach, relax, hold, ... (prunewatch/collector/governor.py)
    agreement: Mapped[float | None] = mapped_column(Float)  # pooled reference agreement of the window; None: none
    agreement_low: Mapped[float | None] = mapped_column(Float)  # its 95% interval, bootstrapped over prompts
    agreement_high: Mapped[float | None] = mapped_column(Float)
    probes: Mapped[int] = mapped_column(Integer)  # prompts whose agreement counted
    tokens: Mapped[int | None] = mapped_column(Integer)  # answer tokens behind the figure
    good_rounds: Mapped[int] = mapped_column(Integer)  # consecutive rounds at or above floor + margin
    floor: Mapped[float] = mapped_column(Float)
    round_id: Mapped[str | None] = mapped_column(String(32))  # not a foreign key: written apart from the round

    __table_args__ = (
        Index("ix_governor_decisions_target_domain_decided_at", "target", "domain", "decided_at"),
        Index("ix_governor_decisions_decided_at", "decided_at"),
    )
