"""The unit of record shared by every part: one probe run against one target, successful or not.

Plain data, importing nothing of the engine: the ROI app, alerts and dashboards read it without torch.
The engine's RequestStats become a ProbeResult in prunewatch/records/engine_stats.py."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

from prunewatch.probes import Probe


def utcnow() -> datetime:
    return datetime.now(UTC)


FAILURE_REASONS = ("timeout", "unreachable", "auth", "rate_limited", "server_error", "invalid_request", "protocol",
                   "engine_error", "exception")
"""Every `failure_reason` a failed probe can carry (prunewatch.collector.probe_round.classify_failure and the targets'
errors): the failures counter starts each at 0, so the first failure of a target is an increase."""


@dataclass
class ProbeResult:
    """What one probe measured. Exporters turn it into a SQL row, metric samples or a log line.

    `result_id` is fixed when the result is made, so writing it twice (a retry) is idempotent.
    Fields that a target could not measure stay None; they are never filled with zeros.
    """

    target: str
    model: str
    probe_id: str
    probe_version: int
    probe_hash: str
    domain: str
    status: str  # "ok" or "failed"
    round_id: str
    result_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: datetime = field(default_factory=utcnow)
    failure_reason: str | None = None  # one of FAILURE_REASONS
    error_message: str | None = None
    sensitivity: float | None = None
    pruning_ratio: float | None = None
    prefill_pruning_ratio: float | None = None  # the prompt's forward pass alone
    decode_pruning_ratio: float | None = None  # the decode steps alone
    ratio_unit: str | None = None
    ratio_source: str | None = None  # measured (counted by the engine) or absent
    executed_flops: int | None = None
    dense_flops: int | None = None
    layers_bypassed: list[int] | None = None
    layers_total: int | None = None
    heads_gated: int | None = None
    activation_sparsity: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    preprocessing_ms: float | None = None
    inference_ms: float | None = None
    postprocessing_ms: float | None = None
    quality_ms: float | None = None  # the quality check against the dense model, when asked for
    ttft_ms: float | None = None
    tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    # Quality of the served answer, scored against a dense reference (see prunewatch/collector/reference.py):
    reference_agreement: float | None = None  # served tokens equal to the reference's argmax given the served prefix
    reference_tokens: int | None = None  # served answer tokens scored
    served_nll: float | None = None  # mean NLL (nats/token) of the served answer under the reference
    reference_nll: float | None = None  # ... of the reference's own greedy answer (when one was generated)
    divergence_at: int | None = None  # first token where the served answer leaves the reference's greedy answer
    quality_source: str | None = None  # "engine" (the serving engine's own dense pass) or "reference:<name>"
    task_passed: bool | None = None  # the probe's machine check on the served text; None: the probe has none
    # Secondary, from a prunewatch engine asked for the full check: the pruned model teacher-forced on the dense
    # model's own continuation (an answer that left the dense path early can still score high here).
    continuation_agreement: float | None = None
    perplexity_delta_pct: float | None = None
    matched_domain: str | None = None
    domain_confidence: float | None = None
    fallback_reason: str | None = None
    peak_memory_bytes: int | None = None
    dram_bytes_per_instruction: float | None = None
    dram_source: str | None = None
    duration_ms: float | None = None  # wall time of the whole probe as the collector saw it
    output_text: str | None = None
    device: str | None = None  # where the timings were measured: "cpu", "cuda", ...; None when not reported
    device_name: str | None = None  # e.g. the GPU's or CPU's model name; None when not reported
    # Timed by the collector on the streamed answer, network included (any HTTP target; None in-process):
    client_ttft_ms: float | None = None  # request sent -> first content token received
    client_decode_tokens_per_s: float | None = None  # (completion tokens - 1) / (last token - first token)
    baseline: bool = False  # a dense run (sensitivity 0) made on purpose to time the dense model on this target

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value; lists are copied. Shallow on purpose: dataclasses.asdict deep-copies
        every value and made serialising the dominant cost of writing results in bulk."""
        values = {name: getattr(self, name) for name in _FIELD_NAMES}
        if values["layers_bypassed"] is not None:
            values["layers_bypassed"] = list(values["layers_bypassed"])
        return values

    @classmethod
    def failure(cls, *, target: str, model: str, probe: Probe, round_id: str, reason: str, message: str,
                duration_ms: float) -> ProbeResult:
        return cls(
            target=target, model=model, probe_id=probe.id, probe_version=probe.version,
            probe_hash=probe.content_hash, domain=probe.domain, status="failed", round_id=round_id,
            failure_reason=reason, error_message=message[:2000], duration_ms=duration_ms,
        )


_FIELD_NAMES = tuple(f.name for f in fields(ProbeResult))
